"""TensorFlow: the native recipe (MirroredStrategy scope), make_parallel with ``tf.device``, microbenchmarks.

Imported by the worker after ``import distkeras`` (which splits the CPU into logical devices when
DISTKERAS_CPU_DEVICES is set) and before Keras builds anything.
"""

import itertools
import statistics
import time

import keras
import tensorflow as tf

from ..variants import fit_variant, split_concat

#: Collective key offsets for the strategies made here, clear of the ones distkeras gives its own.
_key_bases = itertools.count(1000000, 1000000)


def prepare(devices, options):
    """Split GPU 0 into ``devices`` logical GPUs of ``options["split_gpu_mb"]`` MiB each, when asked."""
    megabytes = options.get("split_gpu_mb")
    if not megabytes:
        return
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise RuntimeError("--split-gpu asks to split GPU 0 into logical GPUs, and TensorFlow sees no GPU")
    config = tf.config.LogicalDeviceConfiguration(memory_limit=megabytes)
    tf.config.set_logical_device_configuration(gpus[0], [config] * devices)


def device_names(count):
    """The first ``count`` logical devices: GPUs if there are any, else CPUs."""
    found = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if len(found) < count:
        raise RuntimeError("asked for {} devices; TensorFlow has {}: {}".format(
            count, len(found), ", ".join(d.name for d in found)))
    return [d.name for d in found[:count]]


def _mirrored_strategy(names):
    """``MirroredStrategy(names)``, with collective keys of its own.

    Here b's strategy (made by distkeras) and c's share one process, and two strategies numbering their
    collectives from the same base would mix up each other's all-reduces; TensorFlow's own tests offset
    the base the same way. A user's script holds one strategy and needs none of this.
    """
    cls = tf.distribute.MirroredStrategy
    saved = cls.__dict__.get("_collective_key_base", 0)
    cls._collective_key_base = next(_key_bases)
    try:
        return cls(devices=names)
    finally:
        cls._collective_key_base = saved


def native(workload, devices):
    """c: build and compile inside ``MirroredStrategy(...).scope()``, then ``fit`` — the TensorFlow recipe."""
    marks = {"setup": time.perf_counter()}
    strategy = _mirrored_strategy(device_names(devices))
    with strategy.scope():
        model = workload.build(keras)
    return fit_variant("native", model, devices, workload.per_device_batch * devices, marks)


def make_parallel(workload, devices):
    """d: the make_parallel / multi_gpu_model recipe as a Keras 3 functional model.

    The template keeps its weights on the first device. Each step the batch is cut into ``devices``
    slices; slice i is taken and run through the template under ``tf.device`` of device i, and the
    outputs are concatenated on the first device, where the one loss is computed. (The tutorials kept
    weights and the concatenation on the CPU; the first device is the more favourable choice on GPUs
    and the same one on CPU devices.)
    """
    names = device_names(devices)
    return split_concat(workload, devices, lambda replica: Replicas(replica, names), scope=lambda: tf.device(names[0]))


class Replicas(keras.layers.Layer):
    """Runs ``template`` on one slice of the batch per device; concatenates the outputs on the first."""

    def __init__(self, template, names, **kwargs):
        super().__init__(**kwargs)
        self.template = template
        self.names = names

    def call(self, x):
        count = len(self.names)
        size = tf.shape(x)[0] // count
        outputs = []
        for i, name in enumerate(self.names):
            with tf.device(name):
                part = x[i * size:(i + 1) * size] if i < count - 1 else x[i * size:]
                outputs.append(self.template(part))
        with tf.device(self.names[0]):
            return tf.concat(outputs, axis=0)


def _sync():
    tf.test.experimental.sync_devices()


def copy_bandwidth(nbytes, repeats=5):
    """Bytes per second of copying ``nbytes`` from device 0 into a new buffer on device 1.

    ``DeepCopy`` forces a real copy: between logical CPU devices ``tf.identity`` only shares the buffer.
    """
    first, second = device_names(2)
    with tf.device(first):
        x = tf.random.uniform([max(1, nbytes // 4)])
    times = []
    for _ in range(repeats + 1):
        _sync()
        started = time.perf_counter()
        with tf.device(second):
            tf.raw_ops.DeepCopy(x=x)
        _sync()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:])


def allreduce_seconds(shapes, devices, repeats=5):
    """Seconds per all-reduce (sum) of one array per shape on every replica, in a ``tf.function`` with the
    cross-device ops MirroredStrategy chooses for these devices, as in a training step."""
    strategy = _mirrored_strategy(device_names(devices))
    values = strategy.run(tf.function(lambda: [tf.ones(shape) for shape in shapes], autograph=False))

    @tf.function(autograph=False)
    def reduce(per_replica):
        return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("SUM", v), args=(per_replica,))

    times = []
    for _ in range(repeats + 1):
        _sync()
        started = time.perf_counter()
        reduce(values)
        _sync()
        times.append(time.perf_counter() - started)
    return times[1:]


def device_peak_bytes(devices):
    """Peak bytes allocated on each of the first ``devices`` GPUs; None on CPU devices."""
    names = device_names(devices)
    if "GPU" not in names[0].upper():
        return None
    return [tf.config.experimental.get_memory_info(name)["peak"] for name in names]


def describe_devices(devices):
    """What the devices are, for the results."""
    details = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details.append(tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name))
    return {"names": device_names(devices), "physical_gpus": details}

