"""JAX's primitives of the one-device check (:mod:`distkeras.verify`).

Keras' JAX step function is pure: ``train_function(state, iterator) -> (logs, state)``, the state the four lists
of trainable, non-trainable, optimizer and metric variables' values (``keras/src/backend/jax/trainer.py``). The
checked step takes the first batch from the iterator itself and hands Keras a one-element iterator holding it.
Before the distributed step (which donates its input state) the state and the batch are copied whole to the
first local device (across processes, the batch gathered from every process); after it, the model class' own ``train_step`` runs there, eagerly, with no distribution set and
every distkeras hook off: one device's program. Nothing needs restoring: the distributed step's state is what
fit() goes on with.
"""

from ...verify import check as verify
from .. import verifying


def _variables(model):
    """The variables of Keras' JAX state, in its order, each with its kind."""
    groups = (
        [(v, "weight") for v in model.trainable_variables],
        [(v, "weight") for v in model.non_trainable_variables],
        [(v, "optimizer") for v in (model.optimizer.variables if model.optimizer is not None else [])],
        [(v, "metric") for v in model.metrics_variables],
    )
    return [entry for group in groups for entry in group]


def _host(value):
    """A JAX array's whole value as a NumPy array: a replicated array's own copy, a sharded one gathered from every
    process where this process holds only its part (``process_allgather``: every process calls it alike)."""
    import numpy as np

    if getattr(value, "is_fully_addressable", True):
        return np.asarray(value)
    if getattr(value, "is_fully_replicated", False):
        return np.asarray(value.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def wrap(model, check):
    """``wrap(train_function)`` for :func:`verifying.install`."""
    import jax

    def wrapping(function):
        def train_function(state, iterator):
            if not check.due:
                return function(state, iterator)
            if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
                check.skip("steps_per_execution > 1 runs several steps at once; the check compares one step")
                return function(state, iterator)
            data = next(iterator)
            device = jax.local_devices()[0]
            # A copy through the host (never an alias of a replicated array's buffer on this device: the
            # distributed step donates its input state's buffers). Across processes every process gathers the
            # whole global batch (a collective, at the same step on every process) and runs one device's step
            # on a device of its own: every process judges the same values.
            whole = jax.tree_util.tree_map(
                lambda x: jax.device_put(_host(x), device) if hasattr(x, "shape") else x, (state, data))
            logs, new_state = function(state, iter([data]))
            got = [_host(value) for group in new_state for value in group]
            got_logs = jax.tree_util.tree_map(lambda x: _host(x) if hasattr(x, "shape") else x, logs)
            import keras
            from keras.src.distribution import distribution_lib  # the global distribution, unset for one device

            distribution = distribution_lib.distribution()
            distribution_lib.set_distribution(None)
            try:
                with verifying.one_device(), jax.default_device(device):
                    want_logs, want_state = type(model).train_step(model, whole[0], whole[1])
            finally:
                distribution_lib.set_distribution(distribution)
            want = [value for group in want_state for value in group]
            variables = _variables(model)
            kinds = [(variable.path, kind) for variable, kind in variables]
            if len(kinds) != len(got) or len(got) != len(want):
                variables = [(None, "weight")] * len(got)
                kinds = [("state[{}]".format(i), "weight") for i in range(len(got))]
            numpy = keras.ops.convert_to_numpy
            check.judge(
                verifying.compared(model, [variable for variable, _ in variables],
                                   verify.named_state(kinds, [numpy(v) for v in got]),
                                   verify.named_state(kinds, [numpy(v) for v in want]), numpy)
                + verify.log_pairs(verifying.logs_of(got_logs, numpy), verifying.logs_of(want_logs, numpy)),
                verifying.compute_dtype(model), verifying.rows_of(whole[1]))
            return logs, new_state

        return train_function

    return wrapping
