"""The data check: every worker must draw the global batch one process would draw.

In a job of several workers (processes), each one runs the user's own input pipeline, draws the whole global batch
and keeps its share of it (TensorFlow's ``AutoShardPolicy.DATA``, JAX's slices of the process-local batch, PyTorch's
rows ``[rank::world]``). That is one device's step only if every worker's pipeline yields the same batch, the same
rows in the same order. When they don't (a ``shuffle`` without a seed, ``image_dataset_from_directory(shuffle=True)``
or ``Dataset.list_files`` drawing a seed of their own, files listed in another order, another file on one worker,
augmentation drawn from unseeded ops in a ``map``), the step mixes parts of different batches: some samples are never
trained and others twice, and the loss looks fine. The one-device check (:mod:`distkeras.verify`) replays the batch
that ran, so it can't see this.

So at the first step of every pass over the data (every epoch of ``fit()``, every ``evaluate()``, ``predict()`` and
fit's validation), each worker takes a fingerprint of its whole global batch before its share is taken: per part
(``x``, ``y``, ``sample_weight``, each key of a dict) a 48-bit digest of its dtype, shape and bytes, its rows, and
the number of batches the pass will have where the pipeline knows it. One all-gather of those few numbers (a sum of
:data:`SIZE` floats, each worker's in its own row) lets every worker compare them with rank 0's and come to the same
verdict, so every worker raises :class:`~distkeras.errors.DataError` at the same point (nothing waits on a worker
that stopped), naming what differs and the usual causes and fixes; ``check_data="warn"`` logs it once instead.

Its cost is one batch hashed per pass (on TensorFlow in the pipeline, ``tf.fingerprint``; elsewhere
:func:`digest_array`) and one collective of :data:`SIZE` numbers per pass: ``benchmarks/data_check.py`` measures it.

The neutral part is here (the switch, the record, the verdict and its message); each backend supplies where it sees
the worker's whole batch and its sum over the workers (``backends/datawatch.py`` and the backends' own modules).
"""

import hashlib
import logging
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from ..errors import DataError, OptionError

logger = logging.getLogger("distkeras")

#: The environment switch: 1/true/raise (the default), warn, or 0/false/off.
ENV = "DISTKERAS_CHECK_DATA"
#: Where the causes and fixes are explained.
DOCS = "https://distkeras.github.io/distkeras/guide/data/#every-worker-draws-the-same-batch"
#: Parts of a batch with a slot of their own in the record; more are folded into the last slot.
PARTS = 12
#: A record's layout: a marker (1: a batch was seen), a digest of the structure (part names and dtypes), the pass'
#: batches + 1 (0: unknown), the number of parts, then three numbers per part: its digest (two 24-bit halves) and its
#: rows + 1. Every number is below 2 ** 24, exact in a float32 sum.
HEADER = 4
SIZE = HEADER + 3 * PARTS
_CAP = 2 ** 24 - 1
_TRUE = ("1", "true", "yes", "on", "raise")
_FALSE = ("0", "false", "no", "off")


def switch(option: object, environ: Optional[Dict[str, str]], env: str, name: str, default: Optional[str]) -> Optional[str]:
    """A check's mode, ``"raise"``, ``"warn"`` or None (off): from ``distribute()``'s option ``name`` (True, "raise",
    "warn", False; None: not given), else from the environment variable ``env`` (1/true/raise, warn, 0/false/off;
    unset or empty: ``default``). Shared by the data check and the one-device check (:mod:`distkeras.verify`).

    Raises:
        OptionError: a value that is none of those.
    """
    if option is None:
        value = (environ if environ is not None else os.environ).get(env, "").strip().lower()
        if not value:
            return default
        if value in _TRUE:
            return "raise"
        if value == "warn":
            return "warn"
        if value in _FALSE:
            return None
        raise OptionError("Expected {}=1 (raise on a difference), warn or 0 (default: {}). Received: {}={!r}".format(
            env, "raise" if default else "off", env, value))
    if option is True or option == "raise":
        return "raise"
    if option is False:
        return None
    if option == "warn":
        return "warn"
    raise OptionError("Expected {}=True (raise on a difference), 'warn', or False (default: {}). Received: {}={!r}"
                      .format(name, "True" if default else "False", name, option))


def mode(option: object = None, environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The data check's mode: ``"raise"`` (the default), ``"warn"`` or None (off), from ``distribute()``'s
    ``check_data`` option, else from :data:`ENV` (:func:`switch`)."""
    return switch(option, environ, ENV, "check_data", "raise")


class Part(NamedTuple):
    """One part of a batch as a worker drew it: its name (``x``, ``y['label']``), dtype, a 64-bit digest of its
    dtype, shape and bytes, and its rows (the first axis; 1 for a scalar)."""

    name: str
    dtype: str
    digest: int
    rows: int


def part_name(path: Sequence[object]) -> str:
    """``x``, ``y``, ``sample_weight`` for the positions of Keras' ``(x, y, sample_weight)``, then the keys and
    positions inside: ``x['image']``, ``x[1]``."""
    path = list(path)
    if not path or not isinstance(path[0], int):  # a batch of x alone
        return "x" + "".join("[{!r}]".format(key) for key in path)
    head, rest = path[0], path[1:]
    return {0: "x", 1: "y", 2: "sample_weight"}.get(head, "[{}]".format(head)) + "".join(
        "[{!r}]".format(key) for key in rest)


def digest_array(value) -> Part:
    """A :class:`Part` (unnamed) of one NumPy-convertible array: a digest of its dtype, shape and bytes (for strings
    and objects, each element's bytes).

    The bytes are hashed in place (no copy where the array is contiguous already), once per pass: blake2b keeps
    the odds that another batch, or the same rows in another order, digests the same near 2 ** -64."""
    import numpy as np

    array = np.asarray(value)
    h = hashlib.blake2b(digest_size=8)
    h.update("{}{}".format(array.dtype.str, array.shape).encode())
    if array.dtype.kind in "OSU":
        for item in array.reshape(-1):
            h.update(item if isinstance(item, bytes) else str(item).encode())
            h.update(b"\0")
    else:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)  # a view where it is contiguous already
        h.update(data)
    return Part("", array.dtype.name, int.from_bytes(h.digest(), "little"), int(array.shape[0]) if array.ndim else 1)


def _small(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=3).digest(), "little") or 1


def encode(parts: Sequence[Part], batches: Optional[int]) -> List[int]:
    """The record (:data:`SIZE` numbers below 2 ** 24) of one worker's batch."""
    record = [0] * SIZE
    record[0] = 1
    record[1] = _small("|".join("{}:{}".format(p.name, p.dtype) for p in parts))
    record[2] = 0 if batches is None or batches < 0 else min(int(batches) + 1, _CAP)
    record[3] = min(len(parts), _CAP)
    for index, part in enumerate(parts):
        slot = HEADER + 3 * min(index, PARTS - 1)
        digest = part.digest & (2 ** 48 - 1)
        if index >= PARTS:  # folded into the last slot
            digest ^= (record[slot] << 24 | record[slot + 1])
        record[slot], record[slot + 1] = digest >> 24, digest & _CAP
        record[slot + 2] = min(part.rows + 1, _CAP)
    return record


def gather(record: Sequence[int], rank: int, workers: int, sum_over_workers: Callable) -> List[List[int]]:
    """Every worker's record, by rank: one sum over the workers of a vector holding this worker's record in its
    own row (every worker calls it, with a record or :data:`SIZE` zeros)."""
    vector = [0.0] * (SIZE * workers)
    vector[rank * SIZE:(rank + 1) * SIZE] = [float(v) for v in record]
    total = [int(round(float(v))) for v in sum_over_workers(vector)]
    return [total[r * SIZE:(r + 1) * SIZE] for r in range(workers)]


_SHUFFLE = ("a shuffle without a seed: tf.data's shuffle(buffer) (seed it: shuffle(buffer, seed=S)), "
            "keras.utils.image_dataset_from_directory / text_dataset_from_directory / timeseries_dataset_from_array "
            "with shuffle=True and no seed (each process draws its own: pass seed=S), tf.data.Dataset.list_files "
            "(it shuffles by default: shuffle=False, or seed=S), a DataLoader(shuffle=True) without a seeded "
            "generator, or NumPy/random draws before fit() (keras.utils.set_random_seed(S) with one S on every worker)")
_FILES = ("files listed in another order (os.listdir and glob give no order: sort them) or other files on this "
          "worker (the same files on every worker)")
_AUGMENT = ("augmentation drawn from unseeded random ops in the input pipeline (tf.image.random_*, tf.random in a "
            "map): use the stateless ops with a seed (tf.image.stateless_random_*), or augment inside the model "
            "with Keras' preprocessing layers; or inputs made apart on each worker (arrays drawn before fit() "
            "without a seed, features read from other files)")


def verdict(records: Sequence[Sequence[int]], parts: Sequence[Part]) -> Optional[str]:
    """What differs between the workers' records (by rank) and rank 0's, with the usual causes and fixes; None
    where every worker drew rank 0's batch (or no worker drew one). ``parts`` are this worker's, for the names."""
    reference = records[0]
    if not any(record[0] for record in records):
        return None
    names = [p.name for p in parts[:PARTS - 1]] + (
        ["/".join(p.name for p in parts[PARTS - 1:])] if len(parts) >= PARTS else [])
    findings, causes = [], []
    for rank, record in enumerate(records[1:], start=1):
        if list(record) == list(reference):
            continue
        if not record[0] or not reference[0]:
            findings.append("worker {} {} a batch where worker 0 {}".format(
                rank, "drew" if record[0] else "drew no", "drew none" if record[0] else "did"))
            causes.append(_FILES)
            continue
        if record[1] != reference[1] or record[3] != reference[3]:
            findings.append("worker {}'s batch has other parts (names or dtypes) than worker 0's".format(rank))
            causes.append("another input pipeline on this worker (the same code and files on every worker)")
            continue
        if record[2] != reference[2]:
            findings.append("worker {}'s data has {} batches where worker 0's has {}".format(
                rank, record[2] - 1 if record[2] else "an unknown number of",
                reference[2] - 1 if reference[2] else "an unknown number of"))
            causes.append("a dataset of another length on this worker: " + _FILES)
        differing, rows = [], []
        for index, name in enumerate(names):
            slot = HEADER + 3 * index
            if record[slot + 2] != reference[slot + 2]:
                rows.append("{} has {} rows where worker 0's has {}".format(
                    name, record[slot + 2] - 1, reference[slot + 2] - 1))
            elif record[slot:slot + 2] != reference[slot:slot + 2]:
                differing.append(name)
        if rows:
            findings.append("worker {}'s {}".format(rank, "; ".join(rows)))
            causes.append("another batch size or a shorter last batch on this worker (another dataset length, "
                          "another batch() or drop_remainder)")
        if differing:
            findings.append("worker {}'s batch differs from worker 0's in {}".format(rank, ", ".join(differing)))
            inputs = [n for n in differing if n.startswith("x")]
            if inputs and len(inputs) == len(differing) and len(differing) < len(names):
                causes.append(_AUGMENT + " (only the inputs differ, the rest agrees)")
            else:
                causes.append(_SHUFFLE)
                causes.append(_FILES)
    if not findings:
        return None
    unique = []
    for cause in causes:
        if cause not in unique:
            unique.append(cause)
    return "; ".join(findings) + ". The usual causes: " + "; or ".join(unique) + "."


class Watch(object):
    """The data check of one distributed model in a job of ``workers`` processes.

    A backend calls :meth:`note` with the parts of the first global batch of a pass as this worker drew it, and
    every worker calls :meth:`check` at the same points (after each pass' first step), which compares the workers'
    records and raises or warns.
    """

    def __init__(self, check_mode: str, rank: int, workers: int, sum_over_workers: Callable, backend: str,
                 wrap_adapter: Optional[Callable] = None, read: Optional[Callable] = None):
        self.mode, self.rank, self.workers, self.backend = check_mode, rank, workers, backend
        self.sum_over_workers = sum_over_workers
        #: The backend's ``wrap_adapter(data_adapter, epoch_iterator)``: makes the adapter note each pass' first
        #: batch; and ``read(epoch_iterator)``, where it keeps what it noted elsewhere (see :meth:`check`).
        self.wrap_adapter, self.read = wrap_adapter, read
        self.call = "fit"  # the distributed call running: fit, evaluate, predict
        self.pending = None  # (record, parts) of the batch noted since the last check
        self.checks = 0  # how many comparisons ran (for tests and benchmarks)
        self.warned = False

    def note(self, parts: Sequence[Part], batches: Optional[int]) -> None:
        """The first batch of a pass, as this worker drew it."""
        self.pending = (encode(parts, batches), list(parts))

    def check(self, where: str = "", read: Optional[Callable] = None) -> None:
        """Compare the workers' batches since the last check (every worker calls this at the same point).

        Args:
            where: the pass, as the message names it (``fit(), epoch 2``).
            read: a function returning ``(parts, batches)`` or None, for a backend that keeps the noted batch
                elsewhere (TensorFlow's pipeline writes it into a variable).

        Raises:
            DataError: in mode "raise", some worker drew another batch than rank 0.
        """
        if read is not None:
            noted = read()
            if noted is not None:
                self.note(*noted)
        record, parts = self.pending or ([0] * SIZE, [])
        self.pending = None
        records = gather(record, self.rank, self.workers, self.sum_over_workers)
        self.checks += 1
        found = verdict(records, parts)
        if found is None:
            return
        stop = "distkeras stopped the job on every worker before more steps mixed the workers' batches" if \
            self.mode == "raise" else "Training goes on (check_data='warn'), on batches no one process draws"
        message = (
            "Expected every worker to draw the global batch one process draws (the same rows in the same order: "
            "each worker then takes its share), at the first step of {} on the {} backend ({} workers). Received: "
            "{} {}; see {} (check_data=False turns this check off).".format(
                where or "a pass over the data", self.backend, self.workers, found, stop, DOCS))
        if self.mode == "raise":
            raise DataError(message)
        if not self.warned and self.rank == 0:  # every worker knows; rank 0 says it, once
            logger.warning("%s", message)
        self.warned = True
