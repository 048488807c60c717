"""MXNet (keras-mxnet 2.2.4.3, Keras 2): the native recipe (the model's context list), make_parallel as a
Keras 2 split/concatenate graph, Keras 2 feeding and timing, microbenchmarks.

keras-mxnet binds one MXNet module over the model's contexts: it splits every batch along the first
axis, runs one executor per context and adds the contexts' gradients in a KVStore ('device' unless the
model says otherwise). That is its data parallelism, and variant c:

- On GPUs: ``model.compile(..., context=["gpu(0)", ..., "gpu(N-1)"])``, as keras-mxnet documents it.
- On CPU contexts the same spelling can't be written: keras-mxnet turns every ``"cpu..."`` string into
  ``mx.cpu()`` (``["cpu(0)", "cpu(1)"]`` is cpu(0) twice). c then sets the model's context list to
  ``[mx.cpu(0), ..., mx.cpu(N-1)]`` before compiling, as ``compile(context=...)`` does for GPU ids.

keras-mxnet sums the contexts' mean-loss gradients, so its step on N contexts moves the weights N times
as far as one context (tests/mxnet/test_distribute.py); distkeras weighs them. For throughput that
makes no difference: the same work runs either way.

``keras.utils.multi_gpu_model`` in keras-mxnet is not the TensorFlow graph: it calls
``model.set_mxnet_context(gpus)`` and returns the same model, i.e. it *is* variant c. Variant d is
therefore the recipe as a keras-mxnet user would have copied it from the Keras 2 tutorials: Lambda
layers cut each batch into N slices, the template model runs on each slice, the outputs are
concatenated, one loss. Keras 2 on MXNet has no device scope for layers (``keras.backend.Context``
only picks the contexts of models made inside it), so the whole graph, every replica included, is one
MXNet executor on the model's one context, the first device.

The harness is written for Keras 3. This module brings the Keras 2 parts: :func:`fit_variant` (a
``keras.utils.Sequence`` through ``fit_generator``, and a clock that waits for MXNet's asynchronous
engine at the window's marks) and :func:`set_random_seed`.
"""

import random
import statistics
import time

import keras
import mxnet as mx
import numpy as np

from ..variants import Variant


def contexts(count):
    """The first ``count`` contexts, as distkeras picks them: the GPUs MXNet sees, else ``cpu(0..count-1)``."""
    gpus = mx.context.num_gpus()
    if gpus:
        if gpus < count:
            raise RuntimeError("asked for {} devices; MXNet sees {} GPU(s)".format(count, gpus))
        return [mx.gpu(i) for i in range(count)]
    return [mx.cpu(i) for i in range(count)]


def set_random_seed(seed):
    """Seed Python, NumPy and MXNet (Keras 2 has no ``keras.utils.set_random_seed``)."""
    random.seed(seed)
    np.random.seed(seed)
    mx.random.seed(seed)


def prepare(devices, options):
    if options.get("split_gpu_mb"):
        raise RuntimeError("--split-gpu splits a GPU into TensorFlow logical GPUs; MXNet has no such thing")


class _Batches(keras.utils.Sequence):
    """``steps`` batches cycled from ``pool``: Keras 2's counterpart of the harness' ``PyDataset``."""

    def __init__(self, pool, steps):
        self.pool, self.steps = pool, steps

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        return self.pool[index % len(self.pool)]


class _StepClock(keras.callbacks.Callback):
    """The end of the first and of the last step. MXNet's engine runs a step's update after
    ``train_on_batch`` returns (only the loss is read back), so at those two marks it waits for every
    pushed operation: the window then holds finished compute, and only the two marks stall the engine."""

    def __init__(self, steps):
        super().__init__()
        self.marks = (0, steps - 1)
        self.done = []

    def on_batch_end(self, batch, logs=None):
        if batch in self.marks:
            mx.nd.waitall()
            self.done.append(time.perf_counter())


def fit_variant(key, model, devices, global_batch, marks):
    """The harness' ``fit_variant`` for Keras 2: one ``fit_generator`` epoch of ``steps`` batches per
    window, fed in this thread (``workers=0``, as a Keras 3 ``PyDataset`` is by default)."""

    def train(pool, steps):
        clock = _StepClock(steps)
        model.fit_generator(_Batches(pool, steps), steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0,
                            callbacks=[clock], workers=0)
        return clock.done[-1] - clock.done[0]

    return Variant(key, devices, global_batch, train, marks, model)


def native(workload, devices):
    """c: keras-mxnet's own data parallelism, the model compiled over N contexts (module docstring).

    The workload's builder compiles on one context; that binds nothing yet (keras-mxnet binds the
    module at the first step), so compiling again over N contexts is what a user's one compile does.
    """
    marks = {"setup": time.perf_counter()}
    model = workload.build(keras)
    chosen = contexts(devices)
    options = dict(optimizer=model.optimizer, loss=model.loss, metrics=model.metrics)
    if chosen[0].device_type == "gpu":
        model.compile(context=["gpu({})".format(c.device_id) for c in chosen], **options)
    else:
        model._context = chosen  # what compile(context=["gpu(i)", ...]) sets, for CPU contexts
        model.compile(**options)
    return fit_variant("native", model, devices, workload.per_device_batch * devices, marks)


def make_parallel(workload, devices):
    """d: the Keras 2 split/concatenate recipe; every replica runs on the first context (module docstring).

    MXNet symbols have static shapes, so the slices are cut at fixed rows (``K.shape`` is not a tensor on
    keras-mxnet, and the TensorFlow recipe's dynamic slice can't be written): the model takes exactly
    ``devices`` × the per-device batch, which is what the harness feeds it.
    """
    marks = {"setup": time.perf_counter()}
    template = workload.build(keras)
    size, shape = workload.per_device_batch, template.input_shape[1:]
    inputs = keras.layers.Input(shape=shape)
    outputs = []
    for i in range(devices):
        part = keras.layers.Lambda(_rows, output_shape=shape, arguments={"start": i * size, "stop": (i + 1) * size},
                                   name="slice_{}".format(i))(inputs)
        outputs.append(template(part))
    model = keras.models.Model(inputs, keras.layers.concatenate(outputs, axis=0), name="make_parallel")
    model.compile(optimizer=template.optimizer, loss=workload.loss)
    return fit_variant("make_parallel", model, devices, size * devices, marks)


def _rows(x, start, stop):
    return x[start:stop]


def copy_bandwidth(nbytes, repeats=5):
    """Bytes per second of copying ``nbytes`` from context 0 into a new array on context 1."""
    first, second = contexts(2)
    x = mx.nd.ones((max(1, nbytes // 4),), ctx=first)
    x.wait_to_read()
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        x.copyto(second).wait_to_read()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:])


def allreduce_seconds(shapes, devices, repeats=5, kvstore="device"):
    """Seconds per all-reduce of one array per shape on each context, through a KVStore as the module's
    update does it (the adapter's default, 'device'): push every context's array (summed in the
    store), then pull the sum back to every context."""
    chosen = contexts(devices)
    store = mx.kv.create(kvstore)
    keys = list(range(len(shapes)))
    values = [[mx.nd.ones(shape, ctx=c) for c in chosen] for shape in shapes]
    store.init(keys, [v[0] for v in values])
    mx.nd.waitall()
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        store.push(keys, values)
        store.pull(keys, out=values)
        mx.nd.waitall()
        times.append(time.perf_counter() - started)
    return times[1:]


def describe_devices(devices):
    """What the devices are, for the results."""
    return {"names": [str(c) for c in contexts(devices)], "gpus": mx.context.num_gpus()}
