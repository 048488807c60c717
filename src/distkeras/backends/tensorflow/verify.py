"""TensorFlow's primitives of the one-device check (:mod:`distkeras.verify`).

Keras' TensorFlow step function takes an iterator, or a Python iterable of batches, which it runs one step each
(``keras/src/backend/tensorflow/trainer.py``, ``_make_function``). The checked step takes the first element of
the distributed iterator itself, eagerly, and hands Keras a one-element list holding it: the step trains on it as
it would have, and no batch of the user's pipeline is drawn that training doesn't use. The global batch is the
replicas' parts of that element, concatenated in replica order (MirroredStrategy splits a batch into contiguous
parts). The one-device step is the model class' own ``train_step``, called eagerly outside the strategy's scope
with every distkeras hook off: Keras' TensorFlow optimizer then updates each mirrored variable as one variable.
"""

import itertools

from .. import verifying


def global_batch(strategy, element):
    """The whole global batch of a distributed dataset's ``element``: every replica's part, concatenated."""
    import tensorflow as tf

    def whole(value):
        parts = strategy.experimental_local_results(value)
        if len(parts) == 1:
            return parts[0]
        if not getattr(parts[0], "shape", None) or parts[0].shape.rank == 0:
            return parts[0]
        return tf.concat(list(parts), axis=0)

    return tf.nest.map_structure(whole, element)


def wrap(model, check):
    """``wrap(train_function)`` for :func:`verifying.install`."""

    def wrapping(function):
        def train_function(iterator):
            if not check.due:
                return function(iterator)
            iterator = iterator if hasattr(iterator, "get_next") else iter(iterator)
            element = next(iterator)  # StopIteration ends the epoch, as Keras' own function raises it
            strategy = model.distribute_strategy
            batch = global_batch(strategy, element)

            if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
                check.skip("steps_per_execution > 1 runs several steps at once; the check compares one step")
                return function(itertools.chain([element], iterator))
            return verifying.checked_in_place(
                model, check, verifying.numpy, lambda: function([element]), lambda: type(model).train_step(model, batch))

        return train_function

    return wrapping
