"""TensorFlow's primitives for hand-written loops (:mod:`distkeras.loops`).

A replica step is ``strategy.run`` of the user's step on the replica's part of a batch that
``strategy.experimental_distribute_dataset`` split; the adapter's rules (each loss the replica's own mean,
``optimizer.apply`` given ``sum_r (n_r / N) g_r``, random draws of one device) hold inside it as in ``fit()``,
since the step runs through the strategy's ``run`` distkeras wrapped (:func:`.steps.tell_replicas_their_rows`).
An optimizer or metric the loop made itself is adopted by :func:`attach` as the adapter adopts the model's own.

A loop without these calls is stopped at its first ``optimizer.apply`` on the model's variables with a
:class:`~distkeras.errors.LoopError` saying what to add, rather than Keras' ``TypeError: tuple indices must be
integers or slices, not MirroredVariable`` (an optimizer that never saw the strategy) or a silent step of the
whole batch on one device (an attached optimizer outside ``strategy.run``).
"""

import functools
import weakref

from ...errors import LoopError
from .. import keras_model
from . import steps as tensorflow_steps

#: Strategy -> the function that adopts an optimizer or metric (the adapter's), for every distributed model.
_adopters = weakref.WeakKeyDictionary()
#: The attribute that marks BaseOptimizer.apply as checked (installed once per process).
_CHECKED = "_distkeras_loop_checked"

_WHAT_TO_ADD = (
    "A hand-written loop on a model distributed with distkeras needs, as in docs/loops.md:\n"
    "    train_dataset = distkeras.distribute_dataset(train_dataset, model)\n"
    "    distkeras.attach(model, optimizer, *metrics)\n"
    "    train_step = distkeras.distribute_step(train_step, model)"
)


def install(model, tf, strategy, adopt):
    """Make ``model``'s strategy known to the loop calls; ``adopt(obj)`` distributes an optimizer or metric."""
    _adopters[strategy] = adopt
    _check_every_apply(tf)


def _strategy(model):
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None or strategy not in _adopters:
        raise LoopError("Expected a model distributed with distkeras.distribute() on TensorFlow. Received: {!r} "
                        "of type {}, which is not.".format(model, type(model).__name__))
    return strategy


def distribute_dataset(dataset, model):
    """``strategy.experimental_distribute_dataset(dataset)``: each replica's part of every batch."""
    import tensorflow as tf

    strategy = _strategy(model)
    if not isinstance(dataset, tf.data.Dataset):
        raise LoopError(
            "Expected a tf.data.Dataset of global batches for distribute_dataset() on TensorFlow (its replicas "
            "take their parts with strategy.experimental_distribute_dataset). Received: {!r} of type {}. Wrap "
            "arrays with tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).".format(
                dataset, type(dataset).__name__))
    return strategy.experimental_distribute_dataset(dataset)


def attach(model, obj):
    """Adopt an optimizer or metric the loop made: variables mirrored, the optimizer told the strategy and
    given the global gradient."""
    strategy = _strategy(model)
    if not (_is_optimizer(obj) or _is_metric(obj)):
        raise LoopError("Expected Keras optimizers and metrics for attach(). Received: {!r} of type {}".format(
            obj, type(obj).__name__))
    _adopters[strategy](obj)


def distribute_step(step, model):
    """A ``tf.function`` running ``step`` once per replica; its outputs reduced to one device's."""
    import tensorflow as tf

    strategy = _strategy(model)
    fn = getattr(step, "python_function", step)  # a tf.function's Python function: traced once, per replica

    def replica_step(*args, **kwargs):
        outputs = fn(*args, **kwargs)
        share = tensorflow_steps.batch_share(tf, tf.float32)
        if share is None:  # Keras' own loss rule (exact_loss_scaling=False): the replicas weigh alike
            share = tf.constant(1.0 / strategy.num_replicas_in_sync)

        def weighed(value):
            if _is_float_scalar(tf, value):
                return value * tf.cast(share, value.dtype)
            return value

        return tf.nest.map_structure(weighed, outputs)

    @tf.function
    def distributed_step(*args, **kwargs):
        leaves = [v for v in tf.nest.flatten((args, kwargs)) if v is not None]
        if not leaves or not isinstance(leaves[0], tf.distribute.DistributedValues):
            raise LoopError(
                "distkeras.distribute_step() runs the step on each replica's part of a batch of "
                "distkeras.distribute_dataset(); it was given a whole batch ({}). Iterate "
                "distkeras.distribute_dataset(dataset, model).".format(type(leaves[0]).__name__ if leaves else "none"))
        outputs = strategy.run(replica_step, args=args, kwargs=kwargs)

        def one_device(value):
            first = strategy.experimental_local_results(value)[0]
            if _is_float_scalar(tf, first):  # a loss or a mean: each replica's weighed by its share, summed
                return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            if isinstance(first, tf.Tensor) and first.shape.rank:  # per row: the replicas' rows, in order
                return strategy.gather(value, axis=0)
            return first

        return tf.nest.map_structure(one_device, outputs)

    return functools.wraps(fn)(distributed_step) if callable(fn) else distributed_step


def _is_float_scalar(tf, value):
    return isinstance(value, tf.Tensor) and value.shape.rank == 0 and value.dtype.is_floating


def _is_optimizer(obj):
    import keras

    return isinstance(obj, keras.optimizers.Optimizer)


def _is_metric(obj):
    import keras

    return isinstance(obj, keras.metrics.Metric)


def _check_every_apply(tf):
    """``optimizer.apply`` on a distributed model's variables checks, first, that the optimizer knows the
    model's strategy and runs in a replica step.

    Installed once on Keras' ``BaseOptimizer.apply`` (a class attribute: an optimizer the loop made and never
    gave distkeras can be reached no other way). The check is two attribute reads and an ``isinstance`` per
    call; an optimizer of a model distkeras never distributed, or of one on one device, is not affected.
    Pinned by tests/backends/test_loops.py.
    """
    from keras.src.optimizers import base_optimizer  # the class every Keras 3 optimizer's apply() comes from

    cls = base_optimizer.BaseOptimizer
    apply = cls.apply
    if getattr(apply, _CHECKED, False):
        return

    @functools.wraps(apply)
    def checked_apply(self, grads, trainable_variables=None):
        check_apply(tf, self, trainable_variables)
        return apply(self, grads, trainable_variables)

    setattr(checked_apply, _CHECKED, True)
    cls.apply = checked_apply


def check_apply(tf, optimizer, trainable_variables):
    """Raise :class:`LoopError` where ``optimizer.apply(grads, trainable_variables)`` would fail or compute the
    whole batch on one device: the variables are a distributed model's, and the optimizer was not attached to it
    or runs outside a replica step. Also called first by the ``apply`` hook of :mod:`.mirror` (attached optimizers)."""
    if isinstance(trainable_variables, (list, tuple)) and trainable_variables:
        storage = getattr(trainable_variables[0], "_value", None)
        if isinstance(storage, tf.distribute.DistributedValues):
            strategy = storage.distribute_strategy
            if strategy in _adopters and not _suspended():
                _check_loop(tf, optimizer, strategy)


def _suspended():
    """Whether plain Keras runs inside the one-device check (keras_model.suspended): this check stands aside."""
    return getattr(keras_model, "is_suspended", lambda: False)()


def _check_loop(tf, optimizer, strategy):
    if getattr(optimizer, "_distribution_strategy", None) is not strategy:
        raise LoopError(
            "optimizer.apply() of {} {!r} was given the variables of a model distributed with distkeras "
            "(mirrored over {} replicas), and this optimizer was not attached to it, so it can't update them. "
            "Attach it: distkeras.attach(model, optimizer).\n{}".format(
                type(optimizer).__name__, optimizer.name, strategy.num_replicas_in_sync, _WHAT_TO_ADD))
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        raise LoopError(
            "optimizer.apply() of {} {!r} was called outside a replica step: the whole batch was computed on one "
            "device, not split over the {} replicas. Run the step per replica: "
            "train_step = distkeras.distribute_step(train_step, model), over batches of "
            "distkeras.distribute_dataset(dataset, model).\n{}".format(
                type(optimizer).__name__, optimizer.name, strategy.num_replicas_in_sync, _WHAT_TO_ADD))

