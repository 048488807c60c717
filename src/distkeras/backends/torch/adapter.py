"""PyTorch adapter: one process per device, joined in a ``torch.distributed`` process group.

Keras ships no distribution for its torch backend, so the adapter builds one around ``model.fit()``:

- **Processes.** Every replica is a process owning one device (a GPU, or a share of the CPU: on N CPU
  devices each process gets cores // N threads, unless OMP_NUM_THREADS says otherwise). Under a
  launcher (``torchrun``, ``distkeras launch``, anything that sets RANK / WORLD_SIZE / LOCAL_RANK /
  LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT) each process is given to :meth:`TorchAdapter.distribute`
  and joins the job; several hosts work the same way. A plain ``python script.py`` asking for N > 1
  devices becomes rank 0 and starts the other N-1 processes by re-running the script
  (:mod:`distkeras.backends.torch.launch`).
- **Process group.** gloo on CPU, NCCL on GPU, rendezvous at MASTER_ADDR:MASTER_PORT. When that address
  is a loopback one the job is on one host, and rank 0 listens on that address only.
- **The model.** The user's own object, distributed in place: ``distribute(model) is model``, nothing is
  cloned or recompiled, and a model trained before keeps its optimizer state. Its variables (and its
  optimizer's and metrics') are moved to this process' device where they aren't there already (in a
  launched process :meth:`TorchAdapter.prepare` makes the local GPU current before the model is built,
  so usually nothing moves), rank 0's weights, metric state and the state of every optimizer it holds are
  broadcast to every rank (variables made later, by a first ``fit()`` that builds the model, before the step
  that first uses them), then the training hooks of :mod:`distkeras.backends.torch.trainer` are installed on the
  instance: how batches are split, gradients averaged (in buckets overlapped with the backward pass:
  ``overlap``, ``bucket_mb``; in 16 bits with ``compression``), BatchNormalization statistics made
  global (``sync_batchnorm``), random draws made per rank's rows (:mod:`~distkeras.backends.torch.random`),
  predictions split and gathered, metrics aggregated, and what ranks other than 0 print and write.

``describe()`` reports the processes as the replicas and as the workers: one device per process.
"""

import datetime
import inspect
import ipaddress
import logging
import os
import socket
import sys
import weakref
from typing import List

from ...launch import exchange, network
from ...devices import Device
from ...errors import DeviceSpecError, DistKerasError, OptionError, TooLateError
from .. import batchnorm, keras_model, when_imported
from ..base import COMPRESSION_HELP, SHARD_HELP, Adapter, check_compression, check_shard

logger = logging.getLogger("distkeras")

#: torch.distributed's own default: how long a collective (or the rendezvous) may wait.
DEFAULT_TIMEOUT = 1800.0
#: DDP's bucket_cap_mb default. Here, where options are checked before torch is imported; buckets.py takes it from here.
DEFAULT_BUCKET_MB = 25
_BACKENDS = ("gloo", "nccl")
_BATCH_LOGS = ("global", "local")
#: The instance attribute holding the model's torch_trainer.Replica (read by verify()).
_REPLICA = "_distkeras_replica"

#: The store of the job's rendezvous (wrapped in a "distkeras" prefix), once this process has joined.
_store = None
#: The socket rank 0's store listens on, when distkeras bound it (kept open as long as the store).
_listener = None


class TorchAdapter(Adapter):
    name = "torch"
    framework = "torch"
    late_variables = True
    install_hint = "torch"
    shard_unsupported = None
    options = {
        "shard": SHARD_HELP,
        "timeout": "seconds a collective or the rendezvous may wait for the other processes (default 1800)",
        "backend": "torch.distributed backend: " + ", ".join(_BACKENDS) + " (default: nccl on GPUs, gloo on CPU)",
        "sync_batchnorm": batchnorm.OPTION_HELP,
        "compression": COMPRESSION_HELP,
        "overlap": "all-reduce the gradients in buckets during the backward pass, as DDP does (default True); "
                   "False: all at once after it",
        "bucket_mb": "MiB of gradients (as sent) per overlapped all-reduce (default 25, the first bucket 1 at most)",
        "batch_logs": "'global' (default): each batch's logs are one device's wherever a callback or the progress "
                      "bar reads them, at one small all-reduce per step; 'local': this rank's own running values",
        "strategy": "'data' (a replica in every process, the default) or 'model' (tensor parallelism: Dense, "
                    "EinsumDense, MultiHeadAttention and Embedding layers split over the processes, Megatron-style)",
        "layout_map": "strategy='model': {variable path regex: axes}, e.g. {'dense/kernel': (None, 'model'), "
                      "'dense_1/kernel': ('model', None)} (column, then row), or a keras.distribution.LayoutMap; "
                      "default: Dense pairs column then row, attention by heads",
        "model_shards": "strategy='model': processes per model replica, on the 'model' axis (default: all); the "
                        "processes / model_shards replicas split the batch",
        "pipeline_stages": "pipeline parallelism: the number of stages to cut the model into (balanced by parameter "
                           "count), or the names of the layers to cut after; one process per stage, the processes / "
                           "stages replicas split the batch",
        "microbatches": "pipeline_stages: micro-batches per batch (default: 2 x stages)",
        "schedule": "pipeline_stages: 'gpipe' (every forward, then every backward; the default) or '1f1b' (fewer "
                    "activations held)",
    }

    def prepare(self, cluster):
        """In a launched process: make its local GPU the current one as soon as torch is imported, so
        Keras builds the model there (Keras' torch backend puts variables on the current CUDA device)."""
        when_imported("torch", lambda: use_local_gpu(cluster.local_rank))

    def list_devices(self) -> List[Device]:
        """The CUDA GPUs; without any, DISTKERAS_CPU_DEVICES CPU devices (one process each).

        Without that variable a launched process reports as many CPU devices as its launcher started
        processes on this host (LOCAL_WORLD_SIZE), and a plain process one.
        """
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count():
            return [Device("gpu", i) for i in range(torch.cuda.device_count())]
        from ...cluster import from_env
        from ...devices import CPU_DEVICES_ENV

        value = os.environ.get(CPU_DEVICES_ENV, "").strip()
        count = int(value) if value.isdigit() and int(value) > 0 else from_env().local_world_size
        return [Device("cpu", i) for i in range(count)]

    def set_cpu_devices(self, count):
        """Nothing to configure: CPU devices are processes, started by :meth:`distribute`. Too late only
        inside a job that already runs with another number of processes on this host."""
        distributed = sys.modules.get("torch.distributed")
        if distributed is None or not distributed.is_available() or not distributed.is_initialized():
            return
        from ...cluster import from_env

        running = from_env().local_world_size
        if count != running:
            raise TooLateError(
                "This process is one of {} PyTorch worker processes on this host, so the CPU can't be split into "
                "{} devices now. Call distkeras.use_cpu_devices({}) (or set DISTKERAS_CPU_DEVICES={}) before "
                "building any model and calling distkeras.distribute().".format(running, count, count, count)
            )

    def replicas(self, devices, cluster):
        """One process per device: each host of the job runs one process per device in ``devices``
        (LOCAL_WORLD_SIZE of them, which :meth:`distribute` checks), so a job has ``world_size`` replicas;
        a plain process starts one per device itself."""
        return len(devices) * max(1, cluster.world_size // max(1, cluster.local_world_size))

    def model_shards(self, model):
        """The processes a model split by ``strategy="model"`` spans (1: not split). Read by describe()."""
        state = model.__dict__ if hasattr(model, "__dict__") else {}
        if state.get("_distkeras_pipeline") is not None:  # pipeline.PLAN: each replica split into stages
            return state["_distkeras_pipeline"].stages
        splits = state.get("_distkeras_splits")
        return splits[0].world if splits else 1

    def shard_mode(self, model):
        # The model's Sharding (shard._SHARDING, read by name here: shard.py imports torch), set by distribute().
        return getattr(model.__dict__.get("_distkeras_sharding"), "mode", None) if hasattr(model, "__dict__") else None

    def random_states(self):
        """torch's global generator: Keras' torch trainer shuffles arrays with a RandomSampler drawing from it."""
        import torch

        return {"torch": torch.get_rng_state()}

    def set_random_states(self, states):
        import torch

        if "torch" in states:  # a ByteTensor, or the NumPy bytes a checkpoint's JSON gives back
            torch.set_rng_state(torch.as_tensor(states["torch"], dtype=torch.uint8))

    def any_process(self, model, flag):
        """One integer all-reduced (max) on the job's own process group: gloo on CPU, NCCL on GPU."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return bool(flag)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def distribute(self, model, devices, cluster, timeout=DEFAULT_TIMEOUT, backend=None, sync_batchnorm=True,
                   compression=None, overlap=True, bucket_mb=DEFAULT_BUCKET_MB, shard=None, batch_logs="global",
                   strategy="data", layout_map=None, model_shards=None, pipeline_stages=None, microbatches=None,
                   schedule="gpipe"):
        import torch

        from . import launch as torch_launch
        from . import loops as torch_loops
        from . import trainer as torch_trainer
        from . import messages as torch_messages
        from . import collectives as torch_collectives

        # Everything that can fail on what the user gave fails here, before any process is started.
        timeout = _check_timeout(timeout)
        compression = check_compression(compression)
        shard = check_shard(shard)
        sync_batchnorm = batchnorm.check_option(sync_batchnorm)
        if not isinstance(overlap, bool):
            raise OptionError("Expected True or False for overlap. Received: overlap={!r}".format(overlap))
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < float("inf"):
            raise OptionError(
                "Expected a positive number of MiB for bucket_mb (default {}). Received: bucket_mb={!r}".format(
                    DEFAULT_BUCKET_MB, bucket_mb)
            )
        _check_strategy(strategy, layout_map, model_shards, shard, compression, model, cluster, devices)
        _check_pipeline(pipeline_stages, microbatches, schedule, strategy, shard, compression, model, cluster, devices)
        if batch_logs not in _BATCH_LOGS:
            raise OptionError("Expected batch_logs in {}. Received: batch_logs={!r}".format(_BATCH_LOGS, batch_logs))
        replicas = self.replicas(devices, cluster)
        if pipeline_stages is not None or microbatches is not None:
            keras_model.refuse_stateful_rnns(model, "PyTorch", "pipeline stages run every batch in microbatches")
            keras_model.pipeline_loss_rule(model)
        elif strategy == "data" and replicas > 1:
            keras_model.refuse_stateful_rnns(
                model, "PyTorch", "each of the {} processes runs its own share of every batch".format(replicas))
        if len({d.kind for d in devices}) > 1:
            raise DeviceSpecError(
                "Expected devices of one kind: with PyTorch every replica is a process, and the processes of a job "
                "all use GPUs or all use the CPU. Received: devices={}".format(", ".join(map(str, devices)))
            )
        if cluster.is_multi_worker and cluster.local_world_size != len(devices):
            raise DistKerasError(
                "The launcher started {} process(es) on this host (LOCAL_WORLD_SIZE), and distribute() was given "
                "{} device(s): {}. distkeras runs one process per device; make them equal (--nproc-per-node {} or "
                "devices={}).".format(
                    cluster.local_world_size, len(devices), ", ".join(map(str, devices)), len(devices),
                    cluster.local_world_size,
                )
            )
        device = devices[cluster.local_rank if cluster.is_multi_worker else 0]
        backend = _backend(backend, device)
        if device.kind == "gpu":
            torch.cuda.set_device(device.index)
        else:
            share_cpu_threads(torch, len(devices))
        torch_trainer.uninstall(model)  # an earlier distribute()'s hooks: replaced, never stacked
        place(model, torch.device("cuda", device.index) if device.kind == "gpu" else torch.device("cpu"))

        listener = watcher = None
        if cluster.is_multi_worker:
            torch_launch.watch_parent()
        else:  # a plain process: it becomes rank 0 of a job it starts
            cluster, listener, watcher = torch_launch.start_workers(len(devices), timeout)
        _join(cluster, device, backend, timeout, listener)
        torch_messages.configure(one_host=cluster.local_world_size >= cluster.world_size)
        replica = torch_trainer.Replica(
            cluster.rank, cluster.world_size, _store, timeout, watcher.failure if watcher else None, compression
        )
        torch_collectives.use_data_group(None)  # every process (an earlier strategy="model" may have set another)
        torch_trainer.broadcast_new_variables(model, replica)  # all of them, this first time
        if pipeline_stages is not None:
            return _pipeline(model, replica, pipeline_stages, microbatches, schedule, sync_batchnorm, bucket_mb,
                             batch_logs)
        if strategy == "model":
            return _tensor_parallel(model, replica, layout_map, model_shards, sync_batchnorm, bucket_mb, batch_logs)
        torch_trainer.install(model, replica, sync_batchnorm, overlap, bucket_mb, shard, batch_logs)
        torch_loops.install(model, replica)  # hand-written loops (distkeras.loops)
        keras_model.hook(model, _REPLICA, replica)  # for verify()
        return model

    def check_data(self, model, mode, rank, workers):
        """The data check across processes: each process' whole global batch is noted where Keras' data adapter
        yields it (before the rows ``[rank::world]`` are taken, :func:`~.batches.sharded_batches`), and the
        processes compare them with one all-reduce. A model split over processes (``pipeline_stages``,
        ``strategy="model"``) is checked the same way: each of its processes draws the global batch too (stage 0
        its inputs, the last stage its targets), and every process of the job must draw the same."""
        from ...verify import datacheck
        from .. import datawatch
        from . import collectives

        datawatch.hook(model, datacheck.Watch(mode, rank, workers, collectives.sum_over_processes, self.name,
                                              wrap_adapter=datawatch.noting_adapter("get_torch_dataloader")))

    def verify(self, model, check):
        """The one-device check (:mod:`.verify`): every rank runs the one-device step on the gathered global batch;
        a model cut into pipeline stages is gathered whole on every process of its replica for that step, and a
        sharded one (``shard=``) or one split over model shards (``strategy='model'``) on every process."""
        from . import pipeline as torch_pipeline
        from . import tensor
        from . import verify as torch_verify
        from .. import verifying

        plan = model.__dict__.get(torch_pipeline.PLAN)
        if plan is not None:
            check.backend += ", {} pipeline stages".format(plan.stages)
            verifying.install(model, check, torch_verify.wrap_pipeline(model, check, plan,
                                                                       model.__dict__.get(_REPLICA)))
            return
        splits = model.__dict__.get(tensor.SPLITS)
        if splits:
            # strategy='model': every model shard of a replica runs the replica's whole batch, so the rows are
            # gathered and the metrics summed over the data-parallel replicas only (None: one replica).
            replicas = model.__dict__.get(_REPLICA)
            check.backend += ", {} model shards".format(splits[0].world)
            verifying.install(model, check, torch_verify.wrap(
                model, check, replicas, gathered=lambda: tensor.gathered(model, splits),
                reduce=torch_verify.summed_metrics if replicas is not None else None))
            return
        verifying.install(model, check, torch_verify.wrap(model, check, model.__dict__[_REPLICA]))


def _check_pipeline(stages, microbatches, schedule, strategy, shard, compression, model, cluster, devices):
    """The pipeline options, checked (and the model cut, to find a bad cut) before any process starts."""
    from ...parallel import pipeline

    if stages is None:
        if microbatches is not None or schedule != "gpipe":
            raise OptionError("microbatches and schedule apply to pipeline_stages only. Received: microbatches={!r}, "
                              "schedule={!r}".format(microbatches, schedule))
        return
    pipeline.check_schedule(schedule)
    if microbatches is not None:
        pipeline.check_microbatches(microbatches)
    for name, value, default in (("strategy", strategy, "data"), ("shard", shard, None),
                                 ("compression", compression, None)):
        if value != default:
            raise OptionError("pipeline_stages runs each stage's layers whole on one process and doesn't combine "
                              "with {}={!r} in this version. Received: pipeline_stages={!r}, {}={!r}".format(
                                  name, value, stages, name, value))
    from . import pipeline as torch_pipeline

    torch_pipeline.check_optimizer(model)
    parts = pipeline.plan(model, stages)
    processes = cluster.world_size if cluster.is_multi_worker else len(devices)
    if len(parts) < 2:
        raise OptionError("pipeline_stages={!r} gives one stage: nothing to pipeline. Give 2 or more.".format(stages))
    pipeline.check_world(processes, len(parts))


def _pipeline(model, replica, stages, microbatches, schedule, sync_batchnorm, bucket_mb, batch_logs):
    """Cut ``model`` into stages (:mod:`distkeras.parallel.pipeline`), one per process, R = processes / stages replicas of
    the pipeline: process ``r * S + s`` runs stage ``s`` of replica ``r``. A replica's stages form a process group
    for the activations and gradients; each stage's replicas one for data parallelism (the trainer's hooks on
    that group, as with tensor parallelism)."""
    from . import collectives
    from . import pipeline as torch_pipeline
    from . import trainer as torch_trainer

    plan = torch_pipeline.make_plan(model, stages, microbatches, schedule, replica.rank, replica.world)
    steps = torch_pipeline.steps(plan)
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:  # every variable's slots: a save holds the whole state
        optimizer.build(model.trainable_variables)
    # Alike on every process already (fresh slots): never broadcast as "new" (the other stages' are freed below).
    replica.known.update((id(v), weakref.ref(v)) for v in keras_model.state_variables(model))

    def whole():
        torch_pipeline.gather(plan)

    def split():
        torch_pipeline.release(plan)

    split()  # each process keeps its own stage's weights and optimizer state only

    if plan.replicas > 1:
        collectives.use_data_group(plan.data_group, src=plan.index)
        replicas = torch_trainer.Replica(plan.replica, plan.replicas, replica.store, replica.timeout,
                                         replica.launch_failure)
        replicas.process, replicas.processes = replica.rank, replica.world
        replicas.known = replica.known
        torch_trainer.install(model, replicas, sync_batchnorm, False, bucket_mb, None, batch_logs, steps=steps)
        torch_trainer.install_tensor_parallel(model, replicas, whole, split, data_parallel=True)
        keras_model.hook(model, _REPLICA, replicas)  # for verify(): the rows of each stage's replicas
    else:
        torch_trainer.install_tensor_parallel(model, replica, whole, split)
        for name, step in steps.items():
            keras_model.hook(model, name, step)
    keras_model.hook(model, torch_pipeline.PLAN, plan)
    return model


def _check_strategy(strategy, layout_map, model_shards, shard, compression, model, cluster, devices):
    """The strategy options, checked before any process starts."""
    from ...parallel import layouts

    if strategy not in ("data", "model"):
        raise OptionError("Expected strategy in ('data', 'model'). Received: strategy={!r}".format(strategy))
    if strategy == "data":
        if layout_map is not None or model_shards is not None:
            raise OptionError("layout_map and model_shards apply to strategy='model' only. Received: strategy='data', "
                              "layout_map={!r}, model_shards={!r}".format(layout_map, model_shards))
        return
    for name, value in (("shard", shard), ("compression", compression)):
        if value is not None:
            raise OptionError("{} applies to strategy='data' on PyTorch (replicas' state and gradients). Received: "
                              "strategy='model', {}={!r}".format(name, name, value))
    clips = [(name, getattr(getattr(model, "optimizer", None), name, None)) for name in ("global_clipnorm", "clipnorm")]
    clips = ["{}={!r}".format(name, value) for name, value in clips if value]
    if clips:  # each process holds part of a split variable's gradient: a norm of it would be a norm of a part
        raise OptionError(
            "strategy='model' on PyTorch splits variables over the processes, and {}'s optimizer has {}, a norm "
            "over whole gradients: not supported with strategy='model' on PyTorch in this version (it would clip "
            "by the norm of each process' part). Use clipvalue=, or strategy='data' (with shard= for memory)."
            .format(model.name, ", ".join(clips)))
    processes = cluster.world_size if cluster.is_multi_worker else len(devices)
    layouts.mesh(processes, model_shards)
    if layout_map is not None:
        layouts.rules(layout_map)
    if not model.built or not model.weights:
        raise OptionError("strategy='model' splits the model's variables, and {} has none yet. Build it first "
                          "(model.build(input_shape), or call it once on a batch: model(x[:1])), then distribute "
                          "it.".format(model.name))


def _tensor_parallel(model, replica, layout_map, model_shards, sync_batchnorm, bucket_mb, batch_logs):
    """Split ``model`` (:mod:`.tensor`; rank 0's values already on every rank) over a mesh of ``replicas`` x
    ``model_shards`` processes: process ``r * model_shards + s`` holds shard ``s`` of replica ``r``. Each replica's
    shards form a process group for the split layers' collectives; each shard's replicas one for data
    parallelism (the batch split over the replicas, gradients and metrics all-reduced among them: the
    trainer's hooks, on that group)."""
    import torch.distributed as dist

    from ...parallel import layouts
    from . import collectives, tensor
    from . import trainer as torch_trainer

    grid = layouts.mesh(replica.world, model_shards)
    shards, index, shard = grid.model_shards, replica.rank // grid.model_shards, replica.rank % grid.model_shards
    model_group = data_group = None
    if grid.replicas > 1:  # every process makes every group, in the same order (torch's rule)
        for r in range(grid.replicas):
            group = dist.new_group([r * shards + s for s in range(shards)])
            model_group = group if r == index else model_group
        for s in range(shards):
            group = dist.new_group([r * shards + s for r in range(grid.replicas)])
            data_group = group if s == shard else data_group
    table = layouts.rules(layout_map) if layout_map is not None else tensor.default_table(model, shards)
    splits = tensor.plan(model, table, shard, shards, model_group)
    tensor.check_regularizers(splits)

    def split():
        tensor.shard_all(model, splits)

    split()
    whole = lambda: tensor.gather_all(model, splits)  # noqa: E731
    if grid.replicas > 1:
        collectives.use_data_group(data_group, src=shard)
        replicas = torch_trainer.Replica(index, grid.replicas, replica.store, replica.timeout, replica.launch_failure)
        replicas.process, replicas.processes = replica.rank, replica.world
        replicas.known = replica.known  # broadcast already (before the split: whole values, from rank 0)
        torch_trainer.install(model, replicas, sync_batchnorm, False, bucket_mb, None, batch_logs)
        torch_trainer.install_tensor_parallel(model, replicas, whole, split, data_parallel=True)
    else:
        torch_trainer.install_tensor_parallel(model, replica, whole, split)
    tensor.install(splits)  # after: installing the model's hooks takes off every earlier hook of its layers
    tensor.sum_regularization(model, splits)
    keras_model.hook(model, tensor.SPLITS, splits)
    if grid.replicas > 1:
        keras_model.hook(model, _REPLICA, replicas)  # for verify(): the rows of the data-parallel replicas
    return model


def use_local_gpu(local_rank):
    """Make GPU ``local_rank`` the current CUDA device, when CUDA has one of that index; else nothing."""
    import torch

    try:
        if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
            torch.cuda.set_device(local_rank)
    except Exception:  # runs inside the user's import of torch; distribute() sets the device again
        pass


def place(model, device):
    """Move every variable of ``model`` (its metrics' and optimizer's too) that is not on ``device`` there.

    Keras' torch Variable keeps its storage in the private attribute ``_value``, a ``torch.nn.Parameter``,
    and has no public way to move it (``assign()`` copies into the storage where it is). The Parameter's
    data is replaced in place, as ``torch.nn.Module.to()`` does, so the same Parameter object stays in the
    layers' ``torch_params`` and in the optimizer, on the new device. tests/backends/test_torch.py pins it.
    """
    import torch

    for variable in keras_model.state_variables(model):
        value = getattr(variable, "_value", None)
        if isinstance(value, torch.Tensor) and value.device != device:
            value.grad = None
            value.data = value.data.to(device)


def share_cpu_threads(torch, processes):
    """Give each of this host's ``processes`` CPU replicas its share of the cores, as threads.

    torch gives every process as many threads as the machine has cores, so N processes would run N times
    as many threads as cores, and training slows down (torchrun sets OMP_NUM_THREADS=1 for the same
    reason). A process' threads are only ever lowered, to ``cores // processes`` (at least 1), and
    OMP_NUM_THREADS, when set, is the user's choice and is kept.
    """
    if processes <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // processes)
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


def _check_timeout(timeout):
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise OptionError("Expected a positive number of seconds for timeout. Received: timeout={!r}".format(timeout))
    return float(timeout)


def _backend(name, device):
    if name is None:
        return "nccl" if device.kind == "gpu" else "gloo"
    if name not in _BACKENDS:
        raise OptionError("Expected backend in {}. Received: backend={!r}".format(_BACKENDS, name))
    if name == "nccl" and device.kind != "gpu":
        raise OptionError("backend='nccl' needs GPUs; this process runs on {}. Use backend='gloo'.".format(device))
    return name


def is_loopback(host):
    """True for an address that only this host can reach (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _join(cluster, device, engine, timeout, listener=None):
    """Join (or check) the process group of ``cluster``; rendezvous at its coordinator."""
    global _store
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise DistKerasError(
            "This PyTorch build ({}) has no torch.distributed, which distkeras needs to run one process per "
            "device. Install a standard PyTorch build (`pip install torch`).".format(torch.__version__)
        )
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (cluster.rank, cluster.world_size):
            raise DistKerasError(
                "This process already belongs to a torch.distributed group as rank {} of {}, but the launch "
                "environment says rank {} of {}. Call distkeras.distribute() with the same devices in every "
                "call of a job.".format(dist.get_rank(), dist.get_world_size(), cluster.rank, cluster.world_size)
            )
        return
    if not cluster.coordinator:
        raise DistKerasError(
            "This process is rank {} of {} ({}), but no rendezvous address is set. Set MASTER_ADDR and "
            "MASTER_PORT to rank 0's host and a free port, or start the job with torchrun.".format(
                cluster.rank, cluster.world_size, cluster.source
            )
        )
    host, _, port = cluster.coordinator.rpartition(":")
    host, port = host.strip("[]"), int(port)
    # Gloo and NCCL advertise the address the host name resolves to unless told an interface (a loopback
    # one on stock Debian/Ubuntu hosts): give them the one that reaches the coordinator (lo on one host).
    os.environ.update(network.engine_variables(network.choose(host)))
    wait = datetime.timedelta(seconds=timeout)
    if cluster.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # else torchrun serves it
        if listener is None:
            listener = _listen(host, port)
        store = _serve_store(dist, host, port, cluster.world_size, wait, listener)
    else:
        store = dist.TCPStore(host, port, cluster.world_size, False, wait)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps its store across the restarts of --max-restarts: without a prefix of its
            # own, a restarted job's Gloo reads the dead attempt's addresses and never connects.
            store = dist.PrefixStore(exchange.attempt(), store)
    extra = {}
    if engine == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        extra["device_id"] = torch.device("cuda", device.index)
    dist.init_process_group(
        engine, store=store, rank=cluster.rank, world_size=cluster.world_size, timeout=wait, **extra
    )
    _store = dist.PrefixStore("distkeras", store)


def _listen(host, port):
    """A socket for rank 0's store, bound where the other ranks connect: the loopback address, or this host's
    one address that ``host`` names (:func:`distkeras.launch.network.listen_address`). TCPStore left to bind the port
    itself listens on every interface (``::`` and 0.0.0.0); None where no single address is sure, and so it does."""
    if is_loopback(host):
        return socket.create_server((host, port), backlog=128)
    address = network.listen_address(host)
    if address is None:
        return None
    return socket.create_server((address, port), family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                                backlog=128)


def _serve_store(dist, host, port, world_size, wait, listener):
    """Rank 0's store; on ``listener`` (bound by :func:`_listen`, or by the self-launch) when given."""
    global _listener
    if listener is not None:
        try:
            store = dist.TCPStore(
                host, port, world_size, True, wait, wait_for_workers=False, master_listen_fd=listener.fileno()
            )
            _listener = listener
            return store
        except (TypeError, RuntimeError):  # a torch whose store can't take over a socket: it binds the port
            listener.close()
    return dist.TCPStore(host, port, world_size, True, wait, wait_for_workers=False)
