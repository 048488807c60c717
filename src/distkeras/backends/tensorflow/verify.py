"""TensorFlow's primitives of the one-device check (:mod:`distkeras.verify`).

Keras' TensorFlow step function takes an iterator, or a Python iterable of batches, which it runs one step each
(``keras/src/backend/tensorflow/trainer.py``, ``_make_function``). The checked step takes the first element of
the distributed iterator itself, eagerly, and hands Keras a one-element list holding it: the step trains on it as
it would have, and no batch of the user's pipeline is drawn that training doesn't use. The global batch is the
replicas' parts of that element, concatenated in replica order (MirroredStrategy splits a batch into contiguous
parts). The one-device step is the model class' own ``train_step``, called eagerly outside the strategy's scope
with every distkeras hook off: Keras' TensorFlow optimizer then updates each mirrored variable as one variable.
"""

import contextlib
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


def plain_variables(model):
    """A context manager: for the block, every variable of the model's training state holds its value in a new
    plain ``tf.Variable``, made as Keras makes one on one device (the ``trainable`` flag Keras has now, no strategy);
    then its distributed storage again, unchanged. So the one-device step shares nothing distkeras made with the
    distributed one: a flaw of the mirrored storage itself (a ``trainable`` flag baked in at ``distribute()``, which
    the tape then follows) shows as a difference instead of happening on both sides.

    Private Keras and TensorFlow API: a TensorFlow Keras variable's storage is its ``_value``, and
    ``_initialize(value)`` makes a ``tf.Variable`` of a value (or takes a ``tf.Variable`` as it is), as the adapter
    mirrors variables; Keras' optimizers key slots by the storage's ``_unique_id``, which the copy takes over, and
    update through their ``_distribution_strategy``, the default one for the block.
    Pinned by ``tests/backends/test_verify_catches.py`` (defect 1 reverted is caught).
    """
    import tensorflow as tf

    from .. import keras_model

    @contextlib.contextmanager
    def plain():
        saved, strategies = [], []
        try:
            # Keras' TensorFlow optimizer updates through the strategy it was made (or adopted) under, which
            # takes only distributed variables: one device's is the default strategy.
            for optimizer in keras_model.all_optimizers(model):
                if hasattr(optimizer, "_distribution_strategy"):
                    strategies.append((optimizer, optimizer._distribution_strategy))
                    optimizer._distribution_strategy = tf.distribute.get_strategy()
            for _, _, variable in verifying.named_variables(model):
                storage = getattr(variable, "_value", None)
                if not isinstance(storage, tf.Variable) or not hasattr(variable, "_initialize"):
                    continue
                saved.append((variable, storage))
                variable._initialize(tf.identity(storage.read_value()))
                # Keras' TensorFlow optimizers find a variable's slots by its storage's ``_unique_id``
                # (``_var_key``): the copy answers to the distributed storage's.
                variable._value._unique_id = storage._unique_id
            yield
        finally:
            for variable, storage in saved:
                variable._initialize(storage)
            for optimizer, strategy in strategies:
                optimizer._distribution_strategy = strategy

    return plain


def _local_logs(model):
    """Whether Keras' own train_step returns each replica's averaged results here (``batch_logs="local"``)."""
    from .. import keras_model

    keras = keras_model.keras_module(model)
    return (getattr(type(model), "train_step", None) is getattr(keras.Model, "train_step", None)
            and not keras_model.is_hooked(model, "train_step"))


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
                model, check, verifying.numpy, lambda: function([element]), lambda: type(model).train_step(model, batch),
                storage=plain_variables(model), compare_logs=not _local_logs(model))

        return train_function

    return wrapping
