"""JAX's primitives of the one-device check (:mod:`distkeras.verify`).

Keras' JAX step function is pure: ``train_function(state, iterator) -> (logs, state)``, the state the four lists
of trainable, non-trainable, optimizer and metric variables' values (``keras/src/backend/jax/trainer.py``). The
checked step takes the first batch from the iterator itself and hands Keras a one-element iterator holding it.
Before the distributed step (which donates its input state) the state and the batch are copied whole to the
first device; after it, the model class' own ``train_step`` runs there, eagerly, with no distribution set and
every distkeras hook off: one device's program. Nothing needs restoring: the distributed step's state is what
fit() goes on with.
"""

from ... import verify
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


def wrap(model, check):
    """``wrap(train_function)`` for :func:`verifying.install`."""
    import jax
    import numpy as np

    def wrapping(function):
        def train_function(state, iterator):
            if not check.due:
                return function(state, iterator)
            if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
                check.skip("steps_per_execution > 1 runs several steps at once; the check compares one step")
                return function(state, iterator)
            if jax.process_count() > 1:
                check.skip("across JAX processes the check doesn't gather the global batch yet; it runs in one process")
                return function(state, iterator)
            data = next(iterator)
            device = jax.devices()[0]
            # A copy through the host (never an alias of a replicated array's buffer on this device: the
            # distributed step donates its input state's buffers).
            whole = jax.tree_util.tree_map(
                lambda x: jax.device_put(np.asarray(x), device) if hasattr(x, "shape") else x, (state, data))
            logs, new_state = function(state, iter([data]))
            got = [value for group in new_state for value in group]
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
                + verify.log_pairs(verifying.logs_of(logs, numpy), verifying.logs_of(want_logs, numpy)))
            return logs, new_state

        return train_function

    return wrapping
