"""PyTorch: one process per device; the native recipe (DDP and a torch loop), make_parallel, microbenchmarks.

distkeras runs PyTorch as one process per device, so on N > 1 devices the worker is started N times by
``distkeras launch`` (``benchmarks.run`` does it) and joins the job's ``torch.distributed`` group in
:func:`prepare`, before any variant is set up. The variants then run in lockstep on every rank:

- b and c are collective: every rank trains its share of each global batch.
- a (one device) and d (one process, the batch cut into N slices) run on rank 0 alone; the other ranks
  wait for it at a barrier (:func:`setup_variant`), so no rank's work overlaps another variant's windows.

Only rank 0 reports. c is the recipe of the Keras guide to multi-GPU training with PyTorch: the Keras
model wrapped in ``torch.nn.parallel.DistributedDataParallel`` (gradients all-reduced in buckets while the
backward pass runs), a ``torch.optim`` optimizer with the compiled one's settings, the compiled loss
function, and a plain loop over this rank's slice of every global batch.

d can be written only on one device here. The tutorials' recipe needs the template's replicas on N GPUs
of one process (``torch.nn.DataParallel``); Keras 3 layers read their weights from their own variables,
not from the copies ``DataParallel`` makes, so a Keras model can't be replicated that way. On the CPU
(one torch device) d is the recipe's graph in one process: slice the batch, run the template on each
slice, concatenate, one loss. On GPUs it is reported as not run.
"""

import os
import statistics
import time

import keras
import torch
import torch.distributed as dist

from ..variants import Variant, split_concat

#: Variants one process runs alone while the other ranks wait.
RANK0_ONLY = ("plain", "make_parallel")

MISSING = {}
#: torch's threads when the worker started: one process' default, all the cores.
_ALL_THREADS = [1]


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _local_rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


def _on_gpu():
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _device():
    return torch.device("cuda", _local_rank()) if _on_gpu() else torch.device("cpu")


def _sync():
    if _on_gpu():
        torch.cuda.synchronize()


def prepare(devices, options):
    """Join the job's process group when launched as one of several processes (distkeras' own rendezvous,
    so that ``distkeras.distribute`` in b finds the group made)."""
    if options.get("split_gpu_mb"):
        raise RuntimeError("--split-gpu is TensorFlow's: PyTorch runs one process per GPU")
    _ALL_THREADS[:] = [torch.get_num_threads()]
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    from distkeras import cluster as clusters
    from distkeras.backends.torch import adapter
    from distkeras.devices import Device

    found = clusters.from_env()
    device = Device("gpu" if _on_gpu() else "cpu", found.local_rank)
    if device.kind == "gpu":
        torch.cuda.set_device(device.index)
    adapter._join(found, device, adapter._backend(None, device), adapter.DEFAULT_TIMEOUT)


def reports():
    """Whether this process writes the results (rank 0)."""
    return _rank() == 0


_SOLO_CALLS = [0]


def _store():
    from distkeras.backends.torch import adapter

    return adapter._store


#: Threads each variant trains with, by key: set before each of its windows (see :func:`setup_variant`).
THREADS = {}


def setup_variant(key, workload, devices, build):
    """Set up variant ``key`` with ``build()``. In a job, a and d run on rank 0 while the others wait, and
    every variant trains with its own number of threads: a and d, one process, with all the cores (torch's
    default); b with what distkeras chose (each of the N processes its share of the cores); c with the same
    share, as a careful hand-written job (torchrun sets OMP_NUM_THREADS=1 for the same reason)."""
    if _world() == 1:
        return build()
    torch.set_num_threads(_ALL_THREADS[0])
    # Every rank builds it (untrained off rank 0): Keras names layers by how many it has made, and DDP in c
    # needs the same parameter names, so the same models, on every rank.
    variant = build()
    threads = THREADS[key] = torch.get_num_threads()
    train = variant.train
    solo = key in RANK0_ONLY

    def train_with_threads(pool, steps):
        torch.set_num_threads(threads)
        if not solo:
            return train(pool, steps)
        _SOLO_CALLS[0] += 1
        done = "bench-solo-{}".format(_SOLO_CALLS[0])
        if _rank() != 0:
            # Wait on the rendezvous store's socket, asleep: a gloo barrier polls, and its waiting ranks would
            # take cores from rank 0's one-process run.
            _store().wait([done])
            return float("nan")  # not a figure: only rank 0 reports
        seconds = train(pool, steps)
        _store().set(done, "1")
        return seconds

    variant.train = train_with_threads
    return variant


def native(workload, devices):
    """c: the Keras model in ``DistributedDataParallel``, a ``torch.optim`` optimizer, a hand-written loop."""
    if _world() != devices:
        raise NotImplementedError("the hand-written loop runs in a job of {} processes; this is {} of {}".format(
            devices, _rank(), _world()))
    marks = {"setup": time.perf_counter()}
    device = _device()
    if device.type == "cpu":
        from distkeras.backends.torch import adapter

        adapter.share_cpu_threads(torch, _world())  # the share distkeras gives b
    with keras.device("cuda:{}".format(device.index) if device.type == "cuda" else "cpu"):
        model = workload.build(keras)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch_optimizer(model.optimizer, model.parameters())
    loss_fn = keras.losses.get(workload.loss)
    rank, world = _rank(), _world()
    share = workload.per_device_batch

    def step(x, y):
        x = torch.as_tensor(x[rank * share:(rank + 1) * share]).to(device)
        y = torch.as_tensor(y[rank * share:(rank + 1) * share]).to(device)
        loss = torch.mean(loss_fn(y, ddp(x, training=True)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def train(pool, steps):
        ends = []
        for index in range(steps):
            step(*pool[index % len(pool)])
            if index in (0, steps - 1):
                _sync()
                ends.append(time.perf_counter())
        return ends[-1] - ends[0]

    variant = Variant("native", world, share * world, train, marks, model)
    variant.ddp = ddp  # for benchmarks.torch_gap, which times this loop under ddp.no_sync() too
    return variant


def torch_optimizer(optimizer, parameters):
    """The ``torch.optim`` optimizer with the settings of a compiled Keras one (Adam, RMSprop, SGD)."""
    config = optimizer.get_config()
    rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    name = type(optimizer).__name__
    if name == "Adam":
        return torch.optim.Adam(parameters, lr=rate, betas=(config["beta_1"], config["beta_2"]), eps=config["epsilon"],
                                amsgrad=config["amsgrad"])
    if name == "RMSprop":
        return torch.optim.RMSprop(parameters, lr=rate, alpha=config["rho"], eps=config["epsilon"],
                                   momentum=config["momentum"], centered=config["centered"])
    if name == "SGD":
        return torch.optim.SGD(parameters, lr=rate, momentum=config["momentum"], nesterov=config["nesterov"])
    raise NotImplementedError("no torch.optim equivalent written for Keras' {}".format(name))


def make_parallel(workload, devices):
    """d: the make_parallel graph in one process: the batch cut into ``devices`` slices, the template run on
    each, the outputs concatenated, one loss (module docstring: why only on the CPU)."""
    if _on_gpu():
        raise NotImplementedError("make_parallel needs the template's replicas on N GPUs of one process "
                                  "(torch.nn.DataParallel), which can't replicate Keras layers")
    return split_concat(workload, devices, lambda replica: Replicas(replica, devices))


class Replicas(keras.layers.Layer):
    """Runs ``template`` on each of ``count`` slices of the batch and concatenates the outputs."""

    def __init__(self, template, count, **kwargs):
        super().__init__(**kwargs)
        self.template = template
        self.count = count

    def call(self, x):
        size = x.shape[0] // self.count
        parts = [x[i * size:(i + 1) * size] if i < self.count - 1 else x[i * size:] for i in range(self.count)]
        return keras.ops.concatenate([self.template(part) for part in parts], axis=0)

    def compute_output_shape(self, input_shape):
        return self.template.compute_output_shape(input_shape)


def copy_bandwidth(nbytes, repeats=5):
    """Bytes per second of sending ``nbytes`` from rank 0 to rank 1 over the process group (every rank calls it)."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=_device())
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _sync()
        started = time.perf_counter()
        if _rank() == 0:
            dist.send(x, 1)
        elif _rank() == 1:
            dist.recv(x, 0)
        _sync()
        dist.barrier()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:])


def allreduce_seconds(shapes, devices, repeats=5):
    """Seconds per all-reduce of one flat buffer holding every variable, as distkeras' step sends it."""
    size = sum(int(torch.Size(shape).numel()) for shape in shapes)
    flat = torch.ones(size, dtype=torch.float32, device=_device())
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _sync()
        started = time.perf_counter()
        dist.all_reduce(flat)
        _sync()
        times.append(time.perf_counter() - started)
    return times[1:]


def device_peak_bytes(devices):
    """Peak bytes allocated on this process' GPU; None on the CPU."""
    return [torch.cuda.max_memory_allocated(_device())] if _on_gpu() else None


def describe_devices(devices):
    """What the devices are, for the results."""
    return {
        "processes": _world(),
        "process_group": dist.get_backend() if _world() > 1 else None,
        "device": str(_device()),
        "gpu": torch.cuda.get_device_name(_device()) if _on_gpu() else None,
        "threads_by_variant": THREADS,  # filled in as the variants are set up
    }
