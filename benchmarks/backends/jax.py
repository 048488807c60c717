"""JAX: the native recipe (``keras.distribution.DataParallel``), make_parallel by hand, microbenchmarks.

make_parallel on JAX can't be the TensorFlow graph with ``tf.device`` around each replica: Keras
compiles a step into one XLA program, and a device scope inside it places nothing
(``jax.default_device`` only decides where new arrays go outside a compiled function). A Keras 3
functional split/concatenate model would run whole on one device. So variant d is written as the
recipe's data flow, with Keras' stateless API and one compiled function per device:

    weights and optimizer state on the first device
    per step: copy the weights to every device; device i runs the forward pass of slice i
    the outputs are copied to the first device and concatenated; one loss and its gradient there
    each slice of the output gradient goes back to its device, which runs the backward pass
    the parameter gradients are copied to the first device, summed, and the optimizer applies them

JAX dispatches asynchronously, so the devices compute their slices at the same time, as the replicas
of the TensorFlow graph do.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..variants import Variant, fit_variant


def device_list(count):
    """The first ``count`` devices of JAX's default platform."""
    found = jax.devices()
    if len(found) < count:
        raise RuntimeError("asked for {} devices; JAX has {}: {}".format(count, len(found), found))
    return found[:count]


def native(workload, devices):
    """c: ``keras.distribution.DataParallel`` over the devices, set by hand: the model is built, compiled
    and trained inside ``distribution.scope()`` (``set_distribution`` would make it global, and the
    other variants of this process must not train under it)."""
    marks = {"setup": time.perf_counter()}
    distribution = keras.distribution.DataParallel(devices=device_list(devices))
    with distribution.scope():
        model = workload.build(keras)
    return fit_variant("native", model, devices, workload.per_device_batch * devices, marks, scope=distribution.scope)


def make_parallel(workload, devices):
    """d: the make_parallel data flow (module docstring), one replica per device, weights on the first."""
    marks = {"setup": time.perf_counter()}
    trainer = _SplitConcatTrainer(workload, device_list(devices))
    return Variant("make_parallel", devices, workload.per_device_batch * devices, trainer.train, marks)


class _SplitConcatTrainer:
    def __init__(self, workload, devices):
        self.devices = devices
        self.model = model = workload.build(keras)
        self.optimizer = optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.get(workload.loss)

        def forward(trainable, non_trainable, x):
            def run(weights):
                return model.stateless_call(weights, non_trainable, x, training=True)

            return jax.vjp(run, trainable, has_aux=True)  # (outputs, pullback, updated non-trainables)

        def loss_and_output_gradients(outputs, y):
            sizes = np.cumsum([len(o) for o in outputs])[:-1]
            merged = jnp.concatenate(outputs)
            loss, gradient = jax.value_and_grad(lambda m: jnp.mean(loss_fn(y, m)))(merged)
            return loss, jnp.split(gradient, sizes)

        def apply(optimizer_state, gradients, trainable):
            total = [sum(parts) for parts in zip(*gradients)]
            return optimizer.stateless_apply(optimizer_state, total, trainable)

        self.forward = jax.jit(forward)
        self.backward = jax.jit(lambda pullback, cotangent: pullback(cotangent)[0])
        self.loss_and_output_gradients = jax.jit(loss_and_output_gradients)
        self.apply = jax.jit(apply)

    def step(self, x, y):
        first = self.devices[0]
        model, optimizer = self.model, self.optimizer
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        bounds = np.linspace(0, len(x), len(self.devices) + 1).astype(int)
        outputs, pullbacks = [], []
        for i, device in enumerate(self.devices):
            weights, state = jax.device_put((trainable, non_trainable), device)
            out, pullback, updated = self.forward(weights, state, jax.device_put(x[bounds[i]:bounds[i + 1]], device))
            outputs.append(jax.device_put(out, first))
            pullbacks.append(pullback)
            if i == 0:
                new_non_trainable = updated  # the first replica's (dropout seeds, normalisation statistics)
        _, cotangents = self.loss_and_output_gradients(outputs, jax.device_put(y, first))
        gradients = [jax.device_put(self.backward(pullback, jax.device_put(cotangent, device)), first)
                     for pullback, cotangent, device in zip(pullbacks, cotangents, self.devices)]
        new_trainable, new_optimizer_state = self.apply([v.value for v in optimizer.variables], gradients, trainable)
        # The state lives in the Keras variables, as after fit(): one copy of it, not two.
        for variables, values in ((model.trainable_variables, new_trainable),
                                  (model.non_trainable_variables, new_non_trainable),
                                  (optimizer.variables, new_optimizer_state)):
            for variable, value in zip(variables, values):
                variable.assign(value)

    def train(self, pool, steps):
        """Seconds from the end of the first step to the end of the last, as the Variant contract asks."""
        ends = []
        for index in range(steps):
            self.step(*pool[index % len(pool)])
            if index in (0, steps - 1):
                jax.block_until_ready([v.value for v in self.model.trainable_variables])
                ends.append(time.perf_counter())
        return ends[-1] - ends[0]


def copy_bandwidth(nbytes, repeats=5):
    """Bytes per second of ``jax.device_put`` of ``nbytes`` from device 0 to device 1."""
    first, second = device_list(2)
    x = jax.device_put(np.ones(max(1, nbytes // 4), np.float32), first)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        jax.device_put(x, second).block_until_ready()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:])


def allreduce_seconds(shapes, devices, repeats=5):
    """Seconds per all-reduce (sum) of one array per shape on each device: a compiled sum over a mesh axis
    with a replicated result, which XLA lowers to the all-reduce a DataParallel step uses."""
    mesh = Mesh(np.array(device_list(devices)), ("batch",))
    split = NamedSharding(mesh, PartitionSpec("batch"))
    arrays = [jax.device_put(np.ones((devices,) + tuple(shape), np.float32), split) for shape in shapes]
    reduce = jax.jit(lambda xs: [x.sum(axis=0) for x in xs], out_shardings=NamedSharding(mesh, PartitionSpec()))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        jax.block_until_ready(reduce(arrays))
        times.append(time.perf_counter() - started)
    return times[1:]


def device_peak_bytes(devices):
    """Peak bytes in use on each of the first ``devices`` devices; None where JAX keeps no statistics (CPU)."""
    stats = [device.memory_stats() for device in device_list(devices)]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return [s["peak_bytes_in_use"] for s in stats]


def describe_devices(devices):
    """What the devices are, for the results."""
    return {"names": [str(d) for d in device_list(devices)], "kind": device_list(1)[0].device_kind}
