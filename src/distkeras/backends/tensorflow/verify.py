"""TensorFlow's primitives of the one-device check (:mod:`distkeras.verify`).

Keras' TensorFlow step function takes an iterator, or a Python iterable of batches, which it runs one step each
(``keras/src/backend/tensorflow/trainer.py``, ``_make_function``). The checked step takes the first element of
the distributed iterator itself, eagerly, and hands Keras a one-element distributed iterator holding it, of the
element spec the user's iterator has (:func:`one_element_iterator`): the step trains on it as it would have, traced
as the user's iterator traces it, and no batch of the user's pipeline is drawn that training doesn't use. The global batch is the
replicas' parts of that element, concatenated in replica order (MirroredStrategy splits a batch into contiguous
parts). The one-device step is the model class' own ``train_step``, called eagerly outside the strategy's scope
with every distkeras hook off: Keras' TensorFlow optimizer then updates each mirrored variable as one variable.
"""

import contextlib
import itertools

from .. import verifying


def global_batch(strategy, element, across_workers=False):
    """The whole global batch of a distributed dataset's ``element``: every replica's part, concatenated.

    ``across_workers``: this worker holds its own replicas' parts only (``MultiWorkerMirroredStrategy``); each
    replica all-gathers its part through the strategy's collectives (every worker runs it at the same step, as
    every worker runs the checked step), which concatenates every replica's in replica order, worker by worker."""
    import tensorflow as tf

    if across_workers:
        leaves = tf.nest.flatten(element)
        batched = [bool(strategy.experimental_local_results(leaf)[0].shape.rank) for leaf in leaves]

        @tf.function(autograph=False)
        def gather(*values):
            # Traced: the strategy's eager collectives warn of their overhead and retrace per tensor.
            return [strategy.gather(value, axis=0) for value in values]

        gathered = iter(gather(*[leaf for leaf, rows in zip(leaves, batched) if rows]))
        return tf.nest.pack_sequence_as(element, [
            next(gathered) if rows else strategy.experimental_local_results(leaf)[0]
            for leaf, rows in zip(leaves, batched)])

    def whole(value):
        parts = strategy.experimental_local_results(value)
        if len(parts) == 1:
            return parts[0]
        if not getattr(parts[0], "shape", None) or parts[0].shape.rank == 0:
            return parts[0]
        return tf.concat(list(parts), axis=0)

    return tf.nest.map_structure(whole, element)


def one_element_iterator(strategy, iterator, element):
    """A distributed iterator of one element, ``element`` (the one ``next(iterator)`` returned), whose element spec
    is ``iterator``'s: each replica's part as it was, its static shape relaxed to the spec's (a batch dimension
    of None, as the user's pipeline has it).

    Keras' TensorFlow step function traces the step for the shapes it is handed. A list of the eager element
    traces it for the concrete batch: ``tree.flatten(y_pred)[0].shape[0]`` is then a number, where the user's
    iterator traces None, and Keras' per-output loss trackers (``CompileLoss``) weigh the checked step by its
    rows and every other step by 1: the epoch's ``box_loss`` is not the one fit() logs with the check off. A
    one-element iterator of the same spec runs the step as fit() runs every other one. None where the element
    and the spec don't line up (no replica parts): the caller hands Keras a list then.
    """
    import tensorflow as tf

    # This worker's replicas (every replica of the job on one host; a worker's own under MultiWorkerMirrored).
    replicas = len(strategy.experimental_local_results(tf.nest.flatten(element)[0]))
    spec = getattr(iterator, "element_spec", None)
    if spec is None or (replicas < 2 and strategy.num_replicas_in_sync < 2):
        return None
    try:
        tf.nest.assert_same_structure(element, spec)
        parts = [tf.nest.map_structure(lambda value, r=r: strategy.experimental_local_results(value)[r], element)
                 for r in range(replicas)]
        # A PerReplicaSpec's components are its replicas' TensorSpecs, in replica order.
        specs = [tf.nest.map_structure(lambda leaf, r=r: tf.nest.flatten(leaf, expand_composites=True)[r], spec)
                 for r in range(replicas)]
        fits = [tf.nest.map_structure(lambda value, leaf: leaf.is_compatible_with(value), part, leaf_specs)
                for part, leaf_specs in zip(parts, specs)]
    except (TypeError, ValueError, IndexError):
        return None
    if not all(all(tf.nest.flatten(ok)) for ok in fits):
        return None

    def replica_dataset(part, leaf_specs):
        def build(_):
            # The part as constants of the dataset's graph, each of the spec's shape (PlaceholderWithDefault is
            # TensorFlow's op for a value of a less specific static shape than its input's).
            return tf.nest.map_structure(
                lambda value, leaf: tf.raw_ops.PlaceholderWithDefault(input=value, shape=leaf.shape), part, leaf_specs)

        return tf.data.Dataset.range(1).map(build)

    def dataset_fn(_context):
        # One worker: its replicas dequeue one element each, in replica order.
        dataset = replica_dataset(parts[0], specs[0])
        for part, leaf_specs in zip(parts[1:], specs[1:]):
            dataset = dataset.concatenate(replica_dataset(part, leaf_specs))
        return dataset

    return iter(strategy.distribute_datasets_from_function(dataset_fn))


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


def held_state(strategy):
    """``(snapshot, restore)`` for :func:`verifying.checked_in_place`: every variable's storage part by part, as
    the strategy holds it (``experimental_local_results``: a mirrored variable's copies, a sync-on-read metric
    variable's per-replica totals). Assigning a sync-on-read SUM variable its summed value splits the value evenly
    over the replicas, which rounds every later sum differently from the run without the check."""
    import numpy as np

    def parts(variable):
        return strategy.experimental_local_results(getattr(variable, "_value", variable))

    def snapshot(named):
        return [[np.array(part.numpy()) for part in parts(variable)] for _, _, variable in named]

    def restore(named, held):
        for (_, _, variable), values in zip(named, held):
            for part, value in zip(parts(variable), values):
                part.assign(value)

    return snapshot, restore


def _local_logs(model):
    """Whether Keras' own train_step returns each replica's averaged results here (``batch_logs="local"``)."""
    from .. import keras_model

    keras = keras_model.keras_module(model)
    return (getattr(type(model), "train_step", None) is getattr(keras.Model, "train_step", None)
            and not keras_model.is_hooked(model, "train_step"))


def wrap(model, check, across_workers=False):
    """``wrap(train_function)`` for :func:`verifying.install`; ``across_workers``: the replicas are of several
    workers (every worker gathers the global batch and replays the step on it: every worker judges alike)."""

    def wrapping(function):
        def train_function(iterator):
            if not check.due:
                return function(iterator)
            iterator = iterator if hasattr(iterator, "get_next") else iter(iterator)
            element = next(iterator)  # StopIteration ends the epoch, as Keras' own function raises it
            strategy = model.distribute_strategy
            batch = global_batch(strategy, element, across_workers)

            if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
                check.skip("steps_per_execution > 1 runs several steps at once; the check compares one step")
                return function(itertools.chain([element], iterator))
            single = one_element_iterator(strategy, iterator, element)
            single = single if single is not None else [element]
            return verifying.checked_in_place(
                model, check, verifying.numpy, lambda: function(single), lambda: type(model).train_step(model, batch),
                storage=plain_variables(model), compare_logs=not _local_logs(model), exact=held_state(strategy),
                rows=verifying.rows_of(batch))

        return train_function

    return wrapping


def wrap_pipeline(model, check):
    """``wrap(train_function)`` for :func:`verifying.install` on a model cut into pipeline stages (one process, no
    strategy: :mod:`.pipeline`). The stages' step runs on the first batch (handed to Keras' step function as a
    one-element list, which its Python loop takes as it takes the epoch's iterator: the stages' step is traced per
    batch shape either way), then the model class' own ``train_step`` on the same batch from the same state,
    eagerly with every distkeras hook off: one device's program over the whole model, each variable read where
    its stage keeps it (TensorFlow copies it to the op). The variables are plain ``tf.Variable``s: nothing to swap."""

    def wrapping(function):
        def train_function(iterator):
            if not check.due:
                return function(iterator)
            if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
                check.skip("steps_per_execution > 1 runs several steps at once; the check compares one step")
                return function(iterator)
            element = next(iter(iterator))  # StopIteration ends the epoch, as Keras' own function raises it
            return verifying.checked_in_place(
                model, check, verifying.numpy, lambda: function([element]),
                lambda: type(model).train_step(model, element), rows=verifying.rows_of(element))

        return train_function

    return wrapping

