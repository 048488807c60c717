"""The data check on TensorFlow workers (:mod:`distkeras.verify.datacheck`): each worker's global batch, in its pipeline.

Across workers Keras hands ``strategy.experimental_distribute_dataset`` the whole pipeline of global batches
(``data_adapter.get_tf_dataset()``), and each worker keeps its part of every batch (``AutoShardPolicy.DATA``):
the global batch exists only inside the worker's tf.data pipeline, before the rebatch and the shard. So the
pipeline is given one more step, after the user's own (``enumerate`` and a ``map`` that returns the element as
it was): on the first element of every pass, it writes the fingerprint of each part (``tf.fingerprint`` of its
rows, then of those and its shape) and its rows into a variable on the worker's CPU. After the pass' first step,
the check reads that variable (and clears it) and every worker compares it with the others'.

What it costs is kept to the pass' first element: the fingerprints and their ``tf.cond`` live in one
``tf.function`` per process (:func:`_digests`), traced once per element structure and reused by every later
``fit()``/``evaluate()`` (Keras makes a new pipeline for each, so a step traced inside the ``map`` was traced
anew each time: 200 ms a ``fit()`` in a job of two workers); the ``cond`` is stateless, and the write is one
``scatter_nd_update`` outside it that writes no index on the other elements. Each new iterator of the pipeline
(each pass) still takes about 30 ms of CPU more to make than without the step (``docs/benchmarks-appendix.md``).
The step writes a variable, a stateful op, after which tf.data prefetches nothing by itself: the watched pipeline
ends with ``prefetch(AUTOTUNE)``, as Keras' own do (without it each training step waited for its element).
"""

from ...verify import datacheck


def wrapper(tf):
    """``wrap_adapter(data_adapter, epoch_iterator)`` for :class:`~distkeras.verify.datacheck.Watch`: the adapter's
    ``get_tf_dataset`` (an instance attribute) returns the pipeline with the fingerprinting step."""

    def wrap_adapter(adapter, iterator):
        original = adapter.get_tf_dataset

        def get_tf_dataset():
            dataset = original()
            if isinstance(dataset, tf.distribute.DistributedDataset):
                return dataset
            watched, slot, names = watched_dataset(tf, dataset)
            iterator.__dict__["_distkeras_slot"] = (slot, names, adapter)
            return watched

        adapter.get_tf_dataset = get_tf_dataset

    return wrap_adapter


def read(iterator):
    """``(parts, batches)`` of the first batch the pipeline of ``iterator`` wrote since the last read, or
    None; the variable is cleared."""
    held = iterator.__dict__.get("_distkeras_slot")
    if held is None:
        return None
    slot, names, adapter = held
    values = [int(v) for v in slot.numpy()]
    if not values[0]:
        return None
    slot.assign(tf_zeros_like(slot))
    parts = [datacheck.Part(name, dtype, values[1 + 2 * i] & (2 ** 64 - 1), values[2 + 2 * i])
             for i, (name, dtype) in enumerate(names)]
    return parts, adapter.num_batches


def tf_zeros_like(slot):
    import tensorflow as tf

    return tf.zeros_like(slot)


def watched_dataset(tf, dataset):
    """``dataset`` with the fingerprinting step, the variable it writes (a marker, then a digest and the rows of
    each part) and the parts' ``(name, dtype)``."""
    spec = dataset.element_spec
    flat = tf.nest.flatten(spec, expand_composites=True)
    paths = [path for path, _ in _paths(spec)]
    names = [(datacheck.part_name(path), s.dtype.name) for path, s in zip(paths, flat)]
    if len(paths) != len(flat):  # composites (ragged, sparse) expand into several tensors: number them
        names = [("x[{}]".format(i), s.dtype.name) for i, s in enumerate(flat)]
    with tf.init_scope(), tf.device("/cpu:0"):
        slot = tf.Variable(tf.zeros([1 + 2 * len(flat)], tf.int64), trainable=False, name="distkeras_data_check")
    digests = _digests(tf)
    size = 1 + 2 * len(flat)

    def watch(index, element):
        values = digests(index, tf.nest.flatten(element, expand_composites=True))
        # all of the slot on the pass' first element, no index of it on the others (values are zeros then)
        count = tf.where(tf.equal(index, 0), size, 0)
        written = slot.scatter_nd_update(tf.reshape(tf.range(count, dtype=tf.int64), [-1, 1]), values[:count])
        with tf.control_dependencies([written]):
            return tf.nest.map_structure(tf.identity, element)

    watched = dataset.enumerate().map(watch).prefetch(tf.data.AUTOTUNE)
    return watched, slot, names


_traced = {}


def _digests(tf):
    """The process' ``tf.function`` of ``(index, leaves)``: on index 0, a marker then each leaf's fingerprint and
    rows (int64); zeros on the others. Traced once per structure of leaves, whichever pipeline calls it."""
    function = _traced.get("digests")
    if function is not None:
        return function

    def digest(tensor):
        if tensor.dtype == tf.bool:
            tensor = tf.cast(tensor, tf.uint8)
        shape = tf.shape(tensor, out_type=tf.int64)
        rows = tf.reshape(tensor, [1, -1]) if tensor.shape.rank == 0 else tf.reshape(tensor, [shape[0], -1])
        rows = tf.reshape(tf.fingerprint(rows), [-1])
        whole = tf.concat([rows, tf.reshape(tf.bitcast(shape, tf.uint8), [-1])], 0)
        value = tf.bitcast(tf.reshape(tf.fingerprint(tf.reshape(whole, [1, -1])), [8]), tf.int64)
        count = tf.constant(1, tf.int64) if tensor.shape.rank == 0 else shape[0]
        return tf.stack([value, count])

    @tf.function(autograph=False)
    def digests(index, leaves):
        size = 1 + 2 * len(leaves)
        return tf.cond(tf.equal(index, 0),
                       lambda: tf.concat([tf.ones([1], tf.int64)] + [digest(leaf) for leaf in leaves], 0),
                       lambda: tf.zeros([size], tf.int64))

    _traced["digests"] = digests
    return digests


def _paths(spec):
    import keras

    return keras.tree.flatten_with_path(spec)
