"""JAX adapter: Keras' own ``keras.distribution`` over a mesh of exactly the resolved devices.

Data parallel (the default) is ``keras.distribution.DataParallel``: every variable is replicated on
every device and each batch is split along its first axis. A step is one SPMD program over the
global batch, so the gradient and the reported loss are the single-device ones, with nothing to
rescale. ``strategy="model"`` is ``keras.distribution.ModelParallel``: kernels are split over a
"model" mesh axis (``layout_map``), batches over a "batch" axis.

The user built the model before any distribution existed, so its variables sit on one device. The
adapter distributes that very model, in place: every variable (weights, metrics, optimizer slots) is
re-assigned as an array laid out on the mesh with the layout the distribution gives it, which is what
Keras would have done had the model been created under the distribution. Nothing is rebuilt from a
config, so subclassed models without ``get_config`` work. ``keras.distribution.set_distribution`` is
global, so the model makes its distribution current only while it compiles, trains, evaluates or
predicts (hooks on the instance, see :func:`keras_model.hook`): models on different device sets live side by
side in one process. Everything the optimizer does with gradients, and BatchNormalization's
statistics, need nothing more: a step is one SPMD program over the global batch (with ``compression``,
:mod:`distkeras.backends.jax.steps` keeps the statistics global by the rule of :mod:`distkeras.backends.batchnorm`).

**Across processes** (``distkeras launch``, any launcher that sets the JAX/Keras coordinator variables, or torchrun,
whose store carries rank 0's coordinator address: :mod:`distkeras.launch.exchange`), ``jax.distributed`` starts at
``import distkeras`` (before JAX's first computation, as it must), the mesh
spans every process' devices, and every process is given the same data, as with TensorFlow: each
global batch is placed with ``jax.make_array_from_callback``, so a process materialises only the
slices its own devices hold, and every process takes the same steps whatever the data size.
Both strategies run across processes: ``strategy="model"``'s ("batch", "model") mesh is laid over every
process' devices in order (each process' devices consecutive), so with ``model_shards`` a multiple of the
devices per process the "model" axis spans processes, and with fewer it stays inside each process and
"batch" spans them; every process still holds the whole global batch and places its slices.

JAX splits an array axis only evenly. A batch the "batch" axis doesn't divide (10 samples on 3
devices, an epoch's smaller last batch, a batch smaller than the device count) is padded to a multiple
of it and split where that is provably the single-device result (:mod:`distkeras.backends.jax.uneven`:
always in predict(), in fit() and evaluate() for models of Keras' own parts, with zero-weight padding);
elsewhere it runs whole on every device, with a warning naming why: the single-device result, not in
parallel.

``shard="optimizer" | "gradients" | "all"`` (ZeRO stages 1-3) is ``DataParallel`` with the training state
split along the "batch" axis instead of replicated (:mod:`distkeras.backends.jax.shard`): the same step,
laid out differently, and XLA places the all-gathers; for "gradients" the step computes each shard's gradient
in ``jax.shard_map`` and reduce-scatters it itself (XLA's CPU compiler makes no reduce-scatter).

``pipeline_stages=`` (with ``microbatches``, ``schedule``) is no Keras distribution: the model is cut into stages,
one per device of this process, each stage's variables on its device, and the model's train/test/predict functions
drive the stages' jitted functions micro-batch by micro-batch (:mod:`distkeras.backends.jax.pipeline`).

Every optimizer the model holds is laid out (``keras_model.all_optimizers``: a GAN's ``d_optimizer`` and
``g_optimizer`` too), and a model built later (an unbuilt subclassed model) creates its variables under
the distribution, at its first scoped fit/evaluate/predict.
"""

import functools
import inspect
import logging
import math
import os
import sys
from typing import List

from ...verify import datacheck
from ...parallel import layouts
from ...devices import Device
from ...errors import ClusterError, DistKerasError, NetworkError, OptionError, TooLateError
from .. import agreement, keras_model, policies, when_imported
from ..base import COMPRESSION_HELP, SHARD_HELP, Adapter, check_compression, check_shard, pin_local_gpus

logger = logging.getLogger("distkeras")

_COUNT_FLAG = "--xla_force_host_platform_device_count"
_STRATEGIES = ("data", "model")
#: The returned model's methods that run under its distribution. Keras calls the make_*_function ones
#: after building metrics and optimizer, just before it fixes the step's output layout.
_SCOPED = (
    "compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch",
    "make_train_function", "make_test_function", "make_predict_function",
)


#: The model's instance attribute that holds its ``shard`` value (for :meth:`JaxAdapter.shard_mode`).
_SHARD_MODE = "_distkeras_shard_mode"
#: The model's instance attribute that holds its "model" mesh axis size (for :meth:`JaxAdapter.model_shards`).
_MODEL_SHARDS = "_distkeras_model_shards"
#: The model's instance attribute that holds its pipeline plan (``backends.jax.pipeline.PLAN``, read by name here:
#: that module imports JAX).
_PIPELINE = "_distkeras_pipeline"


class JaxAdapter(Adapter):
    name = "jax"
    framework = "jax"
    late_variables = True
    moves_distributed_models = True
    install_hint = "jax (or 'jax[cuda12]' for NVIDIA GPUs)"
    shard_unsupported = None
    options = {
        "shard": SHARD_HELP,
        "strategy": "'data' (a replica on every device, the default) or 'model' (kernels sharded)",
        "layout_map": "strategy='model': {variable path regex: axes}, e.g. {'.*dense.*kernel': (None, 'model')}; "
        "default: the last axis of every kernel and embedding table that the 'model' axis divides",
        "model_shards": "strategy='model': devices on the 'model' mesh axis (default: all); the rest form 'batch'",
        "compression": COMPRESSION_HELP + "; strategy='data' only",
        "pipeline_stages": "pipeline parallelism in this process: the number of stages to cut the model into (balanced "
        "by parameter count), or the names of the layers to cut after; one device per stage per replica (devices = stages x replicas)",
        "microbatches": "pipeline_stages: micro-batches per batch (default: 2 x stages)",
        "schedule": "pipeline_stages: 'gpipe' (every forward, then every backward; the default) or '1f1b' (fewer "
        "activations held)",
        "compression_fallback": "with compression: True (default) times the 16-bit step against the uncompressed "
        "one over the first steps of training and keeps the faster (a warning when that is the uncompressed one); "
        "False: always 16-bit",
    }

    def pass_over_function(self, take):
        """Keras' JAX trainer calls its train function with the training state and the batch iterator, and keeps
        the state it returns: the state goes back unchanged."""

        def passed_over(state, iterator):
            take(iterator)
            return {}, state

        return passed_over

    def __init__(self):
        self._multi_process_error = None

    def prepare(self, cluster):
        pin_local_gpus(cluster)  # before JAX starts its GPU client: a process uses every GPU it sees
        when_imported("jax", lambda: self._start_multi_process(cluster))

    def _start_multi_process(self, cluster):
        """``jax.distributed.initialize`` right after JAX is imported, before its first computation. Runs
        inside the user's import of JAX, so a failure is kept and raised by distribute() instead."""
        import jax

        from ...launch import exchange, network, rendezvous

        try:
            if exchange.applies(cluster) and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
                # torchrun's MASTER_PORT is its agent's store: rank 0 publishes a coordinator port there instead.
                cluster = cluster._replace(coordinator=exchange.jax_coordinator(cluster))
            route = network.choose(cluster.coordinator)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
            extra = {}
            parameters = inspect.signature(jax.distributed.initialize).parameters
            if "heartbeat_timeout_seconds" in parameters:
                # A lost process ends the job within a bound without distkeras launch too (JAX's default is
                # 100 s); under distkeras launch the launchers, which name the lost host, mostly speak first
                # (JAX's last heartbeat may predate the loss by part of its timeout).
                extra["heartbeat_timeout_seconds"] = int(math.ceil(2 * rendezvous.peer_timeout())) + 10
            extra.update(_coordinator_bind(cluster, parameters))
            jax.distributed.initialize(
                coordinator_address=cluster.coordinator, num_processes=cluster.world_size, process_id=cluster.rank,
                **extra
            )
            if route.interface:
                _gloo_on(route.interface)
        except Exception as exc:  # raised again, with advice, by distribute()
            self._multi_process_error = exc

    def shard_mode(self, model):
        return model.__dict__.get(_SHARD_MODE) if hasattr(model, "__dict__") else None

    def model_shards(self, model):
        """The size of the mesh's "model" axis ``model`` trains on, or its pipeline stages (1: not split, every
        device a replica)."""
        if not hasattr(model, "__dict__"):
            return 1
        plan = model.__dict__.get(_PIPELINE)
        return plan.stages if plan is not None else model.__dict__.get(_MODEL_SHARDS, 1)

    def check_alone(self):
        """jax.distributed joined by someone else (Ray's JaxTrainer on GPUs and TPUs) to several processes."""
        jax = sys.modules.get("jax")
        is_initialized = getattr(getattr(jax, "distributed", None), "is_initialized", None)  # JAX >= 0.4.31
        if is_initialized is None or not is_initialized() or jax.process_count() < 2:
            return
        raise ClusterError(
            "Expected a launch environment for this JAX process, which jax.distributed already joined to {} "
            "processes (as process {}); none was found, and distkeras would train alone on this process' devices. "
            "Received: no distkeras, torchrun, Ray Train (TorchTrainer / TensorflowTrainer), MPI, TF_CONFIG, JAX_* "
            "or Slurm variables. Under Ray, use a DataParallelTrainer whose train loop calls "
            "distkeras.environments.ray.prepare_jax() first, not JaxTrainer; elsewhere, set "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID and let distkeras start "
            "jax.distributed.".format(jax.process_count(), jax.process_index())
        )

    def list_devices(self) -> List[Device]:
        return [device for device, _ in _local_devices()]

    def set_cpu_devices(self, count):
        if "jax" in sys.modules:
            _set_jax_cpu_count(count)
        os.environ["XLA_FLAGS"] = _with_flag(os.environ.get("XLA_FLAGS", ""), _COUNT_FLAG, count)

    def check_data(self, model, mode, rank, workers):
        """The data check: each process' global batch (the process-local batch Keras' JAX trainer lays out) is noted
        where the data adapter yields it (``get_jax_iterator``), and compared with ``process_allgather``."""
        from .. import datawatch

        datawatch.hook(model, datacheck.Watch(mode, rank, workers, _sum_over_processes, self.name,
                                              wrap_adapter=datawatch.noting_adapter("get_jax_iterator")))

    def any_process(self, model, flag):
        """Every process' flag, gathered over the job's devices (``process_allgather``, an XLA all-gather)."""
        import jax

        if jax.process_count() == 1:
            return bool(flag)
        import numpy as np
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))

    def verify(self, model, check):
        """The one-device check (:mod:`.verify`), in one process or across processes, for every layout: replicas,
        model shards, sharded state (``shard=``) and pipeline stages (the whole state is gathered to one device)."""
        if _PIPELINE in model.__dict__:
            check.backend += ", {} pipeline stages".format(model.__dict__[_PIPELINE].stages)
        elif self.shard_mode(model) is not None:
            check.backend += ", shard={!r}".format(self.shard_mode(model))
        from . import verify as jax_verify
        from .. import verifying

        verifying.install(model, check, jax_verify.wrap(model, check))

    def distribute(self, model, devices, cluster, strategy="data", layout_map=None, model_shards=None,
                   compression=None, shard=None, compression_fallback=True, pipeline_stages=None, microbatches=None,
                   schedule="gpipe"):
        """Lay ``model`` out under a Keras distribution over exactly ``devices``, in place.

        Args:
            model: a built Keras model; it is distributed in place and returned.
            devices: the resolved devices, all of one kind.
            cluster: this process' place in the job. A job of several processes (``jax.distributed``, started at
                ``import distkeras``; see the module docstring) lays the model out on a mesh of every process'
                devices.
            strategy: ``"data"`` (``DataParallel``: a replica on every device) or ``"model"``
                (``ModelParallel`` over a ("batch", "model") mesh).
            layout_map: ``strategy="model"``: ``{variable path regex: axes}``, axes naming "model",
                "batch" or None per dimension; a ``keras.distribution.LayoutMap`` gives its rules.
                Default: the last axis of every kernel and embedding table that "model" divides.
            model_shards: ``strategy="model"``: the size of the "model" axis (default: every device).
            compression: ``"bf16"``/``"fp16"``: gradients all-reduced in 16 bits
                (:mod:`distkeras.backends.jax.steps`); ``strategy="data"`` only.
            shard: ``"optimizer"``, ``"gradients"`` or ``"all"``: the training state split along the mesh's data
                axis (:mod:`distkeras.backends.jax.shard`); ``strategy="data"`` only, and with ``compression``
                not ``"all"``.
            compression_fallback: with ``compression``, True (the default) puts the 16-bit step on trial: over the
                first 12 steps of training it is timed against the uncompressed step, interleaved, and the faster
                is kept for good, the same on every process (rank 0 warns when that is the uncompressed one); see
                :class:`distkeras.backends.jax.steps._Trial`. False: the 16-bit step always (reproducible runs).
            pipeline_stages: pipeline parallelism in this process (:mod:`distkeras.backends.jax.pipeline`): the
                number of stages (balanced by parameter count) or the names of the layers to cut after; stage ``s``
                on ``devices[s]``, so as many devices as stages. Not with ``strategy="model"``, ``shard``,
                ``compression`` or several processes in this version.
            microbatches: ``pipeline_stages``: micro-batches per batch (default: 2 x stages).
            schedule: ``pipeline_stages``: ``"gpipe"`` (the default) or ``"1f1b"``.

        Returns:
            ``model`` itself, its variables on the mesh.

        Raises:
            OptionError: a bad ``strategy``, ``layout_map``, ``model_shards``, ``compression`` or ``shard`` (or a
                combination of them that doesn't apply).
            TooLateError: this process is one worker of several and ``jax.distributed`` is not running (JAX ran
                its first computation before ``import distkeras``).
            ClusterError, NetworkError: the job's coordinator could not be found or reached.
            DistKerasError: across processes, ``devices`` names fewer than all of this worker's devices of the kind.
        """
        import keras

        from . import loops as jax_loops
        from . import shard as jax_shard
        from . import steps as jax_steps
        from . import uneven as jax_uneven

        compression = check_compression(compression)
        if pipeline_stages is not None or microbatches is not None or schedule != "gpipe":
            keras_model.pipeline_loss_rule(model)
            return _pipeline(model, devices, cluster, pipeline_stages, microbatches, schedule, dict(
                strategy=(strategy, "data"), layout_map=(layout_map, None), model_shards=(model_shards, None),
                compression=(compression, None), shard=(shard, None)))
        if compression_fallback not in (True, False):
            raise OptionError("Expected compression_fallback to be True or False. Received: compression_fallback="
                              "{!r}".format(compression_fallback))
        shard = check_shard(shard)
        _check_shard_combination(shard, strategy, compression)
        if compression is not None and strategy != "data":
            raise OptionError(
                "compression applies to strategy='data' (the gradient all-reduce of replicas). With strategy='model' "
                "XLA places the collectives of the sharded step itself (activations and partial sums within the "
                "'model' axis, gradients over 'batch'), and distkeras' 16-bit all-reduce would have to replace that "
                "partitioning. Received: strategy={!r}, compression={!r}".format(strategy, compression))
        by_device = dict(_local_devices())
        mesh_devices = [by_device[d] for d in devices]
        if cluster.is_multi_worker:
            mesh_devices = self._global_mesh_devices(cluster, devices, mesh_devices)
        if strategy == "data":
            if layout_map is not None or model_shards is not None:
                raise OptionError(
                    "layout_map and model_shards apply to strategy='model' only. Received: strategy='data', "
                    "layout_map={!r}, model_shards={!r}".format(layout_map, model_shards)
                )
            if shard is None:
                distribution = keras.distribution.DataParallel(devices=mesh_devices)
            else:
                from .shard import ShardedDataParallel

                distribution = ShardedDataParallel(mesh_devices, shard, cluster.rank)
        elif strategy == "model":
            distribution = _model_parallel(keras, model, mesh_devices, layout_map, model_shards)
        else:
            raise OptionError("Expected strategy in {}. Received: strategy={!r}".format(_STRATEGIES, strategy))
        if cluster.is_multi_worker:
            distribution.auto_shard_dataset = False  # every process holds the global batch; see the docstring
        jax_uneven._ours[distribution] = set()
        jax_uneven._replicate_uneven_batches()
        keras_model.unhook(model)  # an earlier distribute()'s hooks
        jax_shard.unhook_optimizers(model)
        agreement.use(_board(cluster) if cluster.is_multi_worker else None)
        if cluster.is_multi_worker:
            _take_rank0_values(model)
        jax_steps.uninstall(model)
        jax_uneven.install(model)
        with distribution.scope():
            _assign_layouts(model, distribution)
            _lay_out(model, distribution)
        # Steps traced before (a model trained before distribute()) were compiled for the old placement.
        model.train_function = model.test_function = model.predict_function = None
        scatter = jax_shard.scatter_rule(model, distribution, compression is not None) if shard is not None else None
        if compression is not None or scatter is not None:
            jax_steps.install(model, distribution.device_mesh.backend_mesh, distribution.batch_dim_name,
                              jax_steps.WIRE.get(compression, "float32"), cluster.rank, scatter,
                              fallback=compression_fallback)
        for name in _SCOPED:
            keras_model.hook(model, name, _scoped(getattr(model, name), model, distribution, name))
        jax_loops.install(model, distribution)  # hand-written loops (distkeras.loops)
        if cluster.is_multi_worker:
            _same_random_state_every_epoch(model)
        policies.rank0_speaks_and_writes(model, cluster.rank)
        if shard is not None or strategy == "model":
            # Across processes a sharded array is no process' whole: saving and get_weights() gather it first.
            for name in ("save", "save_weights", "get_weights"):  # after the saving rule's hooks, which they wrap
                keras_model.hook(model, name, jax_shard.gathered(getattr(model, name), model))
        if shard is not None:
            keras_model.hook(model, _SHARD_MODE, shard)  # for describe(); unhooked by a later distribute()
        if strategy == "model":
            keras_model.hook(model, _MODEL_SHARDS, distribution.device_mesh.shape[1])  # for describe()
        return model

    def _global_mesh_devices(self, cluster, devices, local_devices):
        """Every process' devices of the chosen kind, for a mesh that spans the job."""
        import jax

        if isinstance(self._multi_process_error, (ClusterError, NetworkError)):
            raise self._multi_process_error  # the job's coordinator couldn't be found: say why, not "import earlier"
        if self._multi_process_error is not None or jax.process_count() != cluster.world_size:
            raise TooLateError(
                "This process is worker {} of {} ({}), but jax.distributed is not running ({}). Import distkeras "
                "before JAX runs its first computation (before building any model).".format(
                    cluster.rank, cluster.world_size, cluster.source,
                    self._multi_process_error or "{} JAX process(es)".format(jax.process_count()))
            )
        mine = [d for d in jax.local_devices() if d.platform == local_devices[0].platform]
        if len(local_devices) != len(mine):
            raise DistKerasError(
                "Across processes the mesh takes every {} device of every worker; devices={} asks for {} of this "
                "worker's {}. Restrict devices with CUDA_VISIBLE_DEVICES or DISTKERAS_CPU_DEVICES instead.".format(
                    devices[0].kind, [str(d) for d in devices], len(local_devices), len(mine))
            )
        return [d for d in jax.devices() if d.platform == local_devices[0].platform]


def _pipeline(model, devices, cluster, stages, microbatches, schedule, others):
    """Cut ``model`` into pipeline stages over ``devices`` of this process (:mod:`.pipeline`), every option checked
    first: one device per stage and replica (stages x replicas devices), one process, no other way of splitting."""
    from ...parallel import pipeline
    from . import pipeline as jax_pipeline
    from . import shard as jax_shard
    from . import steps as jax_steps

    parts, microbatches = pipeline.plan_in_process(model, stages, microbatches, schedule, others, cluster, devices,
                                                   "JAX")
    jax_pipeline.check_optimizer(model)
    by_device = dict(_local_devices())
    keras_model.unhook(model)  # an earlier distribute()'s hooks
    jax_shard.unhook_optimizers(model)
    jax_steps.uninstall(model)
    plan = jax_pipeline.Plan(model, parts, pipeline.stage_devices([by_device[d] for d in devices], len(parts)),
                             microbatches, schedule)
    jax_pipeline.install(model, plan)
    policies.rank0_speaks_and_writes(model, cluster.rank)
    return model


def _same_random_state_every_epoch(model):
    """fit() across processes: every process takes rank 0's Python and NumPy random states at every epoch's start
    (:func:`~distkeras.backends.policies.sync_random_state` over :func:`_broadcast_bytes`; a callback added last).

    Keras' JAX trainer shuffles arrays with NumPy's global generator (``np.random.permutation``, drawn when the
    epoch's first batch is taken, after ``on_epoch_begin``), and each process materialises its devices' slices of
    the global batch from its own permutation (``jax.make_array_from_callback``): processes whose states differed
    (another seed, or draws of their own before fit) would train on some samples twice and skip others in an
    epoch. With rank 0's state on every process, every step takes the rows rank 0 alone would take.
    """
    fit = model.fit
    signature = inspect.signature(type(model).fit.__get__(model))  # Keras' own, whatever wraps it

    @functools.wraps(fit)
    def same_shuffle_fit(*args, **kwargs):
        bound = keras_model.Arguments(signature, args, kwargs)
        callback = policies.every_epoch(keras_model.keras_module(model).callbacks.Callback, _broadcast_bytes)
        callbacks = policies.with_callback(bound.get("callbacks"), callback)
        if callbacks is None:
            logger.warning("fit() was given a CallbackList: its callbacks run as given, and the processes take "
                           "rank 0's random state at no epoch's start, so a shuffle differs between processes "
                           "unless they are seeded alike. Pass a list of callbacks instead.")
        else:
            bound.set("callbacks", callbacks)
        return fit(*bound.args, **bound.kwargs)

    keras_model.hook(model, "fit", same_shuffle_fit)


def _check_same_variables(variables):
    """Raise the same CollectiveError on every process where the processes' ``variables`` differ in number, shape
    or dtype (:func:`~distkeras.backends.policies.variables_differ`): laid out on the mesh, a variable only some
    processes hold makes collectives of other sizes, and Gloo aborts the process ("Received data size doesn't match
    expected size"). One ``process_allgather`` of two integers where they agree; the names cross where they don't."""
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    lines, fingerprint = policies.variable_lines(variables)
    every = np.asarray(multihost_utils.process_allgather(np.asarray(fingerprint, np.int64)))
    if (every == every[0]).all():
        return
    text = "\n".join(lines).encode()
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(text)], np.int64))).reshape(-1)
    padded = np.zeros(max(1, int(lengths.max())), np.uint8)
    padded[:len(text)] = np.frombuffer(text, np.uint8)
    texts = np.asarray(multihost_utils.process_allgather(padded))
    held = [[line for line in bytes(row[:n]).decode().split("\n") if line] for row, n in zip(texts, lengths)]
    raise policies.variables_differ(held, list(range(len(held))))


def _take_rank0_values(model):
    """Every variable of ``model`` (weights, seed-generator states, optimizer and metric state) takes process 0's
    value, in one ``broadcast_one_to_all``: a process that built its model from another seed (or none) would
    otherwise hand ``jax.device_put`` different values for one replicated array, which JAX refuses with an
    AssertionError that prints the arrays. TensorFlow and PyTorch broadcast rank 0's values alike."""
    import numpy as np
    from jax.experimental import multihost_utils

    variables = keras_model.state_variables(model)
    _check_same_variables(variables)
    values = multihost_utils.broadcast_one_to_all([np.asarray(v.value) for v in variables])
    for variable, value in zip(variables, values):
        variable.assign(value)


def _board(cluster):
    """The job's :class:`~distkeras.backends.agreement.Board` on ``jax.distributed``'s key-value store.

    Private API, on purpose: JAX keeps its distributed client in ``jax._src.distributed.global_state`` (its own
    ``multihost_utils`` reads it there too); the client's ``key_value_set`` refuses to overwrite an entry (the
    first writer wins) and ``key_value_try_get`` doesn't wait. Pinned by tests/backends/test_multiprocess_basics.py.
    """
    from jax._src import distributed

    client = distributed.global_state.client

    def read(key):
        try:
            return client.key_value_try_get(key)
        except Exception as exc:  # jaxlib's XlaRuntimeError: NOT_FOUND
            if "NOT_FOUND" in str(exc):
                return None
            raise

    def post(key, value):
        try:
            client.key_value_set(key, value)
            return value
        except Exception as exc:  # ALREADY_EXISTS: another process wrote it first
            if "ALREADY_EXISTS" not in str(exc):
                raise
            return client.key_value_try_get(key)

    return agreement.Board(post, read, cluster.rank, cluster.world_size)


def _sum_over_processes(vector):
    """The sum over the processes of a float32 vector (``process_allgather``, every process calling it)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(vector, np.float32))).sum(axis=0)


def _broadcast_bytes(data):
    """Process 0's ``data`` (bytes) on every process: ``broadcast_one_to_all`` of a buffer of one size
    (:data:`~distkeras.backends.policies.BROADCAST_BYTES`, after a 4-byte length), every process calling it."""
    import numpy as np
    from jax.experimental import multihost_utils

    size = policies.BROADCAST_BYTES
    if len(data) > size:
        raise ValueError("Expected at most {} bytes to broadcast. Received: {} bytes".format(size, len(data)))
    buffer = np.frombuffer((len(data).to_bytes(4, "little") + data).ljust(4 + size, b"\0"), np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()
    return received[4:4 + int.from_bytes(received[:4], "little")]


def _local_devices():
    """(Device, jax device) pairs, accelerators first; the index counts devices of one kind."""
    import jax

    kinds = [jax.default_backend()] + (["cpu"] if jax.default_backend() != "cpu" else [])
    found = []
    for kind in kinds:
        if kind not in ("cpu", "gpu", "tpu"):
            continue
        try:
            local = jax.local_devices(backend=kind)
        except RuntimeError:  # no such platform in this JAX
            continue
        found.extend((Device(kind, index), device) for index, device in enumerate(local))
    return found


def _with_flag(flags, name, value):
    """``flags`` (space-separated, as in XLA_FLAGS) with ``name=value`` replacing any earlier value."""
    kept = [f for f in flags.split() if f != name and not f.startswith(name + "=")]
    return " ".join(kept + ["{}={}".format(name, value)])


def _set_jax_cpu_count(count):
    import jax

    if not hasattr(jax.config, "jax_num_cpu_devices"):  # older JAX: XLA_FLAGS alone, checked by distribute()
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend has started; fine if it started with this count
        current = len(jax.devices("cpu"))
        if current != count:
            raise TooLateError(
                "JAX has already started with {} CPU device(s), so it can't be split into {} now. Call "
                "distkeras.use_cpu_devices({}) (or set DISTKERAS_CPU_DEVICES={}) before building any model or "
                "running any JAX op.".format(current, count, count, count)
            )


def _model_parallel(keras, model, mesh_devices, layout_map, model_shards):
    """Keras' ``ModelParallel`` over a ("batch", "model") mesh of ``mesh_devices`` (every process' devices across
    processes), the layout read and checked by the one layout API (:mod:`distkeras.parallel.layouts`)."""
    grid = layouts.mesh(len(mesh_devices), model_shards)
    variables = [(v.path, tuple(v.shape)) for v in model.weights]
    if layout_map is None:
        rules = layouts.default_rules(variables, grid.model_shards, model.name)
    else:
        try:
            rules = layouts.rules(layout_map)
        except OptionError as exc:
            raise OptionError("Bad layout_map for mesh axes 'batch' and 'model': {}".format(exc))
    mesh = keras.distribution.DeviceMesh(tuple(grid), list(layouts.AXES), mesh_devices)
    keras_layouts = keras.distribution.LayoutMap(mesh)
    try:
        for key, axes in rules.items():
            keras_layouts[key] = axes
        for path, _ in variables:  # as ModelParallel will look them up: a path two keys match is refused
            keras_layouts[path]
    except (ValueError, TypeError) as exc:  # from Keras' LayoutMap/TensorLayout
        raise OptionError("Bad layout_map for mesh axes 'batch' and 'model': {}".format(exc))
    layouts.assign(variables, rules, grid)
    return keras.distribution.ModelParallel(layout_map=keras_layouts, batch_dim_name=layouts.BATCH)


def _scoped(method, model, distribution, name=None):
    """``method`` run under ``distribution``, with any variable created outside it moved onto the mesh.
    ``fit``/``evaluate``/``predict`` also run marked as such, for the padding of uneven batches
    (:mod:`distkeras.backends.jax.uneven`); predict() returns without the padded rows."""
    from . import uneven as jax_uneven

    @functools.wraps(method)
    def call(*args, **kwargs):
        with distribution.scope():
            # The train function is made once the optimizer is built: every variable of the step exists.
            _lay_out(model, distribution, warn=name == "make_train_function")
            if name == "make_predict_function":
                result = method(*args, **kwargs)
                _gather_predictions(model)
                return result
            if name not in jax_uneven.MODES:
                return method(*args, **kwargs)
            with jax_uneven.running(model, name) as running:
                result = method(*args, **kwargs)
            return jax_uneven.drop_padding(result, running) if name == "predict" else result

    return call


def _gather_predictions(model):
    """Across processes, the predict function's outputs as whole arrays on every process.

    A batch's outputs are laid out along the "batch" axis, which spans processes: each process holds only its
    devices' rows, and Keras' predict() then fails converting them to NumPy ("spans non-addressable devices").
    The function Keras made (``model.predict_function``, which predict() and predict_on_batch() call) is wrapped
    once to gather each output (``process_allgather``, a collective every process enters at the same batch, as
    they all run predict() together)."""
    import jax

    function = model.predict_function
    if jax.process_count() == 1 or function is None or getattr(function, "distkeras_gathers", False):
        return
    from jax.experimental import multihost_utils

    def whole(value):
        if not isinstance(value, jax.Array) or value.is_fully_addressable or value.is_fully_replicated:
            return value
        return multihost_utils.process_allgather(value, tiled=True)

    def gathered(state, iterator):
        outputs, state = function(state, iterator)
        return jax.tree_util.tree_map(whole, outputs), state

    gathered.distkeras_gathers = True
    model.predict_function = gathered


def _lay_out(model, distribution, warn=False):
    """Every variable of ``model`` (its metrics' and optimizers' too) as an array laid out on the mesh.

    Also run before every scoped call: variables made outside the distribution since (a metric or
    optimizer object created before a later ``compile()``, weights set from NumPy) sit on one device, and
    Keras' jitted step refuses to mix them with the mesh's."""
    import keras

    _check_same_variables(keras_model.state_variables(model))
    if getattr(distribution, "shard", None) is not None:
        from . import shard as jax_shard

        # Optimizers set or built since (compile() after distribute(), a slot made outside the scope).
        jax_shard.hook_optimizers(model, distribution)
        replicated = jax_shard.assign_layouts(model, distribution)
        if warn:
            jax_shard.warn_replicated(model, distribution, replicated)
    for v in keras_model.state_variables(model):
        value = v.value
        layout = distribution.get_variable_layout(v)
        if not value.sharding.is_equivalent_to(layout.backend_layout, len(value.shape)):
            v.assign(keras.distribution.distribute_tensor(value, layout))


def _assign_layouts(model, distribution):
    """Give every variable of ``model`` the layout ``distribution`` has for it, as Keras does for a variable
    it creates under a distribution: in the variable's private ``_layout``, which Keras reads back when it
    assigns the variable (``set_weights`` keeps the layout) and when an optimizer creates a slot from it
    (``add_variable_from_reference``: Adam's moments of a sharded kernel are sharded alike). An optimizer
    slot made before distribute() takes the layout of the model variable it was made from: Keras names it
    ``<optimizer>/<that variable's path, "/" as "_">_<slot>``. Pinned by a test."""
    from keras.distribution import TensorLayout

    if getattr(distribution, "shard", None) is not None:
        return  # its own rule, applied by _lay_out
    by_name = {v.path.replace("/", "_"): v for v in model.trainable_variables}
    optimizer_variables = {id(v) for o in keras_model.all_optimizers(model) for v in o.variables}
    for v in keras_model.state_variables(model):
        v._layout = None  # an earlier distribution's layout
        reference = None
        if id(v) in optimizer_variables:
            name = v.path.partition("/")[2]
            matches = [key for key in by_name if name.startswith(key + "_")]
            candidate = by_name[max(matches, key=len)] if matches else None
            if candidate is not None and tuple(candidate.shape) == tuple(v.shape):
                reference = candidate
        layout = distribution.get_variable_layout(reference if reference is not None else v)
        v._layout = TensorLayout(layout.axes, layout.device_mesh) if reference is not None else layout


def _check_shard_combination(shard, strategy, compression):
    """``shard`` works with strategy='data', and with compression unless it is "all"; otherwise an OptionError
    saying why."""
    if shard is None:
        return
    if strategy != "data":
        raise OptionError(
            "shard={!r} applies to strategy='data' on JAX: it splits the training state along the mesh's data axis, "
            "and strategy='model' lays every variable out by its layout_map over a ('batch', 'model') mesh. Received: "
            "strategy={!r}, shard={!r}. Use strategy='data' with shard=, or split weights (and with them their "
            "optimizer slots) over both axes in layout_map yourself, e.g. {{'.*dense.*kernel': ('batch', 'model')}}: "
            "XLA then gathers them per step, as shard='all' does.".format(shard, strategy, shard))
    if compression is not None and shard == "all":
        raise OptionError(
            "shard='all' and compression={!r} don't combine on JAX: shard='all' lets XLA partition the step by the "
            "weights' layout, and the compressed step computes each shard's gradient with the weights gathered whole "
            "(measured: more memory per device than XLA's partitioning). Received: shard='all', compression={!r}. Use "
            "shard='gradients' or 'optimizer' with compression=, or drop one of them.".format(compression, compression))


def _coordinator_bind(cluster, parameters):
    """Rank 0's coordination service listens where the others connect (``coordinator_bind_address``), not on
    JAX's default ``[::]:PORT``, every interface (jax/_src/distributed.py); a JAX_COORDINATOR_BIND_ADDRESS the
    user set wins, and where no single address is sure (:func:`distkeras.launch.network.listen_address`) JAX keeps
    its default."""
    from ...launch import network

    if (cluster.rank != 0 or "coordinator_bind_address" not in parameters
            or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip()):
        return {}
    host, port = network.parse_address(cluster.coordinator)
    address = network.listen_address(host)
    if address is None:
        return {}
    return {"coordinator_bind_address": "{}:{}".format(network.bracket(address), port)}


def _gloo_on(interface):
    """Make the CPU client's Gloo collectives use ``interface`` (the one that reaches the coordinator).

    Private API, on purpose: ``jax._src.xla_bridge.make_cpu_client`` creates its Gloo TCP collectives
    without an interface, and Gloo then advertises the address the host name resolves to, a loopback one on
    stock Debian/Ubuntu hosts, so processes on other hosts can't connect. jaxlib's
    ``make_gloo_tcp_collectives`` takes the interface, and ``make_cpu_client`` takes ready collectives, so the
    registered CPU factory is replaced by one that passes both. Runs before JAX's first computation (the
    client is made lazily). Pinned by tests/backends/test_jax.py.
    """
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    registration = xla_bridge._backend_factories["cpu"]

    def factory():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, interface=interface)
        return xla_bridge.make_cpu_client(collectives=collectives)

    factory.distkeras_interface = interface
    registration.factory = factory
