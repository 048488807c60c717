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

import contextlib
import functools
import threading

from ...errors import OptionError
from .. import batchnorm, keras_model

#: Wire dtype of each ``compression`` value (JAX's names).
WIRE = {"bf16": "bfloat16", "fp16": "float16"}
#: How a layer left for its own ``_moments`` gets the global batch's statistics on JAX (no sync_batchnorm option).
_OPT_IN = ("give the class no _moments of its own, or drop compression= (JAX's uncompressed step is one program "
           "over the global batch, and every layer's own code sees all of it)")
_PRIVATE_METRICS_UPDATE = "_update_metrics_variables"

#: The mesh axis name while the compressed step's per-shard gradient is traced (None otherwise), per thread.
_tracing = threading.local()


def install(model, mesh, axis, wire, rank=0):
    """Replace ``model.train_step`` by the step whose gradients travel in dtype ``wire`` (``WIRE[compression]``;
    "float32" gives the exact average, for tests) over ``axis`` of ``mesh`` (a ``jax.sharding.Mesh``), and
    make its BatchNormalization layers' statistics global inside it, by the rule of
    :mod:`distkeras.backends.batchnorm` (a subclass with its own ``_moments`` sees its shard; rank 0 warns).

    Raises:
        OptionError: the model's class defines its own ``train_step`` (it computes its gradient itself, so
            there is no place to compress it), or this Keras lacks what the step is built from.
    """
    defining = next(klass for klass in type(model).__mro__ if "train_step" in vars(klass))
    if not defining.__module__.startswith("keras.src.backend.jax."):
        raise OptionError(
            "compression on JAX replaces Keras' train_step with one that all-reduces the gradients in 16 bits, and "
            "{}.train_step is your own. Drop compression=, or compute and average the gradients yourself.".format(
                defining.__name__))
    import keras

    for klass, name in ((type(model), _PRIVATE_METRICS_UPDATE), (keras.layers.BatchNormalization, batchnorm.MOMENTS)):
        if not callable(getattr(klass, name, None)):
            raise OptionError("compression on JAX needs Keras' {}.{}, which this Keras ({}) lacks. Drop "
                              "compression=.".format(klass.__name__, name, keras.__version__))
    selection = batchnorm.select(model)
    batchnorm.warn_left(selection, rank, opt_in=_OPT_IN, opt_out=None)
    for layer in selection.synchronized:
        keras_model.hook(layer, batchnorm.MOMENTS, _global_moments(layer, getattr(type(layer), batchnorm.MOMENTS).__get__(layer)))
    keras_model.hook(model, "train_step", _train_step(model, model.train_step, mesh, axis, wire))


def uninstall(model):
    """Remove :func:`install`'s hooks from the model's BatchNormalization layers (the model's own go with
    ``keras_model.unhook(model)``)."""
    batchnorm.unhook(model)


@contextlib.contextmanager
def _sharded(axis):
    previous = getattr(_tracing, "axis", None)
    _tracing.axis = axis
    try:
        yield
    finally:
        _tracing.axis = previous


def _shard_map():
    """``jax.shard_map`` without its replication check (our outputs are replicated by psum/pmean, or
    stacked), in the spelling of this JAX version."""
    import jax

    if hasattr(jax, "shard_map"):
        return functools.partial(jax.shard_map, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return functools.partial(shard_map, check_rep=False)


def _train_step(model, original, mesh, axis, wire):
    import jax
    import jax.numpy as jnp
    import keras
    from jax.sharding import PartitionSpec

    parts = mesh.shape[axis]
    shard_map = _shard_map()
    whole, split = PartitionSpec(), PartitionSpec(axis)

    def spec(tree):
        return keras.tree.map_structure(lambda leaf: split if getattr(leaf, "ndim", 0) else whole, tree)

    def local(trainable, non_trainable, metrics, optimizer_variables, x, y, sample_weight):
        with _sharded(axis):
            (_, aux), grads = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)(
                trainable, non_trainable, metrics, x, y, sample_weight, training=True,
                optimizer_variables=optimizer_variables)
        unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
        grads = _average(grads, axis, parts, wire)
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
        step = shard_map(
            local, mesh=mesh,
            in_specs=(whole, whole, whole, whole, spec(x), spec(y), spec(sample_weight)),
            out_specs=(whole, whole, split, whole, split))
        grads, unscaled_loss, y_pred, non_trainable, deltas = step(
            trainable, non_trainable, metrics, optimizer_variables, x, y, sample_weight)
        metrics = [old + delta.sum(axis=0).astype(old.dtype) for old, delta in zip(metrics, deltas)]
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
    """
    import jax
    import jax.numpy as jnp

    wire = jnp.dtype(wire)
    flat = jnp.concatenate([(g / parts).astype(jnp.float32).reshape(-1) for g in grads])
    size = flat.shape[0]
    table = jnp.pad(flat, (0, -size % parts)).reshape(parts, -1)
    mine = jax.lax.all_to_all(_encode(table, wire), axis, 0, 0)
    summed = _decode(mine, wire).sum(axis=0)
    whole = _decode(jax.lax.all_gather(_encode(summed, wire), axis, tiled=True), wire)
    averaged, offset = [], 0
    for g in grads:
        averaged.append(whole[offset:offset + g.size].reshape(g.shape).astype(g.dtype))
        offset += g.size
    return averaged


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
