"""JAX: the data-parallel train step that all-reduces gradients in 16 bits (``compression="bf16"/"fp16"``).

Without compression a JAX step is one SPMD program over the global batch, and XLA places the gradient
all-reduce itself, in the gradients' dtype; nothing in Keras or JAX lets the reduction travel in another
dtype. With compression the model's ``train_step`` is replaced (on the instance) by Keras' own JAX
``train_step`` with one change: the gradient is computed inside ``jax.shard_map`` over the mesh's
"batch" axis, so each device computes the gradient of the loss on its own shard of the batch, scales it
by its share 1/N, casts it to the wire dtype, and the sum over the devices travels in 16 bits (see
:func:`_average`: XLA's CPU compiler would widen a 16-bit ``psum`` to float32; a test reads the compiled
program's collectives). The sum is cast back before the optimizer, which then acts on the averaged
global gradient as on one device. Shards are
equal (JAX splits evenly), so the mean of the shards' losses is the global batch's loss.

Outside the gradient nothing changes: the optimizer and the metrics run on the global arrays as before.
What the loss computation updates in metric variables (the compiled loss trackers) is added up over
the shards. BatchNormalization statistics stay those of the global batch: while the step is traced, its
``_moments`` (the Keras private the other adapters hook too) gathers every shard's counts, means and squared
deviations (``all_gather``; :func:`distkeras.backends.batchnorm.global_moments`), so normalisation, moving
statistics and the gradient through the statistics are the single-device ones. Which layers, and what
happens to a subclass with a ``_moments`` of its own (it sees its shard), is the rule of
:mod:`distkeras.backends.batchnorm`. Other cross-sample computations inside a layer's ``call`` see one shard,
as each replica does on TensorFlow and PyTorch; dropout draws the same mask pattern on every shard.

A batch the devices don't divide is not padded in fit() with compression (the replaced ``train_step`` is
not proven exact on padding); it runs whole on every device (see :mod:`distkeras.backends.jax.adapter`).
"""

import functools
import threading
import time
import warnings

from ...errors import OptionError
from .. import batchnorm, keras_model
from ..base import swapped

#: Wire dtype of each ``compression`` value (JAX's names).
WIRE = {"bf16": "bfloat16", "fp16": "float16"}
_COMPRESSION_OF = {wire: name for name, wire in WIRE.items()}
#: How a layer left for its own ``_moments`` gets the global batch's statistics on JAX (no sync_batchnorm option).
_OPT_IN = ("give the class no _moments of its own, or drop compression= (JAX's uncompressed step is one program "
           "over the global batch, and every layer's own code sees all of it)")
_PRIVATE_METRICS_UPDATE = "_update_metrics_variables"

#: The mesh axis name while the compressed step's per-shard gradient is traced (None otherwise), per thread.
_tracing = threading.local()


def why_not(model):
    """None where :func:`install` can replace ``model``'s train_step; else why not (a sentence's end).

    The step is Keras' own JAX ``train_step`` rebuilt, so it applies only where the model's class uses that one,
    and where this Keras has the privates it is built from."""
    import keras

    defining = next(klass for klass in type(model).__mro__ if "train_step" in vars(klass))
    if not defining.__module__.startswith("keras.src.backend.jax."):
        return "{}.train_step is your own".format(defining.__name__)
    for klass, name in ((type(model), _PRIVATE_METRICS_UPDATE), (keras.layers.BatchNormalization, batchnorm.MOMENTS)):
        if not callable(getattr(klass, name, None)):
            return "this Keras ({}) lacks {}.{}".format(keras.__version__, klass.__name__, name)
    return None


def install(model, mesh, axis, wire, rank=0, scatter=None, fallback=False):
    """Replace ``model.train_step`` by the step whose gradients travel in dtype ``wire`` (``WIRE[compression]``;
    "float32" gives the exact average, for tests) over ``axis`` of ``mesh`` (a ``jax.sharding.Mesh``), and
    make its BatchNormalization layers' statistics global inside it, by the rule of
    :mod:`distkeras.backends.batchnorm` (a subclass with its own ``_moments`` sees its shard; rank 0 warns).

    Args:
        scatter: for ``shard="gradients"``/``"all"``: ``shape -> dimension`` along which a gradient of that shape
            is reduce-scattered (the split of its variable's optimizer state), None for one left whole (summed
            whole); the gradients leave the shard_map split so. None (the default): every gradient averaged whole.
        fallback: a 16-bit ``wire`` is put on trial against the uncompressed step over the first steps of
            training, and the faster one kept (:class:`_Trial`); False: the 16-bit step always.

    Raises:
        OptionError: :func:`why_not` has a reason (the model's class defines its own ``train_step``, so there is
            no place to compress it, or this Keras lacks what the step is built from).
    """
    reason = why_not(model)
    if reason is not None:
        raise OptionError(
            "compression on JAX replaces Keras' train_step with one that all-reduces the gradients in 16 bits, and "
            "{}. Drop compression=, or compute and average the gradients yourself.".format(reason))
    selection = batchnorm.select(model)
    batchnorm.warn_left(selection, rank, opt_in=_OPT_IN, opt_out=None)
    for layer in selection.synchronized:
        keras_model.hook(layer, batchnorm.MOMENTS, _global_moments(layer, getattr(type(layer), batchnorm.MOMENTS).__get__(layer)))
    keras_step = model.train_step
    compressed = _train_step(model, keras_step, mesh, axis, wire, scatter)
    keras_model.hook(model, "train_step", compressed)
    if fallback and jax_dtype_name(wire) != "float32":
        # On trial against the uncompressed step: Keras' own, or with shard= the same step with a float32 wire.
        plain = keras_step if scatter is None else _train_step(model, keras_step, mesh, axis, "float32", scatter)
        trial = _Trial(model, wire, rank, {True: compressed, False: plain})
        keras_model.hook(model, "make_train_function", trial.make_train_function(type(model).make_train_function))


def jax_dtype_name(wire):
    import jax.numpy as jnp

    return jnp.dtype(wire).name


#: Steps of each kind timed by the trial of ``compression`` (after each kind's first step, which compiles).
TRIAL_STEPS = 5


def keep_compression(compressed_seconds, plain_seconds):
    """Whether the 16-bit step stays after its trial: its median step time (seconds) is no more than the
    uncompressed step's, both measured interleaved on the same machine. A tie keeps it (the user asked for it)."""
    return _median(compressed_seconds) <= _median(plain_seconds)


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class _Trial:
    """``compression=`` on trial: the model's ``train_function`` while the 16-bit step and the uncompressed one
    are timed against each other, then the faster one's, for good.

    The 16-bit detour pays where the network is the bottleneck (across hosts on a slow link: 1.6-2x measured)
    and costs where it isn't (one host, a fast link: the packing, the integer rounding and two collectives in
    place of XLA's one all-reduce, up to 2.4x slower measured). Which one a machine is, only a measurement says,
    so the first ``2 + 2 * TRIAL_STEPS`` steps alternate: each kind's first step compiles it (not timed), then
    ``TRIAL_STEPS`` of each, interleaved so that both meet the same noise, each timed from its input state ready
    to its output state ready. :func:`keep_compression` decides on process 0's times, which every process takes
    (``broadcast_one_to_all``: every process then runs the same program, as its collectives need). Falling back
    says so once (rank 0) and why; later steps, and any step traced again (a ``compile()``), are the kept kind's.
    The trial runs once per ``distribute()`` and spans fit() calls; ``compression_fallback=False`` skips it.
    """

    def __init__(self, model, wire, rank, steps):
        self.model, self.wire, self.rank, self.steps = model, wire, rank, steps
        self.kept = None  # True: the 16-bit step; False: the uncompressed one
        self.functions, self.seconds = {}, {}

    def make_train_function(self, make):
        """``model.make_train_function``: while on trial, a train function of each kind, made with the model's
        ``train_step`` set to it (each its own function: jit caches its traces per function), both made at once
        (Keras reads the variables' shardings then, which fit() purges once its steps start)."""
        model = self.model

        def make_train_function(force=False):
            if self.kept is not None or (model.train_function is not None and not force):
                return make(model, force=force)
            for compressed in (False, True):  # the 16-bit step stays set, as asked, until the trial ends
                keras_model.hook(model, "train_step", self.steps[compressed])
                make(model, force=True)
                self.functions[compressed] = model.train_function
            # Made again (a compile()): the trial starts over, with the new steps.
            self.seconds = {True: [], False: []}
            self.schedule = [True, False] * (1 + TRIAL_STEPS)
            model.train_function = self
            return None

        return make_train_function

    def __call__(self, state, iterator):
        import jax

        done = sum(len(seconds) for seconds in self.seconds.values())
        compressed = self.schedule[done]
        timed = done >= 2  # each kind's first step compiles it
        if timed:
            jax.block_until_ready(state)
            start = time.perf_counter()
        logs, state = self.functions[compressed](state, iterator)
        if timed:
            jax.block_until_ready(state)
            self.seconds[compressed].append(time.perf_counter() - start)
        else:
            self.seconds[compressed].append(None)
        if done + 1 == len(self.schedule):
            self._decide()
        return logs, state

    def _decide(self):
        import jax

        for seconds in self.seconds.values():
            del seconds[0]  # the compiling step
        keep = keep_compression(self.seconds[True], self.seconds[False])
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            keep = bool(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(keep))))
        self.kept = keep
        keras_model.hook(self.model, "train_step", self.steps[keep])
        self.model.train_function = self.functions[keep]
        self.functions = {}
        if not keep and self.rank == 0:
            warnings.warn(
                "compression={!r} made this model's training step slower here: {:.4f} s against {:.4f} s "
                "uncompressed (medians of {} steps each, process 0's), so its gradients are all-reduced in float32 "
                "from now on, exactly. 16-bit gradients pay where the network is the bottleneck (across hosts on a "
                "slow link). Pass compression_fallback=False to keep them regardless.".format(
                    _COMPRESSION_OF[jax_dtype_name(self.wire)], _median(self.seconds[True]),
                    _median(self.seconds[False]), TRIAL_STEPS),
                stacklevel=2)


def uninstall(model):
    """Remove :func:`install`'s hooks from the model's BatchNormalization layers (the model's own go with
    ``keras_model.unhook(model)``)."""
    batchnorm.unhook(model)


def _sharded(axis):
    return swapped(_tracing, "axis", axis)


def _shard_map():
    """``jax.shard_map`` without its replication check (our outputs are replicated by psum/pmean, or
    stacked), in the spelling of this JAX version."""
    import jax

    if hasattr(jax, "shard_map"):
        return functools.partial(jax.shard_map, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return functools.partial(shard_map, check_rep=False)


def _train_step(model, original, mesh, axis, wire, scatter):
    import jax
    import jax.numpy as jnp
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    parts = mesh.shape[axis]
    shard_map = _shard_map()
    whole, split = PartitionSpec(), PartitionSpec(axis)

    def spec(tree):
        return keras.tree.map_structure(lambda leaf: split if getattr(leaf, "ndim", 0) else whole, tree)

    def local(dims, trainable, non_trainable, metrics, optimizer_variables, x, y, sample_weight):
        with _sharded(axis):
            (_, aux), grads = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)(
                trainable, non_trainable, metrics, x, y, sample_weight, training=True,
                optimizer_variables=optimizer_variables)
        unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
        grads = _average(grads, axis, parts, wire) if scatter is None else _scatter(grads, dims, axis, parts, wire)
        unscaled_loss = jax.lax.pmean(unscaled_loss, axis)
        # Global statistics leave every shard with the same moving statistics; a float state computed
        # from the shard alone (a custom layer's) becomes the shards' mean instead of one shard's.
        new_non_trainable = [
            jax.lax.pmean(v, axis) if jnp.issubdtype(v.dtype, jnp.floating) else v for v in new_non_trainable]
        deltas = [(new - old)[None] for new, old in zip(new_metrics, metrics)]
        return grads, unscaled_loss, y_pred, new_non_trainable, deltas

    def train_step(state, data):
        trainable, non_trainable, optimizer_variables, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        sizes = {leaf.shape[0] for leaf in keras.tree.flatten((x, y, sample_weight)) if getattr(leaf, "ndim", 0)}
        if not sizes or any(size % parts for size in sizes):
            return original(state, data)  # runs whole on every device (see the module docstring)
        # Each gradient leaves the shard_map in its optimizer state's layout (scatter) or whole. The trainable
        # variables enter whole: under shard="all" that is where their slices are all-gathered (FSDP's gather).
        dims = [None if scatter is None else scatter(tuple(v.shape)) for v in trainable]
        grad_specs = [whole if d is None else PartitionSpec(*[axis if i == d else None for i in range(len(v.shape))])
                      for d, v in zip(dims, trainable)]
        # The optimizer variables enter whole for the loss scale only (Keras' compute_loss_and_updates reads them
        # under a StatelessScope); XLA drops the gathering of those the step doesn't read (a test reads the HLO).
        step = shard_map(
            functools.partial(local, dims), mesh=mesh,
            in_specs=(whole, whole, whole, whole, spec(x), spec(y), spec(sample_weight)),
            out_specs=(grad_specs, whole, split, whole, split))
        grads, unscaled_loss, y_pred, non_trainable, deltas = step(
            trainable, non_trainable, metrics, optimizer_variables, x, y, sample_weight)
        metrics = [old + delta.sum(axis=0).astype(old.dtype) for old, delta in zip(metrics, deltas)]
        if scatter is not None and any(d is not None for d in dims):
            # ZeRO-1/2: each device updates its slice of the weights (sliced where they are: no communication)
            # and the updated slices are all-gathered in one collective (_gather), not one per weight (what XLA
            # places for the weights' replicated layout: each costs its latency across hosts).
            sliced = [v if d is None else jax.lax.with_sharding_constraint(v, NamedSharding(mesh, s))
                      for v, d, s in zip(trainable, dims, grad_specs)]
            trainable, optimizer_variables = model.optimizer.stateless_apply(optimizer_variables, grads, sliced)
            trainable = shard_map(functools.partial(_gather, dims, axis, parts), mesh=mesh,
                                  in_specs=(grad_specs,), out_specs=[whole] * len(dims))(list(trainable))
        else:
            trainable, optimizer_variables = model.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        logs, metrics = getattr(model, _PRIVATE_METRICS_UPDATE)(metrics, unscaled_loss, x, y, y_pred, sample_weight)
        return logs, (trainable, non_trainable, optimizer_variables, metrics)

    return train_step


def _average(grads, axis, parts, wire):
    """The mean of every shard's ``grads``, sent in dtype ``wire``: one reduce-scatter and one all-gather.

    Each shard's gradients are scaled by 1/``parts`` (the sum is then the average, and fp16 can't overflow from
    adding them), cast to ``wire`` and laid end to end in one buffer. XLA's CPU compiler runs 16-bit float
    collectives in float32 (it converts them back before sending: read in the optimized HLO), so the buffer
    travels as unsigned integers of the same width, which no pass widens, in the two halves of a ring
    all-reduce: ``all_to_all`` hands piece i of every shard to shard i (the reduce-scatter's traffic), which
    adds them in float32 and rounds once to ``wire``; ``all_gather`` returns the summed pieces to all. The
    bytes on the wire are a ``wire`` all-reduce's, 2(N-1)/N of the buffer per device. (With two shards one
    all-gather of the whole buffers would send the same bytes; measured, it made the step slower: XLA's CPU
    all-gather of the whole buffer and the sum after it cost more than the second collective.)

    Across processes (``jax.process_count() > 1``) the same sum runs as :func:`_ring_sum`, a ring of small
    ``ppermute`` pieces: XLA's all-to-all and all-gather over Gloo ran at half the link's rate there.
    """
    import jax
    import jax.numpy as jnp

    wire = jnp.dtype(wire)
    flat = jnp.concatenate([(g / parts).astype(jnp.float32).reshape(-1) for g in grads])
    size = flat.shape[0]
    table = jnp.pad(flat, (0, -size % parts)).reshape(parts, -1)
    if jax.process_count() > 1:  # across processes: the ring in small pieces (see _ring_sum)
        whole = _ring_sum(table, axis, parts, wire).reshape(-1)
    else:
        mine = jax.lax.all_to_all(_encode(table, wire), axis, 0, 0)
        summed = _decode(mine, wire).sum(axis=0)
        whole = _decode(jax.lax.all_gather(_encode(summed, wire), axis, tiled=True), wire)
    averaged, offset = [], 0
    for g in grads:
        averaged.append(whole[offset:offset + g.size].reshape(g.shape).astype(g.dtype))
        offset += g.size
    return averaged


#: Bytes per ``ppermute`` of :func:`_ring_sum` (64 KiB), and at most this many pieces per ring step.
RING_PIECE_BYTES = 64 << 10
RING_MAX_PIECES = 256


def _ring_sum(table, axis, parts, wire):
    """The sum over the devices of ``table`` (float32, one row per device), every device alike, sent as ``wire``
    bits: a ring all-reduce written with ``ppermute``, each step's row cut in pieces of :data:`RING_PIECE_BYTES`
    (:func:`_ring_reduce_scatter`, the summed row rounded to ``wire``, :func:`_ring_all_gather`).

    Why: across processes XLA's CPU collectives run over Gloo's TCP pairs, and one large message each way at once
    ran at half the link's rate (``python -m benchmarks collectives``, 2 hosts at 100 Mbit/s: the 16-bit
    all-to-all and all-gather each at ~2x their bound, one ``ppermute`` of a whole row too), where Gloo's own ring
    all-reduce (float32, uncompressed) sends segments and stays at ~1.1x. So the 16-bit detour lost to float32
    on some models (0.5-0.6x). In 64 KiB pieces the ring reached 1.12x of the 16-bit bound.
    """
    row = _ring_reduce_scatter(table, axis, parts, wire)
    return _ring_all_gather(_decode(_encode(row, wire), wire), axis, parts, wire)


def _ring_send(axis, parts, wire, width):
    """``send(row)``: ``row`` (float32, ``width`` long) to the next device of the ring, in pieces of
    :data:`RING_PIECE_BYTES` (at most :data:`RING_MAX_PIECES`), as ``wire`` bits (float32: as is); returns the
    row received from the previous device."""
    import jax
    import jax.numpy as jnp

    right = [(i, (i + 1) % parts) for i in range(parts)]
    exact = wire == jnp.float32
    step = max(RING_PIECE_BYTES // wire.itemsize, -(-width // RING_MAX_PIECES))
    cuts = list(range(0, width, step)) + [width]

    def send(row):
        if exact:
            return jnp.concatenate([jax.lax.ppermute(row[a:b], axis, right) for a, b in zip(cuts, cuts[1:])])
        pieces = [jax.lax.ppermute(_encode(row[a:b], wire), axis, right) for a, b in zip(cuts, cuts[1:])]
        return _decode(jnp.concatenate(pieces), wire)

    return send


def _ring_reduce_scatter(table, axis, parts, wire):
    """Row i of the sum over the devices of ``table`` ((parts, C) float32 per device) on device i: N-1 steps,
    device i sending its partial sum of row (i - s - 1) to device i+1, which adds it to its own (float32; the
    partial sum rounded to ``wire`` on each hop, as a 16-bit ring does)."""
    import jax
    import jax.numpy as jnp

    index = jax.lax.axis_index(axis)
    send = _ring_send(axis, parts, jnp.dtype(wire), table.shape[1])
    for step in range(parts - 1):
        table = table.at[(index - step - 2) % parts].add(send(jnp.take(table, (index - step - 1) % parts, axis=0)))
    return jnp.take(table, index, axis=0)


def _ring_all_gather(row, axis, parts, wire):
    """``(parts, C)``: row k is device k's ``row`` (sent as ``wire``: a 16-bit row should be rounded to it
    already, so that every device holds the same values), in N-1 ring steps."""
    import jax
    import jax.numpy as jnp

    index = jax.lax.axis_index(axis)
    send = _ring_send(axis, parts, jnp.dtype(wire), row.shape[0])
    table = jnp.zeros((parts,) + row.shape, row.dtype).at[index].set(row)
    for step in range(parts - 1):
        table = table.at[(index - step - 1) % parts].set(send(jnp.take(table, (index - step) % parts, axis=0)))
    return table


def _scatter(grads, dims, axis, parts, wire):
    """The mean of every shard's ``grads``, each left split along its dimension in ``dims`` (None: whole).

    float32: the split gradients' N slices (each one's split dimension moved first) laid side by side in one
    table, reduced by one ``psum_scatter(..., tiled=True)`` (``psum`` for a whole gradient): the reduce-scatter
    XLA's CPU compiler doesn't make from an all-reduce and a slice, once per step rather than once per gradient.
    16 bits (``compression``): XLA's CPU
    compiler widens 16-bit float collectives and has no integer reduce-scatter that adds floats, so the split
    gradients take :func:`_average`'s first half only: each one's N slices (its split dimension moved first)
    laid side by side in one table, sent as ``wire`` bits by one ``all_to_all`` (slice i of every shard to
    shard i: a reduce-scatter's traffic, (N-1)/N of the buffer per device) and added in float32 there; the
    whole ones go through :func:`_average`.
    """
    import jax
    import jax.numpy as jnp

    exact = jnp.dtype(wire) == jnp.float32
    split = [i for i, d in enumerate(dims) if d is not None]
    out = list(grads)
    kept = [i for i, d in enumerate(dims) if d is None]
    if exact:
        for i in kept:
            out[i] = jax.lax.psum(grads[i] / parts, axis)
    else:
        for i, g in zip(kept, _average([grads[i] for i in kept], axis, parts, wire) if kept else []):
            out[i] = g
    if split:
        moved = [jnp.moveaxis((grads[i] / parts).astype(jnp.float32), dims[i], 0) for i in split]
        table = jnp.concatenate([m.reshape(parts, -1) for m in moved], axis=1)
        if jax.process_count() > 1:  # across processes: a ring of small pieces (_ring_sum says why)
            mine = _ring_reduce_scatter(table, axis, parts, wire)
        elif exact:  # one reduce-scatter of the whole table: XLA's CPU compiler combines no reduce-scatters itself,
            # and one collective per gradient costs each its latency across hosts
            mine = jax.lax.psum_scatter(table, axis, scatter_dimension=0, tiled=True).reshape(-1)
        else:
            mine = _decode(jax.lax.all_to_all(_encode(table, jnp.dtype(wire)), axis, 0, 0), jnp.dtype(wire)).sum(axis=0)
        offset = 0
        for i, m in zip(split, moved):
            shape = (m.shape[0] // parts,) + m.shape[1:]
            size = m.size // parts
            out[i] = jnp.moveaxis(mine[offset:offset + size].reshape(shape), 0, dims[i]).astype(grads[i].dtype)
            offset += size
    return out


def _gather(dims, axis, parts, slices):
    """Inside a shard_map: the whole of every weight from each device's slice (split along its dimension in
    ``dims``; None: whole already), by one tiled ``all_gather`` per dtype of the slices laid end to end (each
    one's split dimension moved first), so the bytes are those of the all-gather half of a ring all-reduce
    and the latency is paid once, not per weight."""
    import jax
    import jax.numpy as jnp

    out = list(slices)
    by_dtype = {}
    for i, d in enumerate(dims):
        if d is not None:
            by_dtype.setdefault(jnp.dtype(slices[i].dtype), []).append(i)
    for _, indices in sorted(by_dtype.items(), key=lambda item: item[0].name):
        moved = [jnp.moveaxis(slices[i], dims[i], 0) for i in indices]
        flat = jnp.concatenate([m.reshape(-1) for m in moved])
        if jax.process_count() > 1 and flat.dtype == jnp.float32:  # a ring of small pieces (_ring_sum says why)
            table = _ring_all_gather(flat, axis, parts, "float32")
        else:
            table = jax.lax.all_gather(flat, axis)  # (parts, total): row k is device k's slices
        offset = 0
        for i, m in zip(indices, moved):
            whole = table[:, offset:offset + m.size].reshape((parts * m.shape[0],) + m.shape[1:])
            out[i] = jnp.moveaxis(whole, 0, dims[i])
            offset += m.size
    return out


def _encode(values, wire):
    """float32 ``values`` rounded to ``wire`` and returned as its bits (unsigned integers of its width).

    bfloat16 is float32's upper half: rounded to nearest even with integer arithmetic, which XLA's CPU
    compiler vectorizes (its float32->bfloat16 convert runs several times slower, enough to cost more than
    the halved traffic saves on a 1.6 M-parameter model); NaN stays NaN.
    """
    import jax
    import jax.numpy as jnp

    if wire == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return jnp.where(jnp.isnan(values), jnp.uint32(0x7FC0), rounded).astype(jnp.uint16)
    unsigned = jnp.dtype("uint{}".format(8 * wire.itemsize))
    return jax.lax.bitcast_convert_type(values.astype(wire), unsigned)


def _decode(bits, wire):
    """The float32 values of ``wire`` numbers given as their bits (the inverse of :func:`_encode`)."""
    import jax
    import jax.numpy as jnp

    if wire == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)
    return jax.lax.bitcast_convert_type(bits, wire).astype(jnp.float32)


def _global_moments(layer, keras_moments):
    """``BatchNormalization._moments`` over the whole batch while the compressed step is traced
    (:func:`~distkeras.backends.batchnorm.global_moments`, every shard's statistics gathered with
    ``jax.lax.all_gather``: one collective of a few floats per channel). Outside the step (evaluate,
    predict, a plain step) it is Keras' own.
    """

    def moments(inputs, mask):
        axis = getattr(_tracing, "axis", None)
        if axis is None:
            return keras_moments(inputs, mask)
        import jax
        import keras

        return batchnorm.global_moments(keras.ops, inputs, layer._reduction_axes, mask,
                                        lambda row: jax.lax.all_gather(row, axis), keras.backend.epsilon())

    return moments
