"""The one-device check: run a distributed training step a second time as one device would, and compare.

``distribute(model, devices, verify=True)`` (or ``DISTKERAS_VERIFY=1`` in the environment, for a script that
must not change) checks the first training step of every ``fit()`` call, which is also the first after a
``compile()`` or a change of ``trainable``, since Keras makes its step function again for each of them. That
step runs distributed, as always; then, from the state it started from (every weight, every optimizer's and
metric's variables, the seed generators' states), on the very global batch it trained on, the model's own
``train_step`` runs again the way plain Keras runs it on one device: distkeras' hooks suspended, no strategy, no
mesh, no collective. The two results are compared variable by variable (weights, optimizer slots, metric
states) and log by log; training then goes on from the distributed result.

A difference beyond float tolerance raises :class:`~distkeras.errors.VerifyError` (``verify=True``/``"raise"``)
or logs a warning (``"warn"``), naming each variable and log that differs, by how much, and linking the docs
section on the usual causes. Differential testing, as compilers are tested: two implementations of one program
must agree, and the one-device one is the specification.

The neutral part is here: the switch, the snapshot-and-compare, the message. Each backend's
``backends/<name>/verify.py`` supplies its primitives: how its step function receives a batch, how the global
batch is put together from the replicas' parts, and how plain Keras' step runs on one device.

Where it can't run, it says so once and trains on: ``steps_per_execution > 1``, and steps that build variables
three times in a row (a first step that builds them defers the check to the next). Split state (``shard=``,
``strategy="model"``, pipeline stages) is gathered whole for the check.
"""

import logging
from typing import Dict, List, NamedTuple, Optional, Sequence

from ..errors import OptionError, VerifyError

logger = logging.getLogger("distkeras")

#: The environment switch: 1/true/raise, warn, or 0/false/off (the default).
ENV = "DISTKERAS_VERIFY"
#: Where the usual causes of a difference are explained.
DOCS = "https://distkeras.github.io/distkeras/guide/verify/#what-a-difference-usually-means"
#: Float tolerance of the comparison, as numpy.allclose: |distributed - one device| <= atol + rtol * |one device|.
RTOL = 1e-4
ATOL = 1e-5


def mode(option: object = None, environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The check's mode: ``"raise"``, ``"warn"`` or None (off, the default), from ``distribute()``'s ``verify``
    option, else from :data:`ENV` (:func:`distkeras.verify.datacheck.switch`).

    Raises:
        OptionError: a value that is none of True, False, None, "raise", "warn" (or, in the environment, 1/0).
    """
    from .datacheck import switch

    return switch(option, environ, ENV, "verify", None)


def tolerance(option: object = None):
    """``(rtol, atol)`` from ``distribute()``'s ``verify_tolerance`` option (a pair of non-negative numbers)."""
    if option is None:
        return RTOL, ATOL
    try:
        rtol, atol = (float(v) for v in option)
        if rtol < 0 or atol < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise OptionError(
            "Expected verify_tolerance=(rtol, atol), two non-negative numbers. Received: verify_tolerance={!r}".format(
                option))
    return rtol, atol


#: The machine epsilon of each half-precision compute dtype (numpy's ``finfo(dtype).eps``; bfloat16 has 8 bits of
#: mantissa, float16 11). A float32 (or wider) computation keeps :data:`RTOL` and :data:`ATOL`.
HALF_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


class Tolerance(NamedTuple):
    """What the comparison allows: ``|distributed - one device| <= atol + rtol * |one device| + scale * m``, where m
    is the largest ``|one device|`` value of the same variable or log (0 in float32: :data:`RTOL`, :data:`ATOL`)."""

    rtol: float
    atol: float
    scale: float = 0.0


def tolerance_for(compute_dtype: Optional[str], rows: Optional[int], rtol: float = RTOL,
                  atol: float = ATOL) -> Tolerance:
    """The tolerance of a step computed in ``compute_dtype`` on a global batch of ``rows``.

    In float32 it is ``(rtol, atol)``. In float16 and bfloat16 (``mixed_float16``, ``mixed_bfloat16`` policies), the
    replicas sum their rows in another order than one device, and each partial sum rounds at the compute dtype's
    epsilon: a sum of n terms can move by about ``eps * log2(n)`` of its magnitude (the pairwise-summation bound).
    So both the relative term and a term relative to the variable's largest value (a gradient's scale, which its
    near-zero elements don't have) become ``eps * (1 + log2(rows))``: 0.64% of the scale in float16 at 48 rows,
    5.1% in bfloat16. A defect that drops, doubles or mixes rows moves a gradient by its whole size, and is still
    caught.

    >>> tolerance_for("float32", 48) == Tolerance(RTOL, ATOL, 0.0)
    True
    >>> round(tolerance_for("float16", 48).scale, 5), round(tolerance_for("bfloat16", 48).scale, 4)
    (0.00643, 0.0514)
    """
    import math

    eps = HALF_EPS.get(compute_dtype or "")
    if eps is None:
        return Tolerance(rtol, atol, 0.0)
    bound = eps * (1.0 + math.log2(max(int(rows or 1), 1)))
    return Tolerance(max(rtol, bound), atol, bound)


class Difference(NamedTuple):
    """One variable or log whose distributed value is not the one-device value."""

    name: str
    kind: str  # "weight", "optimizer", "metric", "log", "seed"
    max_abs: float
    where: str  # the first element that differs, with both values


def differences(named: Sequence, rtol: float, atol: float, scale: float = 0.0) -> List[Difference]:
    """Compare ``(name, kind, distributed, one_device)`` entries (NumPy-convertible); the ones beyond tolerance
    (``scale``: see :class:`Tolerance`)."""
    import numpy as np

    found = []
    for name, kind, got, want in named:
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            found.append(Difference(name, kind, float("inf"), "shape {} against {}".format(got.shape, want.shape)))
            continue
        if got.dtype.kind not in "fciub" or want.dtype.kind not in "fciub":
            continue  # strings, objects: not numbers to compare
        got64, want64 = got.astype("float64"), want.astype("float64")
        floor = atol + (scale * float(np.nanmax(np.abs(want64))) if scale and want64.size else 0.0)
        bad = ~np.isclose(got64, want64, rtol=rtol, atol=floor, equal_nan=True)
        if not bad.any():
            continue
        error = np.abs(got64 - want64)
        index = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf), -1.0))), bad.shape)
        where = "at {}: {:.6g} distributed, {:.6g} on one device".format(
            tuple(int(i) for i in index) if index else "()", float(got64[index]), float(want64[index]))
        worst = float(np.nanmax(np.where(bad, error, 0.0))) if np.isfinite(error[bad]).all() else float("inf")
        found.append(Difference(name, kind, worst, where))
    return found


def _slot_owners(entries: Sequence) -> Dict[str, List[int]]:
    """For each weight, the indices of its optimizer slots among ``entries`` (``(name, kind, ...)``).

    Keras names a slot after its variable's path, ``/`` made ``_``, then the slot's name (``dense_bias_momentum``:
    ``add_variable_from_reference``); a slot belongs to the longest weight path it starts with.
    """
    prefixes = {name.replace("/", "_") + "_": name for name, kind, *_ in entries if kind == "weight"}
    owners: Dict[str, List[int]] = {}
    for index, (name, kind, *_) in enumerate(entries):
        if kind != "optimizer":
            continue
        last = name.rsplit("/", 1)[-1]
        matches = [prefix for prefix in prefixes if last.startswith(prefix) and len(last) > len(prefix)]
        if matches:
            owners.setdefault(prefixes[max(matches, key=len)], []).append(index)
    return owners


def explained_by_slots(found: Sequence[Difference], entries: Sequence, rtol: float) -> List[Difference]:
    """The weight differences an adaptive optimizer's normalisation of rounding noise explains.

    Adam, RMSprop, Adagrad and their kin divide a step by the gradient's own running scale, so a gradient that is
    exactly 0 on paper (a bias that feeds BatchNormalization, an attention key's bias, which softmax ignores) moves
    its weight by about the learning rate along the sign of float noise: 1e-9 one way distributed, 1e-9 the other
    on one device, weights 2e-3 apart. The slots themselves are linear (or quadratic) in the gradient and stay
    equal to rounding. A weight's difference is explained where the weight has slots and each slot agrees within
    ``rtol`` times the largest value any slot of its name (``momentum``, ``velocity``) holds in the model: the
    gradients agreed up to float noise, which is what the check compares. A weight without slots (SGD, non-
    trainable state) is compared as it is; a slot that differs is reported itself.
    """
    import numpy as np

    owners = _slot_owners(entries)
    reported = {d.name for d in found}
    scale: Dict[str, float] = {}
    for weight, indices in owners.items():
        for index in indices:
            suffix = entries[index][0].rsplit("/", 1)[-1][len(weight.replace("/", "_")) + 1:]
            want = np.abs(np.asarray(entries[index][3], dtype="float64"))
            scale[suffix] = max(scale.get(suffix, 0.0), float(want.max()) if want.size else 0.0)
    explained = []
    for difference in found:
        indices = owners.get(difference.name)
        if difference.kind != "weight" or not indices:
            continue
        agree = True
        for index in indices:
            name, _, got, want = entries[index][:4]
            suffix = name.rsplit("/", 1)[-1][len(difference.name.replace("/", "_")) + 1:]
            gap = np.abs(np.asarray(got, dtype="float64") - np.asarray(want, dtype="float64"))
            if name in reported or (gap.size and float(gap.max()) > rtol * scale.get(suffix, 0.0)):
                agree = False
                break
        if agree:
            explained.append(difference)
    return explained


def message(found: Sequence[Difference], backend: str, replicas: int, rtol: float, atol: float) -> str:
    """What the check tells the user: what differs, by how much, and where to read why."""
    lines = [
        "distkeras' one-device check: the first training step on {} replicas ({}) is not the step one device "
        "takes on the same global batch from the same state ({} of them differ beyond rtol={:g}, atol={:g}):".format(
            replicas, backend, len(found), rtol, atol)]
    for entry in sorted(found, key=lambda d: -d.max_abs)[:12]:
        lines.append("  {} {}: max |difference| {:.3g} ({})".format(entry.kind, entry.name, entry.max_abs, entry.where))
    if len(found) > 12:
        lines.append("  ... and {} more".format(len(found) - 12))
    lines.append(
        "Usual causes: an op that mixes the rows of a batch (a contraction over the batch axis, a metric comparing "
        "shapes that broadcast across rows), a sum written by hand instead of a mean, TensorFlow's own random ops in "
        "a custom train_step. See {}".format(DOCS))
    return "\n".join(lines)


class Check:
    """The state of one model's check: when it is due, and what it does with a verdict."""

    def __init__(self, mode_: str, backend: str, replicas: int, rank: int = 0, rtol: float = RTOL, atol: float = ATOL):
        self.mode = mode_
        self.backend = backend
        self.replicas = replicas
        self.rank = rank
        self.rtol, self.atol = rtol, atol
        self.due = True
        self.checked = 0  # steps compared so far
        self.found = []  # the last verdict's differences
        self.explained = []  # weight differences the optimizer's slots explain (see explained_by_slots)
        self.skipped = None  # why the check can't run here, once said
        self.deferred = 0  # steps in a row the check passed on to the next one
        self.tolerance = Tolerance(rtol, atol, 0.0)  # the last verdict's (:func:`tolerance_for`)

    def skip(self, why: str) -> None:
        """Say once (rank 0) why the check can't run, and don't try again."""
        self.due = False
        if self.skipped is None and self.rank == 0:
            logger.warning("distkeras' one-device check is off for this model: %s", why)
        self.skipped = why

    def defer(self, why: str, most: int = 3) -> None:
        """Check the next step instead of this one (``why``); after ``most`` steps deferred, :meth:`skip`."""
        self.deferred += 1
        if self.deferred >= most:
            self.skip("{} steps in a row could not be replayed: {}".format(self.deferred, why))

    def judge(self, named: Sequence, compute_dtype: Optional[str] = None, rows: Optional[int] = None
              ) -> List[Difference]:
        """Compare, then raise or warn by the mode. Every rank judges the same values, so every rank raises.

        ``compute_dtype`` (the narrowest of the model's layers) and ``rows`` (the global batch's) set the tolerance
        (:func:`tolerance_for`): a half-precision step is compared to what its dtype can hold."""
        self.due = False
        self.deferred = 0
        self.checked += 1
        self.tolerance = tolerance_for(compute_dtype, rows, self.rtol, self.atol)
        rtol, atol, scale = self.tolerance
        found = differences(named, rtol, atol, scale)
        self.explained = explained_by_slots(found, named, rtol)
        self.found = [d for d in found if d not in self.explained]
        if self.found:
            text = message(self.found, self.backend, self.replicas, rtol, atol)
            if scale:
                text = text.replace("beyond rtol=", "beyond {:.3g} of each variable's largest value ({}, {} rows) and "
                                    "rtol=".format(scale, compute_dtype, rows), 1)
            if self.mode == "raise":
                raise VerifyError(text)
            if self.rank == 0:
                logger.warning("%s", text)
        return self.found


def named_state(kinds: Sequence, values: Sequence) -> List:
    """Pair each ``(name, kind)`` with its value."""
    return [(name, kind, value) for (name, kind), value in zip(kinds, values)]


def pairs(distributed: Sequence, one_device: Sequence) -> List:
    """``(name, kind, distributed, one_device)`` entries from two :func:`named_state` lists of the same names."""
    return [(name, kind, got, want) for (name, kind, got), (_, _, want) in zip(distributed, one_device)]


def log_pairs(distributed: Dict, one_device: Dict) -> List:
    """The logs both steps returned, compared by name; a log only one of them returned is a difference."""
    entries = []
    for key in sorted(set(distributed) | set(one_device)):
        if key not in distributed or key not in one_device:
            entries.append((key, "log", [float("nan")], [0.0] if key in one_device else [1.0]))
            continue
        entries.append((key, "log", distributed[key], one_device[key]))
    return entries
