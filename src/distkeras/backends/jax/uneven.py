"""JAX: a batch the devices don't divide, padded to a multiple of them where that stays one device's result.

JAX splits an array axis only evenly, so a batch of 10 samples on 3 devices (an epoch's short last
batch, a batch smaller than the device count) can't be split as it is. Where it is proven exact, the
batch is padded to the next multiple of the device count and runs split like any other; elsewhere it
runs whole on every device (the single-device result, not in parallel, with a warning naming why: the Keras
:func:`_replicate_uneven_batches` hook below; see
:mod:`distkeras.backends.jax.adapter`).

The padding rows repeat the batch's first row (finite values: no NaN that a zero weight can't cancel).

- ``predict()``: the padded rows' outputs are dropped before ``predict()`` returns; rows are independent
  in inference. Always padded (random draws included, see below).
- ``evaluate()`` and ``fit()``: the padding rows carry sample weight ``-0.0``: zero for any code that
  reads the weight, and told apart from a user's zero weight by its sign bit. While the step is traced,
  hooks on the model instance make the result exactly one device's on the real rows:
  ``compute_loss`` gets the weights with the padding zeroed and scaled by padded/real row count (Keras'
  default reduction ``sum_over_batch_size`` divides by the number of elements, padding included;
  ``mean``-type reductions don't change under the scale); the loss tracker counts the real rows (Keras
  weights each batch's loss by its row count); ``compute_metrics`` and the compiled metrics get the
  weights with the padding zeroed, the metrics compiled unweighted (``metrics=``) a 0/1 mask of the
  real rows.

  This is exact only where every part of the step honours those weights, so padding is chosen only
  where the model is made of Keras' own classes (no custom layer, model, ``train_step``,
  ``compute_loss`` or metric class: any could read the batch another way) and none of these is there:
  a loss reduction other than ``sum_over_batch_size``/``mean``/``mean_with_sample_weight``, several
  compiled losses, sample weights per output or per time step (not one per row), masks (``Masking``,
  ``Embedding(mask_zero=True)``: Keras rescales by the count of valid entries, padding included),
  activity regularization (an ``add_loss`` term over the batch), ``BatchNormalization`` in ``fit()``
  (its batch statistics would see the padding), a ``compression=`` or ``shard="gradients"`` step (each shard's
  loss would be scaled by its own real row count, not the batch's). Everything else keeps the
  whole-batch fallback. Tests pin each padded case against one device.
- Random draws: a ``keras.random`` draw is made for the padded shape. With JAX's partitionable
  threefry (``jax_threefry_partitionable``, on by default since JAX 0.5) the value of an element
  depends on its index only, so the real rows draw exactly what one device draws for them; without
  it, a model with a seed generator keeps the fallback.
- Across processes every process holds the whole global batch and pads it alike, so the same rules
  hold.

``train_on_batch``/``test_on_batch``/``predict_on_batch`` and sparse batches keep the fallback. Callbacks'
``on_predict_batch_end`` see a padded batch's outputs with the padding rows.

Private Keras API, on purpose: the trainer module's ``_distribute_data`` (the one place that places each
batch, with the batch structure in hand), the loss tracker ``_loss_tracker`` and the compiled
``_compile_loss``/``_compile_metrics`` internals read by :func:`_why_not`. Pinned by
tests/backends/test_jax.py.
"""

import contextlib
import functools
import logging
import math
import threading
import weakref

import numpy as np

from ...errors import DistKerasError
from .. import keras_model

_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
MODES = ("fit", "evaluate", "predict")
_state = threading.local()


class _Call(object):
    """One running ``fit``/``evaluate``/``predict`` of a distributed model."""

    def __init__(self, model, mode):
        self.model, self.mode = model, mode
        self.reason = False  # False: not decided yet; None: padding is exact; a string: why not
        self.batches = []  # predict: (rows, padded rows) of every batch placed
        self.count = None  # while a step is traced: the real row count (a tracer)
        self.mask = None  # while the metrics are traced: 0/1 per row

logger = logging.getLogger("distkeras")
#: Distributions distkeras made (only their batches fall back to replication) -> batch sizes warned about.
_ours = weakref.WeakKeyDictionary()


def current():
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def running(model, mode):
    """Mark ``model``'s ``mode`` (fit, evaluate or predict) as running in this thread."""
    stack = _state.__dict__.setdefault("stack", [])
    call = _Call(model, mode)
    stack.append(call)
    try:
        yield call
    finally:
        stack.pop()


def _active(model, sample_weight):
    call = current()
    if call is None or call.model is not model or call.mode == "predict" or call.reason is not None:
        return None
    return call if sample_weight is not None and not isinstance(sample_weight, (list, tuple, dict)) else None


def _decode(sample_weight):
    """(weights with the padding zeroed, 0/1 float mask of the real rows, real row count)."""
    import jax.numpy as jnp

    weights = jnp.asarray(sample_weight)
    real = ~jnp.signbit(weights)
    rows = real.reshape(real.shape[0], -1)[:, 0].astype(weights.dtype)
    return jnp.where(real, weights, jnp.zeros_like(weights)), rows, jnp.sum(rows)


def install(model):
    """Hook the model instance's ``compute_loss`` and ``compute_metrics`` so a padded batch's weights are
    read as described in the module docstring. They change nothing outside a padded fit/evaluate."""
    klass = type(model)
    own_loss = klass.compute_loss.__get__(model)
    own_metrics = klass.compute_metrics.__get__(model)

    @functools.wraps(own_loss)
    def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        call = _active(model, sample_weight)
        if call is None:
            return own_loss(x, y, y_pred, sample_weight, **kwargs)
        weights, rows, count = _decode(sample_weight)
        call.count = count
        return own_loss(x, y, y_pred, weights * (rows.shape[0] / count), **kwargs)

    @functools.wraps(own_metrics)
    def compute_metrics(x, y, y_pred, sample_weight=None):
        call = _active(model, sample_weight)
        if call is None:
            return own_metrics(x, y, y_pred, sample_weight)
        weights, call.mask, _ = _decode(sample_weight)
        try:
            return own_metrics(x, y, y_pred, weights)
        finally:
            call.mask = None

    keras_model.hook(model, "compute_loss", compute_loss)
    keras_model.hook(model, "compute_metrics", compute_metrics)


def _hook_metrics(model):
    """The loss tracker counts the real rows; metrics compiled unweighted get the real rows' mask."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None and "update_state" not in tracker.__dict__:
        own = type(tracker).update_state.__get__(tracker)

        def count_real_rows(values, sample_weight=None):
            call = current()
            if call is not None and call.model is model and call.count is not None:
                sample_weight, call.count = call.count, None
            return own(values, sample_weight=sample_weight)

        keras_model.hook(tracker, "update_state", count_real_rows)
    compiled = getattr(model, "_compile_metrics", None)
    for group in getattr(compiled, "_flat_metrics", None) or ():
        if group is None or "update_state" in group.__dict__:
            continue

        def masked(y_true, y_pred, sample_weight=None, _own=type(group).update_state.__get__(group)):  # noqa: B008 (binds this group)
            call = current()
            if sample_weight is None and call is not None and call.model is model and call.mask is not None:
                sample_weight = call.mask
            return _own(y_true, y_pred, sample_weight=sample_weight)

        keras_model.hook(group, "update_state", masked)


def _why_not(model, mode):
    """None where a padded batch gives exactly one device's result for ``model``'s ``mode``, else why not."""
    import jax
    import keras

    layers = keras_model.layers_of(model)
    random = any(v.path.rpartition("/")[2] == "seed_generator_state" for v in model.variables)
    if random and not getattr(jax.config, "jax_threefry_partitionable", False):
        return "it draws random numbers and jax_threefry_partitionable is off (draws depend on the batch shape)"
    if mode == "predict":
        return None
    for layer in layers:
        if not type(layer).__module__.startswith("keras."):
            return "{} is your own class (it may read the batch other than by sample weight)".format(
                type(layer).__name__)
        if getattr(layer, "activity_regularizer", None) is not None or isinstance(
                layer, keras.layers.ActivityRegularization):
            return "{} adds an activity regularization loss over the batch".format(layer.name)
        if isinstance(layer, keras.layers.Masking) or getattr(layer, "mask_zero", False):
            return "{} makes a mask (Keras scales the loss by the count of valid entries)".format(layer.name)
        if mode == "fit" and isinstance(layer, keras.layers.BatchNormalization):
            return "{} normalises by the statistics of the batch in training".format(layer.name)
    if mode == "fit" and "train_step" in model.__dict__:
        return "its train_step is replaced (compression=, shard='gradients')"
    compiled_loss = getattr(model, "_compile_loss", None)
    if compiled_loss is not None:
        losses = getattr(compiled_loss, "_flat_losses", None)
        if losses is None or len(losses) > 1:
            return "it has several compiled losses"
        for entry in losses:
            reduction = getattr(entry.loss, "reduction", None)
            if reduction not in _REDUCTIONS or not type(entry.loss).__module__.startswith("keras."):
                return "its loss reduction is {!r}".format(reduction)
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is not None:
        groups = (getattr(compiled, "_flat_metrics", None) or []) + (getattr(compiled, "_flat_weighted_metrics", None) or [])
        for group in groups:
            for metric in getattr(group, "metrics", []) if group is not None else []:
                if not type(metric).__module__.startswith("keras."):
                    return "the metric {} is your own class (it may ignore sample weights)".format(metric.name)
    return None


def pad(data, parts, call):
    """``(data padded, None)``: ``data`` (a batch as Keras' iterator yields it) padded to a multiple of
    ``parts`` rows; ``(None, None)`` where it divides already; ``(None, why)`` where padding isn't exact.

    Whether padding is exact is decided at the call's first batch, before any step is traced (a traced
    step is reused for every later batch of the same shape, padded or not).

    Raises:
        DistKerasError: a sample weight with its sign bit set (negative, or -0.0) while padding is on:
            it would be read as padding.
    """
    import jax
    import keras
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    leaves = [a for a in keras.tree.flatten(x) if a is not None and getattr(a, "shape", ())]
    if not leaves:
        return None, None
    if not all(isinstance(a, (np.ndarray, jax.Array)) for a in keras.tree.flatten(data) if a is not None):
        if leaves[0].shape[0] % parts:
            return None, "its batches are not dense arrays"
        return None, None
    size = leaves[0].shape[0]
    total = -(-size // parts) * parts
    index = np.concatenate([np.arange(size), np.zeros(total - size, dtype=np.int64)])

    def rows(a):
        return None if a is None else np.take(np.asarray(a), index, axis=0)

    if call.mode == "predict":
        call.batches.append((size, total))
    if _unbuilt(call.model, call.mode):
        # The batch Keras draws to build the model and its compiled loss and metrics symbolically: only
        # its shapes are read. Padded by rows (no decision yet: what is compiled isn't built).
        return (keras.tree.map_structure(rows, data) if total != size else None), None
    if call.reason is False:
        call.reason = _why_not(call.model, call.mode)
        if call.reason is None and call.mode != "predict":
            _hook_metrics(call.model)
    nested = isinstance(sample_weight, (list, tuple, dict))
    if call.reason is None and call.mode != "predict" and sample_weight is not None and not nested:
        if np.signbit(np.asarray(sample_weight)).any():
            raise DistKerasError(
                "A sample weight is negative (or -0.0). On {} devices distkeras pads a batch they don't divide "
                "with rows of sample weight -0.0 and tells them apart by the sign, so it can't take negative "
                "weights. Use non-negative sample weights.".format(parts))
    if total == size:
        return None, None
    if call.reason is not None:
        return None, call.reason
    if nested and call.mode != "predict":
        return None, "its sample weights are per output"
    if call.mode == "predict":
        return (keras.tree.map_structure(rows, x),), None
    weights = np.ones((size,), "float32") if sample_weight is None else np.asarray(sample_weight)
    if weights.ndim != 1:
        return None, "its sample weights are not one per row"
    if not np.issubdtype(weights.dtype, np.floating):
        weights = weights.astype("float32")  # an integer has no -0.0
    padding = np.full((total - size,) + weights.shape[1:], -0.0, weights.dtype)
    padded = keras.tree.map_structure(rows, x), keras.tree.map_structure(rows, y), np.concatenate([weights, padding])
    return padded, None


def _unbuilt(model, mode):
    """What makes Keras' ``_symbolic_build`` (fit, evaluate) or ``predict`` draw a batch to build the model
    (their own conditions)."""
    compiled = [getattr(model, name, None) for name in ("_compile_metrics", "_compile_loss")] if mode != "predict" else []
    return not all(layer.built for layer in keras_model.layers_of(model)) or any(
        c is not None and not c.built for c in compiled)


def drop_padding(outputs, call):
    """``predict()``'s ``outputs`` without the rows :func:`pad` added."""
    import keras

    if not any(size != total for size, total in call.batches):
        return outputs
    rows = keras.tree.flatten(outputs)[0].shape[0]
    batches = list(call.batches)
    while batches and sum(total for _, total in batches) > rows:
        batches.pop(0)  # a batch predict() drew to build the model, before it reset its iterator
    starts = np.cumsum([0] + [total for _, total in batches])[:-1]
    keep = np.concatenate([start + np.arange(size) for start, (size, _) in zip(starts, batches)])
    return keras.tree.map_structure(lambda a: a[keep], outputs)


def _replicate_uneven_batches():
    """Let a batch the "batch" mesh axis doesn't divide run replicated, instead of JAX's IndivisibleError.

    Keras' JAX trainer places every batch with ``distribute_data_input`` of its backend distribution
    module, looked up per call, with the layout of the epoch's first batch. There is no public hook, so
    that private function is wrapped once (guarded: left alone where it is missing). The wrapper
    changes nothing for a distribution distkeras didn't make, nor for a batch that divides.
    """
    try:
        from keras.src.backend.jax import distribution_lib as lib
    except ImportError:
        return
    original = getattr(lib, "distribute_data_input", None)
    if original is None or getattr(original, "distkeras", False):
        return

    @functools.wraps(original)
    def distribute_data_input(per_process_batch, layout, batch_dim_name):
        import jax
        import keras

        sharding = getattr(layout, "backend_layout", layout)
        shape = getattr(per_process_batch, "shape", ())
        current = keras.distribution.distribution()
        warned = _ours.get(current) if current is not None else None
        if warned is None or not isinstance(sharding, jax.sharding.NamedSharding) or not shape:
            return original(per_process_batch, layout, batch_dim_name)
        axis, parts = _batch_axis(sharding)
        if axis < len(shape) and shape[axis] % parts:
            _warn_uneven(warned, shape[axis], parts)
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        if jax.process_count() > 1:
            # Every process holds the whole global batch: each keeps only its devices' slices.
            batch = per_process_batch
            return jax.make_array_from_callback(tuple(shape), sharding, lambda index: batch[index])
        return original(per_process_batch, sharding, batch_dim_name)

    distribute_data_input.distkeras = True
    lib.distribute_data_input = distribute_data_input
    _pad_uneven_batches()


def _pad_uneven_batches():
    """Pad a batch the "batch" mesh axis doesn't divide where that is exact (:mod:`.uneven`).

    Keras' JAX trainer places each batch its epoch iterator yields with its module function
    ``_distribute_data(data, layouts)``, looked up per call: the one place that sees a whole batch (x, y
    and sample weights together) before it is split. There is no public hook, so that private function
    is wrapped once (guarded: left alone where it is missing; pinned by a test). The wrapper changes
    nothing outside a distributed model's fit/evaluate/predict, nor for a batch that divides;
    ``*_on_batch`` (no layouts) keep the replicated fallback.
    """
    try:
        from keras.src.backend.jax import trainer
    except ImportError:
        return
    original = getattr(trainer, "_distribute_data", None)
    if original is None or getattr(original, "distkeras", False):
        return
    @functools.wraps(original)
    def _distribute_data(data, layouts=None):
        import jax
        import keras

        call = current()
        active = keras.distribution.distribution()
        warned = _ours.get(active) if active is not None else None
        first = [layout for layout in keras.tree.flatten(layouts) if layout is not None] if layouts is not None else []
        if call is None or warned is None or not first or not isinstance(first[0], jax.sharding.NamedSharding):
            return original(data, layouts)
        axis, parts = _batch_axis(first[0])
        if axis != 0 or parts == 1:
            return original(data, layouts)
        padded, why_not = pad(data, parts, call)
        if padded is not None:
            return original(padded)  # the layouts of the padded structure (sample weights added)
        if why_not is not None:
            rows = [a for a in keras.tree.flatten(data) if a is not None][0].shape[0]
            _warn_uneven(warned, rows, parts, why_not)
        return original(data, layouts)

    _distribute_data.distkeras = True
    trainer._distribute_data = _distribute_data


def _batch_axis(sharding):
    """The axis ``sharding`` splits the batch along, and into how many pieces: the first axis the spec
    names a mesh axis for. That is axis 0 for a batch, and axis 1 for the stack of batches Keras after 3.15
    runs as one scan with ``steps_per_execution > 1`` (spec ``(None, 'batch', ...)``)."""
    for axis, entry in enumerate(sharding.spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = [name for name in names if name is not None]
        if names:
            return axis, math.prod(sharding.mesh.shape[name] for name in names)
    return 0, 1



def _warn_uneven(warned, size, parts, why_not=None):
    if size in warned:
        return
    warned.add(size)
    logger.warning(
        "a batch of %d samples doesn't split evenly over %d devices (JAX shards only evenly) and padding it isn't "
        "exact here (%s), so it runs whole on every device: the single-device result, not in parallel. A batch "
        "size divisible by %d keeps every step parallel (an epoch's last batch is smaller when the sample count "
        "isn't a multiple of it).",
        size,
        parts,
        why_not or "a batch placed outside fit, evaluate and predict",
        parts,
    )
