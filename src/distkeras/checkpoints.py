"""A checkpoint folder is data, never code: what :class:`~distkeras.callbacks.BackupAndRestore` writes and trusts.

Anyone who can write to the folder (a shared file system, a restored backup, a hand edit) must not be able to run
code or touch a file outside it through it. So:

- **No pickle.** The random states a mid-epoch checkpoint keeps (Python's, NumPy's, a framework's generators)
  are JSON numbers, decoded into exactly the types each generator takes.
- **A validated manifest.** ``checkpoint.json`` is read field by field: ``epoch`` and ``step`` non-negative
  integers, ``steps_per_execution`` a positive one, ``weights`` and ``random`` file names of the forms distkeras
  writes (no folder, no ``..``: every path stays inside the folder), ``sha256`` the weights file's digest. Anything
  else is a :class:`~distkeras.errors.CheckpointError` naming the file and the field.
- **A checksum.** The weights file's SHA-256, taken when it was written, is checked before it is loaded: a
  corrupt or replaced file stops the resume with an error instead of training on from it.
- **Only its own files deleted.** At the end of a run (``delete_checkpoint=True``) the files distkeras names are
  removed, and the folder only where nothing else is left in it.

No framework import here: a framework's generator state comes back as a NumPy byte array, which its adapter's
``set_random_states`` takes.
"""

import hashlib
import json
import os
import re
import shutil
import stat

from .errors import CheckpointError

MANIFEST = "checkpoint.json"
#: The names of the files distkeras writes into a checkpoint folder.
WEIGHTS = re.compile(r"epoch-\d{5}(-step-\d{6})?\.weights\.h5")  # whole names only: fullmatch (a $ lets "\n" in)
RANDOM = re.compile(r"epoch-\d{5}-step-\d{6}\.random\.json")
#: The temporary files of earlier distkeras versions' writes (a fixed name: ``.tmp-`` and the file's).
TEMPORARY = re.compile(r"\.tmp-.*epoch-\d{5}(-step-\d{6})?\.(weights\.h5|random\.json)|\.tmp-checkpoint\.json")
#: The private folders every write goes through (:func:`distkeras.backends.policies.write_atomically`: ``mkdtemp``'s
#: ``.tmp-`` and 8 random characters).
PRIVATE = re.compile(r"\.tmp-[a-z0-9_]{8}")
FIELDS = ("epoch", "weights", "sha256", "step", "steps_per_execution", "random")
#: The largest manifest read, in bytes (distkeras writes about 200).
MAX_MANIFEST = 64 * 1024
#: The largest random-state file read, in bytes (a torch generator's state and NumPy's: about 40 KiB).
MAX_RANDOM = 1024 * 1024


def read_bounded(path, limit, what):
    """The bytes of the regular file ``path``, at most ``limit`` of them (``what`` it is, for the error).

    Opened without blocking (a FIFO put in its place can't hang the resume) and checked before it is read: a
    device (``/dev/zero``), a folder, a FIFO or a file larger than ``limit`` is a :class:`CheckpointError`, in
    bounded time and memory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError("Can't read {} {} ({}). Remove the folder to start over.".format(
            what, path, exc.strerror or exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError("Expected {} {} to be a regular file. Received: {}. The folder holds what distkeras "
                                  "didn't write; remove it (or point BackupAndRestore at another) to start over.".format(
                                      what, path, _kind(info.st_mode)))
        if info.st_size > limit:
            raise CheckpointError("Expected {} {} to be at most {} bytes, as distkeras writes it. Received: {} bytes. "
                                  "Remove the folder to start over.".format(what, path, limit, info.st_size))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise CheckpointError("Expected {} {} to be at most {} bytes. Received a file that grew past that while it "
                                  "was read.".format(what, path, limit))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode):
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _short(value, longest=200):
    text = repr(value)
    return text if len(text) <= longest else text[:longest] + "... ({} characters)".format(len(text))


def digest(path):
    """The SHA-256 of the file at ``path``, in hex."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _bad(path, field, expected, value):
    return CheckpointError(
        "Expected {} in {} to be {}. Received: {!r}. The folder holds a checkpoint distkeras didn't write, or one "
        "that was changed; remove the folder (or point BackupAndRestore at another) to start over.".format(
            field, path, expected, _short(value)))


def _count(manifest, path, field, least, required=True):
    value = manifest.get(field)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise _bad(path, field, "an integer of at least {}".format(least), value)


def read_manifest(folder):
    """The folder's manifest, validated (None where there is none).

    Raises:
        CheckpointError: the file isn't JSON, a field is missing, of the wrong type, or names a file outside the
            folder or of another form than distkeras writes, or a field is unknown.
    """
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        return None
    text = read_bounded(path, MAX_MANIFEST, "the checkpoint's manifest")
    try:
        manifest = json.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError("Expected JSON in {}, the checkpoint's manifest. Received a file that isn't: {}. "
                              "Remove the folder to start over.".format(path, str(exc)[:200])) from None
    if not isinstance(manifest, dict):
        raise _bad(path, "the manifest", "a JSON object", manifest)
    unknown = sorted(set(manifest) - set(FIELDS))
    if unknown:
        shown = [name[:40] for name in unknown[:10]]
        raise _bad(path, "the fields", "some of " + ", ".join(FIELDS),
                   shown if len(unknown) <= 10 else shown + ["... {} unknown fields in all".format(len(unknown))])
    _count(manifest, path, "epoch", 0)
    _count(manifest, path, "step", 0, required=False)
    _count(manifest, path, "steps_per_execution", 1, required=False)
    for field, pattern, required in (("weights", WEIGHTS, True), ("random", RANDOM, False)):
        value = manifest.get(field)
        if value is None and not required:
            continue
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise _bad(path, field, "a file name of the form {}, in the folder".format(pattern.pattern), value)
    sha = manifest.get("sha256")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise _bad(path, "sha256", "the weights file's SHA-256 (64 hex digits)", sha)
    return manifest


def check_weights(folder, manifest):
    """The path of the manifest's weights file, once its SHA-256 is the one the manifest holds.

    Raises:
        CheckpointError: the file is missing, or its content isn't what was written.
    """
    path = os.path.join(folder, manifest["weights"])
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise CheckpointError("Expected the weights file {} that {} names. Received: no such file. Remove the folder "
                              "to start over.".format(path, os.path.join(folder, MANIFEST))) from None
    if not stat.S_ISREG(mode):
        raise CheckpointError("Expected the weights file {} that {} names to be a regular file. Received: {}. Remove "
                              "the folder to start over.".format(path, os.path.join(folder, MANIFEST), _kind(mode)))
    if digest(path) != manifest["sha256"]:
        raise CheckpointError(
            "Expected {} to hold the weights written with the checkpoint (SHA-256 {}). Received a file with "
            "another content: corrupt or replaced since. Nothing was loaded; remove the folder to start over, or "
            "restore the file.".format(path, manifest["sha256"]))
    return path


def non_finite(path, most=5):
    """The names of the floating-point arrays in the weights file ``path`` (``save_weights``' HDF5: the model's
    variables and the optimizer's) that hold a NaN or an infinity, at most ``most`` of them; [] when all are finite.
    Read a block at a time (bounded memory whatever a variable's size)."""
    import h5py
    import numpy as np

    found = []

    def visit(name, item):
        if len(found) >= most or not isinstance(item, h5py.Dataset) or item.dtype.kind != "f":
            return
        if item.ndim == 0 or item.size == 0:
            if item.size and not np.isfinite(item[()]).all():
                found.append(name)
            return
        rows = max(1, (1 << 24) // max(1, item.size // item.shape[0]))
        for start in range(0, item.shape[0], rows):
            if not np.isfinite(item[start:start + rows]).all():
                found.append(name)
                return

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


# ---- random states as JSON


def encode_random_states(states):
    """``states`` (``{"python": random.getstate(), "numpy": np.random.get_state()}`` and a framework's byte state,
    such as torch's ``get_rng_state()``) as JSON text."""
    out = {}
    for key, value in states.items():
        if key == "python":
            version, internal, gauss = value
            out[key] = [version, list(internal), gauss]
        elif key == "numpy":
            kind, keys, pos, has_gauss, cached = value
            out[key] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
        else:  # a framework's generator state, a byte tensor (torch.get_rng_state())
            import numpy as np

            data = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
            if data.dtype != np.uint8 or data.ndim != 1:
                raise ValueError("Random state {!r}: expected bytes, received {} {}".format(key, data.dtype, data.shape))
            out[key] = [int(b) for b in data.tolist()]
    return json.dumps(out)


def decode_random_states(text, path):
    """What :func:`encode_random_states` encoded, as the generators take it back.

    Raises:
        CheckpointError: not JSON, an unknown key, or a value of another shape.
    """
    try:
        raw = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
        if not isinstance(raw, dict) or not all(isinstance(k, str) and re.fullmatch(r"[a-z]{1,16}", k) for k in raw):
            raise ValueError("keys {}".format(sorted(raw) if isinstance(raw, dict) else raw))
        states = {}
        if "python" in raw:
            version, internal, gauss = raw["python"]
            if not all(isinstance(i, int) for i in internal) or not (gauss is None or isinstance(gauss, float)):
                raise ValueError("python")
            states["python"] = (int(version), tuple(internal), gauss)
        if "numpy" in raw:
            import numpy as np

            kind, keys, pos, has_gauss, cached = raw["numpy"]
            if kind != "MT19937" or len(keys) != 624:
                raise ValueError("numpy")
            states["numpy"] = (kind, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
        for key in set(raw) - {"python", "numpy"}:  # a framework's byte state; its adapter takes the array back
            import numpy as np

            if not isinstance(raw[key], list) or not all(isinstance(b, int) and 0 <= b < 256 for b in raw[key]):
                raise ValueError(key)
            states[key] = np.array(raw[key], dtype=np.uint8)
        return states
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise CheckpointError("Expected the random states distkeras writes in {}. Received something else ({}). "
                              "Remove the folder to start over.".format(path, str(exc)[:200])) from None


def remove_temporaries(folder):
    """Remove what interrupted writes left in ``folder``: temporary files of distkeras' names (a link there: the link,
    never what it points to) and the private folders writes go through, where they are this user's folders."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
            if PRIVATE.fullmatch(name) and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                shutil.rmtree(path, ignore_errors=True)  # links inside are removed, not followed
            elif TEMPORARY.fullmatch(name) and not stat.S_ISDIR(info.st_mode):
                os.unlink(path)
        except OSError:
            pass


def remove_own_files(folder):
    """Remove the files distkeras writes in ``folder`` (manifest, weights, random states, temporaries), then the
    folder where nothing else is left in it. Anything else stays, and so does the folder then."""
    if not os.path.isdir(folder):
        return
    remove_temporaries(folder)
    for name in os.listdir(folder):
        if name == MANIFEST or WEIGHTS.fullmatch(name) or RANDOM.fullmatch(name):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
    try:
        os.rmdir(folder)
    except OSError:
        pass  # not empty: the user's files are there
