"""The global batches of a job across workers: what every worker reads so that each step's rows, split over the
workers, are one global batch, as on one device.

A ``keras.utils.PyDataset`` read as a batched tf.data dataset, each item one global batch
(:func:`py_datasets_as_global_batches`); arrays shuffled alike by every worker, under rank 0's seed
(:func:`same_shuffle_on_every_worker`); and the sum of a vector over the workers that carries rank 0's values to the
others (:func:`sum_over_workers`, the data check's collective too).
"""

import functools
import inspect
import logging
import random
import threading
import weakref

from .. import keras_model, policies

#: Strategy -> its traced sum over the workers (each worker's vector once).
_worker_sums = weakref.WeakKeyDictionary()
#: The global seed a multi-worker fit() call builds Keras' shuffle of arrays under (``value``; None outside one).
_shuffle_seed = threading.local()
#: Where Keras builds the tf.data pipeline of arrays, shuffle included: (module, class, method), by Keras package.
_SHUFFLE_BUILDERS = {
    "keras": ("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter", "get_tf_dataset"),
    "tf_keras": ("tf_keras.src.engine.data_adapter", "TensorLikeDataAdapter", "__init__"),
}
logger = logging.getLogger("distkeras")


def py_datasets_as_global_batches(model, tf):
    """Give a ``keras.utils.PyDataset`` the meaning arrays and batched tf.data datasets have across workers.

    Every worker is given the whole data; each item is one global batch, split over the workers.
    tf.distribute does that for a dataset whose last op is ``batch(G)`` (it rebatches, then shards),
    but a PyDataset reaches it as a generator whose elements it can only deal out whole, one per
    worker. So the PyDataset is read as such a batched dataset: its items, unbatched, batched again by
    the first item's size (the last item may be shorter, as with arrays).
    """
    keras = keras_model.keras_module(model)
    for name in ("fit", "evaluate", "predict"):
        method = getattr(model, name)

        @functools.wraps(method)  # Keras' signature, which rank0_speaks_and_writes binds verbose=0 into
        def call(*args, _method=method, **kwargs):
            data = args[0] if args else kwargs.get("x")
            if isinstance(data, keras.utils.PyDataset):
                dataset = _batched_dataset(tf, data)
                args = (dataset,) + tuple(args[1:]) if args else args
                if "x" in kwargs:
                    kwargs["x"] = dataset
            return _method(*args, **kwargs)

        keras_model.hook(model, name, call)


def same_shuffle_on_every_worker(model, tf, strategy, rank):
    """fit() across workers: every worker shuffles arrays as rank 0 does.

    Every worker is given the whole arrays and takes its part of each global batch from its own tf.data pipeline
    (Keras' ``AutoShardPolicy.DATA``), so the pipelines must shuffle alike, or a step mixes two permutations and an
    epoch trains on some samples twice and skips others. Keras builds the pipeline in fit(), its permutation a
    ``tf.random.shuffle`` whose seed is fixed when the pipeline is built, from TensorFlow's global seed: each
    worker's own seed, or, unseeded, a draw from the operating system on every iterator. So at fit()'s start every
    worker takes rank 0's global seed for that build (:func:`_build_shuffles_under_held_seed`), and rank 0's Python
    and NumPy random states (:func:`~distkeras.backends.policies.sync_random_state`, with the seed; a callback takes
    them again at every epoch's start, for whatever the user's code draws from them). A seeded rank 0's shuffle is
    then the one it draws alone. Where rank 0 has no global seed, it draws one for the call from the operating
    system: every worker shuffles alike, and, as Keras' shuffle does once a seed is set, keeps the call's first
    permutation for each of its epochs. A Keras whose pipeline distkeras can't reach gets a warning instead.
    """
    from tensorflow.python.eager import context

    broadcast = policies.broadcast_by_sum(sum_over_workers(tf, strategy), rank)

    def rank0_seed():  # what rank 0 sends; the other workers' values are not used
        seed = context.global_seed()
        return random.SystemRandom().randrange(1, 2 ** 31 - 1) if seed is None else seed

    def hold(seed):
        _shuffle_seed.value = seed

    package = keras_model.keras_package(model)
    reached = _build_shuffles_under_held_seed(package)
    callback_class = keras_model.keras_module(model).callbacks.Callback
    fit = model.fit
    signature = inspect.signature(type(model).fit.__get__(model))  # Keras' own, whatever wraps it

    @functools.wraps(fit)
    def same_shuffle_fit(*args, **kwargs):
        bound = keras_model.Arguments(signature, args, kwargs)
        callbacks = policies.with_callback(bound.get("callbacks"), policies.every_epoch(callback_class, broadcast))
        if callbacks is not None:
            bound.set("callbacks", callbacks)
        if bound.get("shuffle", True) and (not reached or callbacks is None):
            logger.warning(
                "fit(shuffle=True) across workers: %s, so the workers' shuffles of arrays differ unless every worker "
                "sets the same seed (keras.utils.set_random_seed) before fit().",
                "fit() was given a CallbackList" if reached else
                "distkeras can't reach where {} {} builds its shuffle".format(package, _SHUFFLE_BUILDERS.get(package)))
        policies.sync_random_state(broadcast, (rank0_seed, hold))
        try:
            return fit(*bound.args, **bound.kwargs)
        finally:
            _shuffle_seed.value = None

    keras_model.hook(model, "fit", same_shuffle_fit)


def _build_shuffles_under_held_seed(package):
    """Have Keras build its tf.data pipeline of arrays (``package``'s builder in :data:`_SHUFFLE_BUILDERS`) under
    the global seed a multi-worker fit() call holds (``_shuffle_seed.value``), and give TensorFlow back its own
    global seed afterwards. The permutation op's seed is fixed while its function is traced, from the global seed
    then current; only the pipeline is built in the window. Private API, on purpose: no public hook reaches the
    pipeline Keras builds inside fit(), and TensorFlow's eager global seed is the context's private ``_seed``
    (with ``_rng``, its operation-seed generator, made by the first ``tf.random.set_seed``), which
    ``tf.random.set_seed`` sets (also clearing the kernel cache, not wanted here). Patched once, guarded; pinned by tests/backends/test_multiworker_shuffle.py.

    Returns:
        Whether the builder is patched.
    """
    import importlib

    from tensorflow.python.eager import context

    target = _SHUFFLE_BUILDERS.get(package)
    if target is None:
        return False
    try:
        cls = getattr(importlib.import_module(target[0]), target[1])
    except (ImportError, AttributeError):
        return False
    original = cls.__dict__.get(target[2])
    if original is None or not hasattr(context.context(), "_seed"):
        return False
    if getattr(original, "distkeras", False):
        return True

    @functools.wraps(original)
    def build(self, *args, **kwargs):
        seed = getattr(_shuffle_seed, "value", None)
        if seed is None:
            return original(self, *args, **kwargs)
        current = context.context()
        saved = current._seed, current.__dict__.get("_rng")  # no _rng before the first tf.random.set_seed
        current._seed, current._rng = seed, random.Random(seed)
        try:
            return original(self, *args, **kwargs)
        finally:
            current._seed = saved[0]
            if saved[1] is None:
                del current._rng
            else:
                current._rng = saved[1]

    build.distkeras = True
    setattr(cls, target[2], build)
    return True


def sum_over_workers(tf, strategy):
    """The sum over the workers of a 1-D float32 vector, each worker's counted once (its first replica's), through
    the strategy's collectives: the ``all_sum`` of :func:`~distkeras.backends.policies.broadcast_by_sum`."""
    total = _worker_sums.get(strategy)
    if total is None:  # traced once per strategy
        local = len(strategy.extended.worker_devices)

        def first_replica(value):
            context = tf.distribute.get_replica_context()
            first = tf.equal(tf.math.floormod(context.replica_id_in_sync_group, local), 0)
            return tf.where(first, value, tf.zeros_like(value))

        @tf.function
        def total(value):
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(first_replica, (value,)), axis=None)

        _worker_sums[strategy] = total
    return lambda vector: total(tf.constant(vector)).numpy()


def _batched_dataset(tf, py_dataset):
    first = py_dataset[0]
    batch = len(tf.nest.flatten(first)[0])

    def spec(value):
        value = tf.convert_to_tensor(value)
        return tf.TensorSpec((None,) + tuple(value.shape[1:]), value.dtype)

    signature = tf.nest.map_structure(spec, first)

    def one_epoch():  # then the dataset's own end of epoch, as Keras' PyDatasetAdapter calls it (a reshuffle)
        for index in range(len(py_dataset)):
            yield py_dataset[index]
        py_dataset.on_epoch_end()

    items = tf.data.Dataset.from_generator(one_epoch, output_signature=signature)
    # Items of equal size but the last: as many global batches as items.
    return items.unbatch().batch(batch).apply(tf.data.experimental.assert_cardinality(len(py_dataset)))
