"""JAX's primitives for hand-written loops (:mod:`distkeras.loops`).

A jitted step is one SPMD program: given the model's variables replicated on the mesh (as the adapter laid
them out) and a batch split along the mesh's batch axis, XLA computes the global batch's loss and gradient and
all-reduces what it must; ``optimizer.stateless_apply`` and ``metric.stateless_update_state`` then see one
device's values. What a loop lacks is the layout of its batch: the guide's NumPy arrays would be replicated,
every device computing the whole batch. :func:`distribute_step` lays the batch's arrays out (Keras'
``DataParallel`` data layout) before calling the user's step. :func:`attach` lays an optimizer's or metric's
variables out like the model's, and has an unbuilt optimizer build its slots under the model's distribution.

A model called outside ``fit``/``evaluate``/``predict`` and outside a distributed step (the guide's jitted step
without :func:`distribute_step`, traced on a replicated batch) warns once: its first call is where that step
is traced, so the check costs nothing once it is compiled.
"""

import functools
import logging
import threading
import weakref

from ...errors import LoopError
from .. import keras_model

logger = logging.getLogger("distkeras")

#: Model -> its keras.distribution (DataParallel or ModelParallel), for every distributed model.
_distributions = weakref.WeakKeyDictionary()
#: ``depth`` > 0 while a distributed step runs (or is traced) in this thread.
_stepping = threading.local()
#: The model instance attribute holding whether it warned already.
_WARNED = "_distkeras_loop_warned"
_HOOKED = ("stateless_call", "call")


def install(model, distribution):
    """Know ``model``'s distribution, and warn once when a loop calls it on a batch laid out on no mesh."""
    _distributions[model] = distribution
    keras_model.unhook(model, *_HOOKED)
    for name in _HOOKED:
        keras_model.hook(model, name, _checked(model, getattr(model, name)))


def _distribution(model):
    distribution = _distributions.get(model)
    if distribution is None:
        raise LoopError.not_distributed(model, "JAX")
    return distribution


def distribute_dataset(dataset, model):
    """``dataset`` itself: each global batch is laid out on the mesh by :func:`distribute_step`."""
    _distribution(model)
    return dataset


def attach(model, obj):
    """Lay ``obj``'s variables out like the model's; an unbuilt optimizer builds under the distribution."""
    import keras

    distribution = _distribution(model)
    if not isinstance(obj, (keras.optimizers.Optimizer, keras.metrics.Metric)):
        raise LoopError("Expected Keras optimizers and metrics for attach(). Received: {!r} of type {}".format(
            obj, type(obj).__name__))
    _lay_out(obj.variables, distribution)
    if isinstance(obj, keras.optimizers.Optimizer) and not keras_model.is_hooked(obj, "build"):
        build = obj.build

        @functools.wraps(build)
        def build_on_mesh(*args, **kwargs):
            with distribution.scope():
                result = build(*args, **kwargs)
            _lay_out(obj.variables, distribution)
            return result

        keras_model.hook(obj, "build", build_on_mesh)


def distribute_step(step, model):
    """``step`` called with every batch array of its arguments laid out along the mesh's batch axis."""
    distribution = _distribution(model)

    @functools.wraps(step)
    def distributed_step(*args, **kwargs):
        args, kwargs = _laid_out((args, kwargs), distribution, model)
        _stepping.depth = getattr(_stepping, "depth", 0) + 1
        try:
            with distribution.scope():
                return step(*args, **kwargs)
        finally:
            _stepping.depth -= 1

    return distributed_step


def _lay_out(variables, distribution):
    import keras

    for variable in variables:
        layout = distribution.get_variable_layout(variable)
        value = variable.value
        if not value.sharding.is_equivalent_to(layout.backend_layout, len(value.shape)):
            variable.assign(keras.distribution.distribute_tensor(value, layout))


def _is_batch_array(value):
    """A batch's array: NumPy, TensorFlow or torch (not a JAX array or Keras variable: the loop's state)."""
    import jax

    if isinstance(value, (jax.Array, keras_variable_class())):
        return False
    return hasattr(value, "shape") and len(getattr(value, "shape", ())) > 0 and hasattr(value, "dtype")


@functools.lru_cache(maxsize=None)
def keras_variable_class():
    import keras

    return keras.Variable


def _laid_out(structure, distribution, model):
    import jax
    import numpy as np

    def place(value):
        if not _is_batch_array(value):
            return value
        array = np.asarray(value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value)
        layout = distribution.get_data_layout(array.shape).backend_layout
        parts = _batch_parts(layout)
        if array.shape[0] % parts:
            _warn_once(model, "a batch of {} rows, which the mesh's {} batch parts don't divide, ran whole on every "
                              "device (one device's result, not split); make the batch size a multiple of {}".format(
                                  array.shape[0], parts, parts))
            layout = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
        return jax.make_array_from_callback(array.shape, layout, lambda index: array[index])

    return jax.tree_util.tree_map(
        place, structure, is_leaf=lambda v: isinstance(v, keras_variable_class()) or _is_batch_array(v))


def _batch_parts(sharding):
    spec = sharding.spec
    axes = spec[0] if len(spec) else None
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for name in names:
        size *= sharding.mesh.shape[name]
    return size


def _warn_once(model, what):
    if not model.__dict__.get(_WARNED):
        model.__dict__[_WARNED] = True
        logger.warning("%s", what)


def _checked(model, method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        if not getattr(_stepping, "depth", 0) and not model.__dict__.get(_WARNED):
            _check_call(model, args, kwargs)
        return method(*args, **kwargs)

    return call


def _check_call(model, args, kwargs):
    import jax
    import keras

    if keras.distribution.distribution() is not None:  # fit/evaluate/predict, or the user's own scope
        return
    distribution = _distributions.get(model)
    devices = len(distribution.device_mesh.devices.flatten()) if distribution is not None else 1
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and len(leaf.shape):
            if len(leaf.sharding.device_set) == devices and not leaf.sharding.is_fully_replicated:
                return  # a batch the loop laid out on the mesh itself
    _warn_once(model, (
        "{} {!r}, distributed over {} devices, was called outside fit()/evaluate()/predict() on a batch that is "
        "not laid out on its mesh: every device computes the whole batch. In a hand-written loop run the step "
        "with train_step = distkeras.distribute_step(train_step, model) (see docs/loops.md).").format(
            type(model).__name__, model.name, devices))
