"""The policies every backend follows, written once; each backend brings only its mechanism.

Horovod's ``horovod/_keras/__init__.py`` is the model: the logic lives here, and what differs between
frameworks (a collective, a tensor op) is passed in as a parameter. Nothing here imports a framework
(NumPy only inside the functions that need it), and the module runs on Python 3.6, as the CNTK and MXNet
adapters do.

- **Batch-share weights** (:func:`batch_share`, :func:`batch_shares`, :func:`relative_share`,
  :func:`even_share`): in an average over replicas, each replica weighs its rows over the global batch's
  rows; an empty replica weighs 0. Where the weight must be computed from tensors inside a compiled graph
  (TensorFlow's replica steps), the caller passes its framework's zero-safe division as ``divide``.
- **Rank 0 writes, atomically** (:func:`rank0_speaks_and_writes`, :func:`rank0_writes`,
  :func:`write_atomically`): only rank 0 writes at the path given, into a temporary file in the target's
  folder renamed onto the target once complete; the other ranks leave nothing on disk.
- **The fit-argument checks** (:func:`check_same_everywhere`): every worker of a job must make the same
  ``fit()``/``evaluate()``/``predict()`` calls on arrays, or the job hangs in the first step one of them skips.
- **Random-state sync** (:func:`sync_random_state`, :func:`every_epoch`): every rank takes rank 0's global random
  states, given the backend's "broadcast these bytes from rank 0", at fit()'s start and every epoch's: each
  worker holds the whole data set and takes its part of every global batch, so every worker must shuffle alike.
"""

import errno
import functools
import inspect
import os
import pickle
import random
import re
import shutil
import tempfile

from ..errors import CheckpointError, ShardError
from . import agreement, keras_model

# ---- batch-share weights


def batch_share(rows, total, divide=None):
    """A replica's weight in an average over the replicas: its ``rows`` over the global batch's ``total``;
    0 for a replica without rows, and 0 when ``total`` is 0.

    Summed over the replicas, ``share * value`` is the global batch's mean of a per-replica mean (a loss,
    a gradient), however unevenly the batch splits. Used by TensorFlow (each replica's gradient, inside its
    replica step), PyTorch (each rank's gradient, in the bucketed and the compressed all-reduce) and MXNet
    (each context's gradient and logged values); CNTK's 1/W is :func:`even_share`.

    Args:
        rows: this replica's rows (samples) in the step: a number, or a tensor when ``divide`` is given.
        total: the global batch's rows.
        divide: ``None`` for Python numbers; else the framework's division that gives 0 for ``x / 0``
            (``tf.math.divide_no_nan``), applied to ``rows`` and ``total`` as they are: the form for a weight
            computed from tensors inside a compiled graph.

    Example:
        >>> batch_share(3, 8), batch_share(0, 8), batch_share(0, 0)
        (0.375, 0.0, 0.0)
    """
    if divide is not None:
        return divide(rows, total)
    if not rows or not total:
        return 0.0
    return rows / float(total)


def batch_shares(counts, total=None):
    """Every replica's :func:`batch_share`, from each one's rows (``counts``) and the global batch's ``total``
    (default: their sum). Used by MXNet (a process' contexts, weighed by samples or by rows).

    Example:
        >>> batch_shares([3, 3, 2])
        [0.375, 0.375, 0.25]
    """
    total = sum(counts) if total is None else total
    return [batch_share(count, total) for count in counts]


def relative_share(rows, total, replicas, divide=None):
    """A replica's rows over an equal share of the global batch, ``replicas * rows / total``: 1 where the
    batch splits evenly. The weight that turns a per-replica mean which the framework averages equally over
    the replicas (a tf.keras 2.x loss, a ``keras.metrics.Mean`` updated with a scalar) into the global
    batch's. Used by TensorFlow (tf.keras 2.x losses, scalar Mean updates) and PyTorch (scalar Mean
    updates); ``divide`` as in :func:`batch_share` (TensorFlow passes ``tf.math.divide_no_nan``).

    Example:
        >>> relative_share(3, 8, 2)
        0.75
    """
    return batch_share(rows * replicas, total, divide)


def even_share(parts):
    """Each part's weight when a batch splits into ``parts`` equal parts: ``1 / parts``. Used by CNTK, whose
    workers each train on an equal part of every global batch (an uneven last batch is evened out with
    sample weights, :func:`distkeras.sharding.batch_rows`), so each worker's loss weighs 1/W."""
    return batch_share(1, parts)


# ---- every rank holds the same variables


def variable_lines(variables):
    """``(lines, fingerprint)``: one line per variable (path, shape, dtype), and two integers (their count, a CRC of
    their shapes and dtypes) that every rank compares before rank 0's values are given to all: a rank with a
    variable the others lack (a tracker made under ``if rank == 0:``) would otherwise make collectives of other
    sizes, which wait forever or abort the engine."""
    import zlib

    lines = ["{} {} {}".format(getattr(v, "path", None) or getattr(v, "name", "?"),
                               tuple(int(d) for d in v.shape), getattr(v.dtype, "name", v.dtype)) for v in variables]
    shapes = "\n".join(line.split(" ", 1)[1] for line in lines).encode()
    return lines, (len(lines), zlib.crc32(shapes))


def variables_differ(held, ranks, what="variables"):
    """The :class:`~distkeras.errors.CollectiveError` of ranks whose variables differ: ``held[i]``, the lines
    (:func:`variable_lines`) of the process of rank ``ranks[i]``."""
    from ..errors import CollectiveError

    held = [set(lines) for lines in held]
    common = set.intersection(*held) if held else set()
    differences = []
    for lines, rank in zip(held, ranks):
        extra = sorted(lines - common)
        if extra:
            differences.append("rank {} has {} the others lack ({}{})".format(
                rank, len(extra), ", ".join(extra[:4]), ", ..." if len(extra) > 4 else ""))
    return CollectiveError(
        "Expected every process to hold the same {} (rank 0's values are given to all). Received: {}. A variable "
        "made on some ranks only (a metric, a tracker or a layer under `if rank == 0:`) makes them differ: make it on "
        "every rank, or after training on rank 0 alone, once the model is no longer distributed.".format(
            what, "; ".join(differences) or "as many on every rank, of other shapes or dtypes"))


def first_line(exc):
    """``exc`` in one line: its type and the first line of its message with text, terminal colour codes removed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in lines if not line.startswith("Exception encountered")), lines[0] if lines else "")
    return "{}: {}".format(type(exc).__name__, first[:500])


def split_batch_note(exc, rows, total):
    """``exc``'s message with what it likely means added, where it names a shape that is the global batch's row
    count (``total``, or one of the counts it may be) while the replica holds its share (a batch size fixed in ``call()``: ``keras.random.normal((8, ...))``
    with 8 the global batch); None where it doesn't look like that. Used by the TensorFlow and PyTorch adapters."""
    import re

    totals = {total} if isinstance(total, int) else set(total or ())
    text = str(exc)
    numbers = {int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", text)}
    found = sorted(t for t in totals & numbers if rows and t > rows)
    if not rows or rows not in numbers or not found:
        return None
    total = found[-1]
    return ("{}\n\ndistkeras: each replica runs its share of the global batch: {} of its {} rows here. A shape "
            "fixed to the global batch size in the model (a draw or a reshape of {} rows, e.g. keras.random.normal(({}, "
            "...))) doesn't fit that share: take the batch size from the input, `keras.ops.shape(x)[0]`, and the "
            "model trains on any number of devices.".format(text, rows, total, total, total))


# ---- rank 0 writes, atomically

#: The suffixes of the single files Keras writes (``.keras``, ``.h5``, ``.weights.h5``): written atomically.
_FILE_SUFFIXES = (".keras", ".h5", ".hdf5")


def write_atomically(path, write, needs=None):
    """Call ``write(temporary_path)``, flush the file to disk, then rename it onto ``path`` (atomic on POSIX):
    a crash at any moment leaves the previous ``path`` intact, never a half-written one.

    Nothing planted in ``path``'s folder is ever followed (someone else who can write that folder, a shared file
    system): the temporary file is ``path``'s name inside a new private folder (``.tmp-`` and random letters,
    mode 700, made with ``mkdtemp``, so no name of it is known beforehand and nobody else can add to it), which
    ``write`` reaches through an open descriptor of that folder (``/proc/self/fd/N/name`` on Linux), not through
    its name: a link put in its place, or in place of the file, is not followed. The rename goes from that
    descriptor to one of ``path``'s folder; the private folder is removed whatever happens. Used by every backend's
    ``save``/``save_weights`` (:func:`rank0_writes`) and by :class:`distkeras.callbacks.BackupAndRestore`. Returns
    what ``write`` returned.

    Raises:
        CheckpointError: the disk (or the user's quota) is full: it names the folder, what was written and what
            is free, and says the previous file is intact.
    """
    folder, name = os.path.split(path)
    folder = folder or os.curdir
    if needs and _free(folder) is not None and _free(folder) < needs:
        # Before the writer starts: HDF5, once a write of it failed for space, crashes the interpreter at exit.
        raise disk_full_error(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 0, needs)
    folder_fd = os.open(folder, os.O_RDONLY | _O_DIRECTORY)
    try:
        private = tempfile.mkdtemp(prefix=".tmp-", dir=folder)
        try:
            private_fd = os.open(private, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW)
        except OSError:
            raise CheckpointError("The temporary folder {} distkeras had just made for writing {} was replaced by "
                                  "something else: someone else writes into {}. Nothing was written; keep the folder "
                                  "writable by this user only.".format(private, name, folder)) from None
        try:
            return _write_in(private_fd, folder_fd, name, path, write)
        finally:
            _empty(private_fd)
            os.close(private_fd)
            try:
                os.rmdir(os.path.basename(private), dir_fd=folder_fd)
            except OSError:
                pass
    finally:
        os.close(folder_fd)


_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _through(folder_fd, name):
    """A path to ``name`` in the folder open as ``folder_fd`` that goes through the descriptor, not a name."""
    if os.path.isdir("/proc/self/fd"):
        return "/proc/self/fd/{}/{}".format(folder_fd, name)
    return None


def _write_in(private_fd, folder_fd, name, path, write):
    temporary = _through(private_fd, name)
    if temporary is None:  # no /proc (not Linux): the private folder's own name, mode 700, random
        temporary = os.path.join(os.path.dirname(path) or os.curdir,
                                 _name_of(private_fd, folder_fd), name)
    try:
        result = write(temporary)
        fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW, dir_fd=private_fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(name, name, src_dir_fd=private_fd, dst_dir_fd=folder_fd)
        try:
            os.fsync(folder_fd)  # the rename itself, on disk
        except OSError:
            pass
        return result
    except OSError as exc:
        if not disk_full(exc):
            raise
        try:
            written = os.stat(name, dir_fd=private_fd, follow_symlinks=False).st_size
        except OSError:
            written = 0
        raise disk_full_error(path, exc, written) from exc


def _name_of(private_fd, folder_fd):
    stat = os.fstat(private_fd)
    for entry in os.listdir(folder_fd):
        try:
            if os.stat(entry, dir_fd=folder_fd, follow_symlinks=False).st_ino == stat.st_ino:
                return entry
        except OSError:
            continue
    raise CheckpointError("The temporary folder distkeras writes into was moved away while it wrote; nothing was "
                          "written.")


def _empty(folder_fd):
    """Remove what a failed or nested write left in the private folder open as ``folder_fd``."""
    for entry in os.listdir(folder_fd):
        try:
            if os.stat(entry, dir_fd=folder_fd, follow_symlinks=False).st_mode & 0o170000 == 0o040000:
                inner = os.open(entry, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW, dir_fd=folder_fd)
                try:
                    _empty(inner)
                finally:
                    os.close(inner)
                os.rmdir(entry, dir_fd=folder_fd)
            else:
                os.unlink(entry, dir_fd=folder_fd)
        except OSError:
            pass


#: The errnos of a full disk: no space left, the user's quota exceeded.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc):
    """Whether ``exc`` (an OSError) says the disk is full: its errno, or h5py's message (h5py's OSError of a failed
    HDF5 write carries the C errno in its text, "errno = 28", not always in ``errno``)."""
    if getattr(exc, "errno", None) in DISK_FULL:
        return True
    text = str(exc)
    return any("errno = {}".format(n) in text for n in DISK_FULL) or os.strerror(errno.ENOSPC) in text


def _free(folder):
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return None


def bytes_needed(model, name="save_weights"):
    """At least how many bytes ``model.<name>()`` (``save`` or ``save_weights``) writes: its variables' (and for
    ``save`` its optimizer's) sizes; None where they can't be read."""
    try:
        import numpy as np

        variables = list(model.weights)
        if name == "save":
            variables += list(getattr(getattr(model, "optimizer", None), "variables", None) or [])
        return sum(int(np.prod(tuple(int(d) for d in v.shape))) *
                   np.dtype(getattr(v.dtype, "name", v.dtype)).itemsize for v in variables)
    except Exception:  # noqa: BLE001 - an estimate only: a model of another kind writes unchecked
        return None


def disk_full_error(path, exc, written=0, needs=None):
    """The CheckpointError of a write of ``path`` that found the disk full (``written`` bytes were written)."""
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))  # a /proc/self/fd path: the folder it is
    while os.path.basename(folder).startswith(".tmp-"):  # a nested write's private folder: the one it writes into
        folder = os.path.dirname(folder)
    try:
        free = "{} free".format(_size(shutil.disk_usage(folder).free))
    except OSError:
        free = "free space unknown"
    wanted = re.search(r"total write size = (\d+)", str(exc))
    name = os.path.basename(path)
    while name.startswith(".tmp-"):  # BackupAndRestore's write of a hooked save_weights: the checkpoint's own name
        name = name[len(".tmp-"):]
    error = CheckpointError(
        "The disk is full: writing {} failed in {} ({}; {} written, {} on that file system{}). The previous "
        "checkpoint (or file) there is intact, if there was one: distkeras writes to a temporary file and renames it, and the temporary "
        "file is removed. Free space on that disk (or save to a folder on another one: BackupAndRestore(backup_dir), "
        "save(path)), then run again.".format(
            name, folder, os.strerror(errno.ENOSPC), _size(written), free,
            "; the write that failed needed {} more".format(_size(int(wanted.group(1)))) if wanted else
            "; it needs at least {}".format(_size(needs)) if needs else ""))
    error.errno = errno.ENOSPC
    return error


def _size(count):
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return "{} {}".format(count, unit) if unit == "bytes" else "{:.1f} {}".format(count, unit)
        count /= 1024.0


def rank0_speaks_and_writes(model, rank):
    """Rank 0 prints and writes; the other workers of a job stay quiet and keep no file.

    Every backend calls it from ``distribute()`` (TensorFlow, JAX, MXNet and CNTK; PyTorch installs
    :func:`rank0_writes` and its own quiet entry points). On ranks other than 0, ``fit``/``evaluate``/``predict``
    run with ``verbose=0``; ``save``/``save_weights`` (also when a callback such as ModelCheckpoint calls
    them) follow :func:`rank0_writes`. Instance attributes (:func:`~distkeras.backends.keras_model.hook`):
    nothing is saved. Call it after the backend's own hooks of ``fit``/``evaluate``/``predict`` are gone
    (``unhook``) or before it sets them (MXNet: it binds ``verbose`` in Keras' own signature).
    """
    if rank != 0:
        for name in ("fit", "evaluate", "predict"):
            method = getattr(model, name)
            signature = inspect.signature(method)
            if "verbose" not in signature.parameters:  # a backend's hook taking (*args, **kwargs): Keras' own
                signature = inspect.signature(getattr(type(model), name).__get__(model))

            def quiet(*args, _method=method, _signature=signature, **kwargs):
                bound = keras_model.Arguments(_signature, args, kwargs)
                bound.set("verbose", 0)
                return _method(*bound.args, **bound.kwargs)

            keras_model.hook(model, name, functools.wraps(method)(quiet))
    rank0_writes(model, rank)
    every_rank_calls(model)


def every_rank_calls(model):
    """Make the model's ``predict`` and ``evaluate`` (split over the processes, so collective) start with
    :func:`~distkeras.backends.agreement.join` across processes (instance hooks, outermost): called on one rank
    only, they raise :class:`~distkeras.errors.CollectiveError` within ``DISTKERAS_JOIN_TIMEOUT`` seconds instead
    of waiting for the engine's timeout. A no-op in one process. Used by TensorFlow, JAX and PyTorch (MXNet and
    CNTK have no board: :func:`~distkeras.backends.agreement.current` is None there)."""
    for name in ("evaluate", "predict"):
        keras_model.hook(model, name, agreement.agreed(getattr(model, name), name))


def rank0_writes(model, rank):
    """Make the model's ``save`` and ``save_weights`` follow the one saving rule (instance hooks):

    - rank 0 writes a single file (``.keras``, ``.h5``, ``.weights.h5``) into a temporary file in the
      target's folder and renames it onto the target (:func:`write_atomically`): a crash or an error half-way
      leaves the previous file intact and no temporary file. Folders, shards, remote paths (``gs://``), file
      objects and ``overwrite=False`` (Keras asks first) are written as Keras writes them.
    - the other ranks write nothing at the path given (:func:`throwaway_saves`), and return once rank 0's
      file is complete (:func:`~distkeras.backends.agreement.saving`, across processes: rank 0 waits for
      nobody, so a save on rank 0 alone works too).

    Used by every backend (TensorFlow, JAX, PyTorch, MXNet, CNTK); a second ``distribute()`` replaces the
    first one's hooks instead of wrapping them.
    """
    for name in ("save", "save_weights"):
        method = getattr(model, name)
        if keras_model.is_hooked(model, name):  # an earlier distribute()'s: the class' own
            method = getattr(type(model), name).__get__(model)
        keras_model.hook(model, name, atomic_saves(method) if rank == 0 else throwaway_saves(method, rank))


def _arguments(signature, args, kwargs):
    """``args``/``kwargs`` bound to ``signature``, and every argument by name (``**kwargs`` ones included)."""
    bound = signature.bind(*args, **kwargs)
    named = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind == parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return bound, named


def _local_file(named):
    """The absolute path of the single local file a save with arguments ``named`` writes, else None."""
    filepath = named.get("filepath")
    if not isinstance(filepath, (str, os.PathLike)):
        return None  # a file object (an h5py.File, io.BytesIO): written as it is
    path = os.fspath(filepath)
    if "://" in path or not path.endswith(_FILE_SUFFIXES):
        return None  # remote, or a folder (tf.keras' SavedModel): Keras' own rules
    if named.get("overwrite", True) is False or named.get("zipped", True) is False or named.get("max_shard_size"):
        return None  # Keras' prompt before overwriting; a folder; shards
    if named.get("save_format") not in (None, "h5", "keras"):
        return None
    return os.path.abspath(path)


def atomic_saves(method):
    """``method`` (a model's bound ``save`` or ``save_weights``) writing a single local file atomically
    (:func:`write_atomically`); anything else as ``method`` writes it. The rule for rank 0 (and a single
    process); see :func:`rank0_writes`."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def atomic(*args, **kwargs):
        bound, named = _arguments(signature, args, kwargs)
        path = _local_file(named)
        if path is None:
            return agreement.saving(named.get("filepath"), lambda: method(*args, **kwargs), 0)

        def write(temporary):
            bound.arguments["filepath"] = temporary
            return method(*bound.args, **bound.kwargs)

        needs = bytes_needed(getattr(method, "__self__", None), method.__name__)
        return agreement.saving(named.get("filepath"), lambda: write_atomically(path, write, needs), 0)

    return atomic


def throwaway_saves(method, rank):
    """``method`` (a model's bound ``save`` or ``save_weights``), writing to a throwaway folder: the rule
    for ranks other than 0.

    The file is written under its own name in a new temporary folder, which is deleted when the call
    returns; nothing is written at the path given. Across processes the call then waits until rank 0 has
    written the path, and raises where rank 0's write failed (:func:`~distkeras.backends.agreement.saving`), so
    a ``load_model`` right after it reads the complete file on every rank. It still
    runs: reading a multi-process JAX array (or a TensorFlow variable of a multi-worker strategy) can be a
    collective step every process must take, and an error (a bad file name) is raised on every rank alike.
    """
    signature = inspect.signature(method)

    @functools.wraps(method)
    def throwaway(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        filepath = bound.arguments["filepath"]

        def write():
            with tempfile.TemporaryDirectory(prefix="distkeras-rank{}-".format(rank)) as folder:
                bound.arguments["filepath"] = os.path.join(folder, os.path.basename(str(filepath)))
                return method(*bound.args, **bound.kwargs)

        return agreement.saving(filepath, write, rank)

    return throwaway


# ---- the fit-argument checks

#: Keras' batch size when ``fit``/``evaluate``/``predict`` are given none.
DEFAULT_BATCH_SIZE = 32


def array_call_values(samples, batch_size):
    """What every worker's ``evaluate()``/``predict()`` call on arrays must agree on (:func:`check_same_everywhere`)."""
    return [("samples", samples), ("batch_size", batch_size or DEFAULT_BATCH_SIZE)]


def fit_code(name, value):
    """``fit()``'s argument ``value`` as the int :func:`check_same_everywhere` compares (and :func:`shown` shows):
    ``shuffle`` False/True/'batch' as 0/1/2, ``validation_split`` in millionths, a count that doesn't apply
    (``validation_samples`` of data that isn't arrays) as -1."""
    if name == "shuffle":
        return 2 if value == "batch" else int(bool(value))
    if name == "validation_split":
        return int(round(value * 1e6))
    return -1 if value is None else int(value)


#: How :func:`shown` writes back the codes of :func:`fit_code` (the other values are plain ints).
_SHOWN = {"shuffle": lambda code: ["False", "True", "'batch'"][code],
          "validation_samples": lambda code: "None" if code < 0 else str(code),
          "validation_split": lambda code: repr(code / 1e6)}


def shown(name, code):
    """The value a worker passed, from its code (:func:`fit_code`), as the error message shows it."""
    return _SHOWN.get(name, str)(code)


def encode_call(values):
    """``values`` (``[(name, int)]``) as float32-exact pairs: each int ``v`` as ``divmod(v + 1, 4096)`` (``-1``,
    "none", becomes 0). A float32 sum of rows that are zero but one rank's carries them exactly."""
    return [divmod(int(value) + 1, 4096) for _, value in values]


def decode_call(pairs):
    """The ints :func:`encode_call` encoded."""
    return [int(high) * 4096 + int(low) - 1 for high, low in pairs]


def calls_differ_error(call, names, by_rank):
    """The :class:`~distkeras.errors.ShardError` for workers whose ``call`` calls differ, or None when every
    rank's values (``by_rank``: one list of ints per rank, in ``names``' order, samples first) are the same."""
    if all(list(row) == list(by_rank[0]) for row in by_rank):
        return None
    arguments = list(names[1:])
    said = arguments[0] if len(arguments) == 1 else "{} and {}".format(", ".join(arguments[:-1]), arguments[-1])
    return ShardError(
        "Every worker must call {}() with the same full arrays, {} (distkeras shards the data itself). Received "
        "({}) by rank: {}.".format(call, said, ", ".join(names), ", ".join(
            "{}: ({})".format(r, ", ".join(shown(name, value) for name, value in zip(names, row)))
            for r, row in enumerate(by_rank))))


def check_same_everywhere(all_sum, rank, workers, call, values):
    """Raise on every worker if their ``call`` (``fit``, ``evaluate``, ``predict``) calls differ in ``values``,
    ``[(name, int)]`` (samples first, then batch size, epochs...: :func:`array_call_values`, :func:`fit_code`):
    they would take different numbers of steps, and the job would wait forever in the first step one of them
    skips.

    Collective: every worker calls it, in the same order as every other collective. ``all_sum`` is the
    backend's sum over the workers of a 1-D float32 NumPy vector (MXNet's KVStore, CNTK's distributed learner);
    each worker fills in its row of a ``workers x len(values)`` table, and one sum gives every worker every row.
    Used by MXNet and CNTK.
    """
    import numpy as np

    mine = np.zeros((workers, len(values), 2), "float32")
    mine[rank] = encode_call(values)
    everyone = np.asarray(all_sum(mine.ravel())).reshape(mine.shape)
    error = calls_differ_error(call, [name for name, _ in values], [decode_call(row) for row in everyone])
    if error is not None:
        raise error


def array_watch(mode, rank, workers, all_sum, backend):
    """The data check (:class:`~distkeras.verify.datacheck.Watch`) of a Keras 2 backend's job, whose calls take
    global arrays (MXNet, CNTK): ``all_sum`` is its sum over the workers of a 1-D float32 NumPy vector. Records
    are numbers below 2 ** 24, so float32 sums them exactly."""
    import numpy as np

    from ..verify import datacheck

    return datacheck.Watch(mode, rank, workers, lambda vector: all_sum(np.asarray(vector, "float32")), backend)


def check_arrays(watch, call, data, batch_size):
    """Every worker's arrays of ``call`` (``data``: fit's ``(x, y, sample_weight)``, or evaluate's and predict's
    ``(x, y, sample_weight)`` with None for what is not given) compared across the job before its first step: the
    whole arrays' digests (:func:`~distkeras.verify.datacheck.digest_array`), by name. Keras 2's loops draw each
    global batch from these arrays with rank 0's random state, so arrays alike mean batches alike; arrays drawn
    apart (NumPy draws before the call, files read in another order) raise ``DataError`` on every worker, or warn
    (``watch.mode``). Collective: every worker calls it, in the same order as every other collective."""
    if watch is None:
        return
    from ..verify import datacheck

    found = []
    for position, part in enumerate(data):
        if part is None:
            continue
        if isinstance(part, dict):
            leaves = [([position, key], part[key]) for key in sorted(part)]
        elif isinstance(part, (list, tuple)):
            leaves = [([position, index], leaf) for index, leaf in enumerate(part)]
        else:
            leaves = [([position], part)]
        for path, leaf in leaves:
            if leaf is not None:
                found.append(datacheck.digest_array(leaf)._replace(name=datacheck.part_name(path)))
    samples = found[0].rows if found else 0
    watch.call = call
    watch.note(found, -(-samples // (batch_size or DEFAULT_BATCH_SIZE)))
    watch.check("{}()".format(call))


# ---- random-state sync


def random_states(framework=None):
    """Python's and NumPy's global random states, and the framework's (``framework``: a ``(get, set)`` pair,
    such as ``(torch.get_rng_state, torch.set_rng_state)``), as one dict."""
    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state()}
    if framework is not None:
        states["framework"] = framework[0]()
    return states


def set_random_states(states, framework=None):
    """Restore what :func:`random_states` gave."""
    import numpy as np

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if framework is not None and "framework" in states:
        framework[1](states["framework"])


def sync_random_state(broadcast, framework=None):
    """Every rank takes rank 0's Python, NumPy (and framework) global random states, so whatever draws from
    them next (Keras' shuffle of array data, a DataLoader's, augmentation) draws alike on every rank.

    Collective: every rank calls it. ``broadcast(data)`` is the backend's "broadcast these bytes from rank 0":
    every rank passes its own bytes and gets rank 0's back (PyTorch: ``broadcast_object_list``; MXNet:
    :func:`broadcast_by_sum` over its KVStore). ``framework``: as in :func:`random_states`. Used by PyTorch
    (at ``fit()``'s start and every epoch's), MXNet and JAX (every epoch's start, before Keras shuffles with NumPy)
    and TensorFlow (at ``fit()``'s start, ``framework`` carrying rank 0's global seed for the tf.data shuffle, and
    every epoch's).
    """
    data = pickle.dumps(random_states(framework), protocol=2)
    set_random_states(pickle.loads(broadcast(data)), framework)


def every_epoch(callback_class, broadcast, framework=None):
    """A Keras callback (an instance of a subclass of ``callback_class``, the ``keras.callbacks.Callback`` of the
    model's Keras) that calls :func:`sync_random_state` with ``broadcast`` and ``framework`` at every epoch's start:
    every rank then shuffles (and draws) alike in that epoch. Collective, like :func:`sync_random_state`.
    Used by JAX and TensorFlow across processes."""

    class SameRandomState(callback_class):
        def on_epoch_begin(self, epoch, logs=None):
            sync_random_state(broadcast, framework)

    return SameRandomState()


def with_callback(callbacks, callback):
    """``fit()``'s ``callbacks`` argument with ``callback`` added last (after any draw of the user's callbacks),
    or None where the caller gave a ready ``CallbackList``, which distkeras leaves as it is."""
    if callbacks is None or isinstance(callbacks, (list, tuple)):
        return list(callbacks or []) + [callback]
    return None


#: Bytes :func:`broadcast_by_sum` carries: Python's and NumPy's pickled states take about 7 KiB.
BROADCAST_BYTES = 1 << 14


def broadcast_by_sum(all_sum, rank, size=BROADCAST_BYTES):
    """A "broadcast these bytes from rank 0" (for :func:`sync_random_state`) made of the backend's sum over
    the workers of a 1-D float32 NumPy vector, for backends whose engine only sums (MXNet's KVStore).

    Rank 0's bytes travel as 16-bit pieces in float32 (each held exactly), after their length, in a vector
    of a fixed size (``size`` bytes at most: one shape, so the engine makes one key for it); the other ranks
    send zeros, and the sum is rank 0's.
    """

    def broadcast(data):
        import numpy as np

        if len(data) > size:
            raise ValueError("Expected at most {} bytes to broadcast. Received: {} bytes".format(size, len(data)))
        pieces = np.zeros(1 + size // 2, "float32")
        if rank == 0:
            padded = np.frombuffer(data + b"\0" * (size - len(data)), "<u2")
            pieces[0] = len(data)
            pieces[1:] = padded
        summed = np.asarray(all_sum(pieces))
        length = int(summed[0])
        return summed[1:].astype("<u2").tobytes()[:length]

    return broadcast
