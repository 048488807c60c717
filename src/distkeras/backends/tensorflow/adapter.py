"""TensorFlow adapter: ``tf.distribute.MirroredStrategy`` over the resolved devices.

The user built the model outside any strategy scope. The adapter distributes that very model, in place:
the storage of each of its variables (weights, metrics, optimizer slots) is re-created under the
strategy's scope, which makes it a mirrored variable holding the same value on every device, and the
model and its optimizer are told the strategy, as if they had been created inside ``strategy.scope()``.
Nothing is rebuilt from a config, so subclassed models without ``get_config`` work, and the weights are
never held twice. tf.keras 2.x models (the ``tf_keras`` package, ``TF_USE_LEGACY_KERAS=1``) are the
exception: their layers hold their ``tf.Variable`` objects directly, so they are rebuilt in the scope.

What the adapter changes so that every step is exactly the single-device step at the same global batch
(each an instance attribute, installed by :func:`keras_model.hook`; nothing of it is saved):

- **One loss rule, replicas weighed by their share of the batch** (``exact_loss_scaling=True``, the
  default; :mod:`.steps`). Keras divides some losses by the replica count and not others (a
  loss function returning a scalar, a ``Loss`` object or ops called by hand in a custom step), and weighs
  the replicas equally even when a batch splits unevenly or leaves a replica empty. While a replica runs
  a step, every loss it computes is its own mean over its rows, however it is written (compiled loss,
  ``compute_loss``, a ``Loss`` object or ops in a ``GradientTape`` step, ``add_loss``, a custom
  ``test_step``), and ``optimizer.apply`` hands the optimizer ``sum_r (n_r / N) * g_r``: the gradient of
  one device's mean. Each replica knows its rows: on one host ``strategy.run`` holds every replica's batch
  before they start (no communication); across workers the replicas all-gather their batch sizes (a
  scalar per step). ``exact_loss_scaling=False`` keeps Keras' own rule. tf.keras 2.x models, which use
  no Keras 3 loss code, keep a correction of their ``compute_loss`` (:func:`_weigh_replicas_by_batch_share`).
- **Random draws of one device.** ``keras.random.*``, Dropout and its variants, GaussianNoise, the
  augmentation layers and seed generators in custom layers draw, on each replica, one device's values for
  its rows of the global batch (see :mod:`.steps` for which functions are exact). So do TensorFlow's
  ``tf.random.stateless_*`` and, given an op seed, ``tf.random.normal``/``uniform``/``truncated_normal`` called in
  a custom step (keras-io's WGAN-GP); without an op seed, and ``tf.random.Generator``, they draw independently per
  replica: TensorFlow seeds such an op from the count of ops traced before it, which no other program shares
  (:func:`tensorflow_steps.draw_tf_like_one_device`).
- **Every optimizer of the model.** ``model.optimizer``, the optimizer a LossScaleOptimizer wraps, and
  optimizers held in the model's attributes (a GAN's ``d_optimizer``, ``g_optimizer`` given to its own
  ``compile()``), at ``distribute()`` and after each ``compile()``: told the strategy, their variables
  mirrored, their ``apply`` given the global gradient as below. One first used inside a step is built
  once, in the cross-replica context.
- **Sparse gradients stay sparse.** An ``IndexedSlices`` gradient (Embedding, ``ops.take``) is weighed
  and all-reduced as slices, i.e. concatenated in replica order: one slice per lookup of the global batch,
  which is what Keras' TensorFlow optimizers see on one device (Adam squares each slice apart there, so
  a dense sum, Horovod's ``sparse_as_dense``, would train something else). A gather whose indices are
  computed from no sample (a position embedding's ``arange(maxlen)``: the same indices on every replica)
  has, on one device, one slice per index holding the whole batch's sum: its values are all-reduced under
  those indices (:func:`tensorflow_steps.depends_on_batch` walks the traced step to tell them apart).
- **A step's logs.** Every metric's ``result()`` read inside a step is the global batch's (one all-reduce of
  its variables), so per-batch logs (callbacks, the progress bar) are one device's for AUC, Precision or
  counts too, where Keras would average each replica's own. A custom ``train_step`` / ``test_step``'s other
  scalars are weighed by batch share, so History and ``evaluate()`` show one device's values
  (:func:`tensorflow_steps.one_device_step_logs`).
  Metrics Keras builds after ``distribute()`` (a compiled metric first built by fit()) are mirrored too.
- **Batches smaller than the replica count.** A replica a batch leaves without rows runs Keras'
  convolutions and poolings on one row of zeros and keeps none of it: TensorFlow's oneDNN kernels
  mishandle an empty batch (:func:`tensorflow_steps.convolve_empty_batches`).
- **The optimizer sees the global gradient.** Keras 3 clips (``clipnorm``, ``global_clipnorm``,
  ``clipvalue``), accumulates and checks loss-scaled gradients for overflow in ``optimizer.apply``
  *before* its TensorFlow optimizer all-reduces them, i.e. on each replica's partial gradient. The
  adapter all-reduces first, in ``apply``, and turns the optimizer's own later all-reduce off (:mod:`.mirror`).
- **Synchronized BatchNormalization** (``sync_batchnorm=True``, the default): in training, every
  replica normalises with the mean and variance of the whole global batch (one all-reduce, with
  gradients through it), so N devices train what one device trains; which layers, and what happens to
  subclasses, is :mod:`distkeras.backends.batchnorm`'s rule. The layer's config is unchanged.
"""

import functools
import itertools
import json
import logging
import os
import weakref
from typing import List

from ... import cluster as cluster_lib
from ...verify import datacheck
from ...launch import exchange, network
from ...devices import Device
from ...environments import tf_config
from ...errors import ClusterError, DistKerasError, ModelError, NetworkError, OptionError, TooLateError
from .. import agreement, batchnorm, keras_model, policies, when_imported
from ..base import COMPRESSION_HELP, Adapter, check_compression, pin_local_gpus
from . import batches as tensorflow_batches
from . import loops as tensorflow_loops
from . import mirror as tensorflow_mirror
from . import steps as tensorflow_steps

_CROSS_DEVICE_OPS = ("nccl", "hierarchical_copy", "reduction_to_one_device")
#: Strategy -> its traced any_process collective.
_agreements = weakref.WeakKeyDictionary()
#: distribute()'s ``batch_logs`` values.
_BATCH_LOGS = ("global", "local")
#: The model's instance attribute that holds its pipeline plan (``backends.tensorflow.pipeline.PLAN``, read by name
#: here: importing that module imports TensorFlow).
_PIPELINE = "_distkeras_pipeline"
_strategy_serial = itertools.count(1)  # 0 stays the base of strategies made without distkeras
logger = logging.getLogger("distkeras")


class TensorFlowAdapter(Adapter):
    name = "tensorflow"
    framework = "tensorflow"
    late_variables = True
    install_hint = "tensorflow (or tensorflow-cpu)"
    model_parallel_unsupported = (
        "Keras 3 gives TensorFlow no model-parallel distribution (keras.distribution's ModelParallel is JAX's), and "
        "pinning layers with tf.device inside fit() places only the forward pass: the backward pass and the "
        "optimizer's slots stay on one device")
    shard_unsupported = (
        "MirroredStrategy and MultiWorkerMirroredStrategy keep a full copy of every variable on every replica; TF's "
        "sharded variables belong to ParameterServerStrategy, and the DTensor layouts of Keras' TF distribution "
        "prototype are deprecated (keras/src/backend/tensorflow/distribution_lib.py opens with \"DO NOT USE\")")
    options = {
        "cross_device_ops": "how MirroredStrategy all-reduces: " + ", ".join(_CROSS_DEVICE_OPS),
        "exact_loss_scaling": "every loss a replica's own mean, gradients weighed by each replica's share of the "
                              "global batch (default True); False: Keras' own rule (losses divided by the replicas)",
        "sync_batchnorm": batchnorm.OPTION_HELP,
        "compression": COMPRESSION_HELP,
        "batch_logs": "'global' (default): each batch's logs are one device's (every metric result read in a step "
                      "is the global batch's, one all-reduce of the metrics' variables a step; on one host); "
                      "'local': Keras' own average of each replica's results (not one device's for AUC, Precision "
                      "or counts)",
        "pipeline_stages": "pipeline parallelism in this process: the number of stages to cut the model into (balanced "
                           "by parameters) or the layer names to cut after; one device per stage per replica (devices = stages x replicas)",
        "microbatches": "pipeline_stages: micro-batches per batch (default: 2 x stages)",
        "schedule": "pipeline_stages: 'gpipe' (every forward, then every backward; the default) or '1f1b' (fewer "
                    "activations held)",
    }

    @classmethod
    def engine_ports(cls, nproc_per_node):
        """Every worker's gRPC server listens on its own port: ``nproc_per_node`` of them on every host."""
        return nproc_per_node

    @classmethod
    def workers_env(cls, job, environ):
        """TF_CONFIG for each worker of this host: on one host each worker on a free loopback port; across hosts
        worker ``i`` of a host on the engine's port + ``i`` at the host's agreed address.

        The address is where the others connect, not where the worker listens: TensorFlow's gRPC server binds
        every interface whatever TF_CONFIG says (GrpcServer::Init, tensorflow/core/distributed_runtime/rpc/
        grpc_server_lib.cc: ``AddListeningPort(strings::StrCat("0.0.0.0:", requested_port), ...)``), and nothing
        it reads names another (issue 35; tests/backends/test_engine_binding.py)."""
        if job.nnodes == 1:
            workers = ["127.0.0.1:{}".format(network.free_port()) for _ in range(job.nproc_per_node)]
        else:
            base = network.parse_address(job.engine)[1]
            workers = ["{}:{}".format(network.bracket(host), base + i) for host in job.addresses
                       for i in range(job.nproc_per_node)]
        first = job.node_rank * job.nproc_per_node
        return [{"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": first + i}})}
                for i in range(job.nproc_per_node)]

    def pass_over_function(self, take):
        """Keras' TensorFlow trainer calls its train function with the iterator it takes batches from."""

        def passed_over(iterator):
            take(iterator)
            return {}

        return passed_over

    def __init__(self):
        self._multi_worker = None  # this process' MultiWorkerMirroredStrategy: TensorFlow allows one
        self._multi_worker_error = None

    def prepare(self, cluster):
        pin_local_gpus(cluster)  # before TensorFlow lists its GPUs: MultiWorkerMirroredStrategy takes all it sees
        when_imported("tensorflow", lambda: self._start_multi_worker(cluster))

    def _start_multi_worker(self, cluster=None):
        """Create MultiWorkerMirroredStrategy right after TensorFlow is imported, before any op runs:
        TensorFlow configures its collectives once, at start-up. Runs inside the user's import of
        TensorFlow, so a failure is kept and raised by distribute() instead."""
        import tensorflow as tf

        try:
            if cluster is not None:
                write_tf_config(cluster)
            self._multi_worker = tf.distribute.MultiWorkerMirroredStrategy()
        except Exception as exc:  # raised again, with advice, by distribute()
            self._multi_worker_error = exc

    def list_devices(self) -> List[Device]:
        import tensorflow as tf

        local = _local_task_prefix()
        found = []
        for logical in tf.config.list_logical_devices():
            if local and "/job:" in logical.name and not logical.name.startswith(local):
                continue  # another worker's device, listed once MultiWorkerMirroredStrategy has started
            kind, _, index = logical.name.rpartition("/device:")[2].rpartition(":")
            if kind.lower() in ("cpu", "gpu", "tpu"):
                found.append(Device(kind.lower(), int(index)))
        return sorted(found, key=lambda d: (d.kind == "cpu", d.kind, d.index))

    def set_cpu_devices(self, count):
        if cluster_lib.from_env().is_multi_worker:
            return  # MultiWorkerMirroredStrategy replicates over a worker's GPUs, or its one CPU
        when_imported("tensorflow", lambda: _split_cpu(count))

    def any_process(self, model, flag):
        """The flag summed over the replicas of the model's strategy: a cross-worker collective under
        MultiWorkerMirroredStrategy; one process (MirroredStrategy, or no strategy) needs none."""
        import tensorflow as tf

        strategy = getattr(model, "distribute_strategy", None)
        if strategy is None or not cluster_lib.from_env().is_multi_worker:
            return bool(flag)
        agree = _agreements.get(strategy)
        if agree is None:  # traced once per strategy: 3.5 ms a call on 2 CPU workers, eager strategy.run 9 ms

            @tf.function
            def agree(value):
                return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(tf.identity, (value,)), axis=None)

            _agreements[strategy] = agree
        return bool(int(agree(tf.constant(int(bool(flag))))) > 0)

    def model_shards(self, model):
        """The pipeline stages ``model`` is cut into (1: not split, every device a replica)."""
        plan = model.__dict__.get(_PIPELINE) if hasattr(model, "__dict__") else None
        return plan.stages if plan is not None else 1

    def verify(self, model, check):
        """The one-device check (:mod:`.verify`): on the replicas of one host or of every worker, and on a model cut
        into pipeline stages (its whole step replayed as one device's)."""
        from . import verify as tensorflow_verify
        from .. import verifying

        if hasattr(model, "__dict__") and _PIPELINE in model.__dict__:
            check.backend += ", {} pipeline stages".format(model.__dict__[_PIPELINE].stages)
            verifying.install(model, check, tensorflow_verify.wrap_pipeline(model, check))
            return
        verifying.install(model, check, tensorflow_verify.wrap(model, check, cluster_lib.from_env().is_multi_worker))

    def check_data(self, model, mode, rank, workers):
        """The data check across workers: each worker's pipeline fingerprints its first global batch of every pass
        (:mod:`.datacheck`), and the workers compare them through the strategy's collectives."""
        import tensorflow as tf

        from .. import datawatch
        from . import datacheck as tensorflow_datacheck

        strategy = getattr(model, "distribute_strategy", None)
        if strategy is None or _PIPELINE in getattr(model, "__dict__", {}):
            logger.info("the data check doesn't run on a TensorFlow model cut into pipeline stages")
            return
        all_sum = tensorflow_batches.sum_over_workers(tf, strategy)
        datawatch.hook(model, datacheck.Watch(mode, rank, workers, all_sum, self.name,
                                              wrap_adapter=tensorflow_datacheck.wrapper(tf),
                                              read=tensorflow_datacheck.read))

    def distribute(self, model, devices, cluster, cross_device_ops=None, exact_loss_scaling=True, sync_batchnorm=True,
                   compression=None, batch_logs="global", pipeline_stages=None, microbatches=None, schedule="gpipe"):
        import tensorflow as tf

        if pipeline_stages is not None or microbatches is not None or schedule != "gpipe":
            keras_model.refuse_stateful_rnns(model, "TensorFlow", "pipeline stages run every batch in microbatches")
            keras_model.pipeline_loss_rule(model)
            return _pipeline(model, devices, cluster, pipeline_stages, microbatches, schedule, dict(
                cross_device_ops=(cross_device_ops, None), compression=(compression, None)))
        compression = check_compression(compression)
        if batch_logs not in _BATCH_LOGS:
            raise OptionError("Expected batch_logs in {}. Received: batch_logs={!r}".format(_BATCH_LOGS, batch_logs))
        if not isinstance(exact_loss_scaling, bool):
            raise OptionError("Expected True or False for exact_loss_scaling. Received: exact_loss_scaling={!r}".format(
                exact_loss_scaling))
        sync_batchnorm = batchnorm.check_option(sync_batchnorm)
        replicas = self.replicas(devices, cluster)
        if replicas > 1:
            keras_model.refuse_stateful_rnns(
                model, "TensorFlow", "each of the {} replicas runs its own share of every batch".format(replicas))
        if cluster.is_multi_worker:
            strategy = self._multi_worker_strategy(tf, cluster, devices)
        else:
            strategy = _mirrored_strategy(
                tf, ["/{}:{}".format(d.kind, d.index) for d in devices], _cross_device_ops(tf, cross_device_ops)
            )
        if keras_model.keras_package(model) == "tf_keras":
            if not model.built:
                raise ModelError(
                    "This tf.keras 2.x {} is not built, and distkeras rebuilds tf.keras 2.x models inside the "
                    "strategy from their weights. Build it first: give it an Input layer, call "
                    "model.build(input_shape), or call it once on a batch (model(x[:1])).".format(type(model).__name__)
                )
            if compression is not None:
                raise OptionError("compression needs Keras 3; tf.keras 2.x all-reduces inside its own optimizer. "
                                  "Received: compression={!r}".format(compression))
            # tf.keras 2.x layers keep their tf.Variable objects as plain attributes (``self.kernel``), with no
            # storage to re-create behind them: the model is rebuilt inside the scope. Its optimizer already
            # clips after the all-reduce (``apply_gradients`` aggregates first).
            with strategy.scope():
                new = keras_model.clone(model)
                keras_model.compile_like(new, model)
            model = new
            if exact_loss_scaling and _uses_default_compute_loss(model):
                # tf.keras 2.x divides every compiled loss by the replica count; re-weighed by batch share.
                global_batch = None if cluster.is_multi_worker else _global_batch_of_each_run(tf, strategy)
                _weigh_replicas_by_batch_share(model, tf, strategy.num_replicas_in_sync, global_batch)
        else:
            # Hand-written loops (distkeras.loops): before the optimizers' apply is hooked, which wraps the checked one.
            tensorflow_loops.install(model, tf, strategy, functools.partial(
                tensorflow_mirror.adopt, tf=tf, strategy=strategy, compression=compression))
            tensorflow_mirror.mirror_in_place(model, tf, strategy, compression)
            tensorflow_mirror.global_gradient_first(model, tf, strategy, compression)
            _batchnorm_moments(model, tf, sync_batchnorm, cluster.rank)
            # Each replica told its rows of the global batch; losses and random draws follow one device's rules.
            tensorflow_steps.tell_replicas_their_rows(tf, strategy, exact_loss_scaling)
            tensorflow_steps.gate_keras_loss_scaling()
            tensorflow_steps.draw_like_one_device(tf)
            tensorflow_steps.draw_tf_like_one_device(tf)
            keras_model.weigh_scalar_means(model, tensorflow_steps.scalar_share(tf, strategy.num_replicas_in_sync))
            tensorflow_steps.convolve_empty_batches(tf)
            # Across workers, Keras' own steps keep Keras' average: an all-reduce of the metrics' variables inside
            # a MultiWorkerMirroredStrategy step fails ("destinations can not be empty").
            tensorflow_steps.one_device_step_logs(tf, model, keras_model.keras_module(model).Model,
                                                  keras_steps=batch_logs == "global" and not cluster.is_multi_worker)
            _predict_on_batch_as_one_batch(model)
            _steps_of_an_execution_one_by_one(model, tf)
        tensorflow_mirror.build_from_one_replica(model, tf, strategy)
        if cluster.is_multi_worker:
            _reducible_step_logs(model, tf)
            tensorflow_batches.py_datasets_as_global_batches(model, tf)
            tensorflow_batches.same_shuffle_on_every_worker(model, tf, strategy, cluster.rank)
        agreement.use(_board(cluster) if cluster.is_multi_worker else None)  # saves and predict()/evaluate()
        policies.rank0_speaks_and_writes(model, cluster.rank)
        return model

    def _multi_worker_strategy(self, tf, cluster, devices):
        if self._multi_worker is None and self._multi_worker_error is None:
            self._start_multi_worker(cluster)  # writes TF_CONFIG where the environment gives the workers
        if isinstance(self._multi_worker_error, (ClusterError, NetworkError)):
            raise self._multi_worker_error  # TF_CONFIG couldn't be formed: say why, not "import earlier"
        # MultiWorkerMirroredStrategy reads TF_CONFIG: `distkeras launch` sets it, so may the user or a cluster
        # manager, and write_tf_config() writes it from the environment's workers (Slurm) or torchrun's store.
        if not os.environ.get("TF_CONFIG", "").strip():
            raise ClusterError(
                "This process is rank {} of {} ({} variables), but TensorFlow's MultiWorkerMirroredStrategy reads "
                "TF_CONFIG, and that environment names no worker addresses to write it from. Start the workers "
                "with `distkeras launch` or torchrun, or set TF_CONFIG on every worker.".format(
                    cluster.rank, cluster.world_size, cluster.source
                )
            )
        if self._multi_worker is None:
            raise TooLateError(
                "This process is worker {} of {} (TF_CONFIG), and TensorFlow sets up its cross-worker collectives "
                "once, before its first op; that failed ({}: {}). Import distkeras before building any model "
                "or running any TensorFlow op.".format(
                    cluster.rank, cluster.world_size, type(self._multi_worker_error).__name__, self._multi_worker_error
                )
            )
        local = len(self._multi_worker.extended.worker_devices)
        if len(devices) != local and any(d.is_accelerator for d in devices):
            raise DistKerasError(
                "MultiWorkerMirroredStrategy replicates over every GPU this worker sees ({}); devices={} asks for "
                "{}. Restrict the GPUs with CUDA_VISIBLE_DEVICES instead.".format(
                    local, [str(d) for d in devices], len(devices)
                )
            )
        return self._multi_worker


def _pipeline(model, devices, cluster, stages, microbatches, schedule, others):
    """Cut ``model`` into pipeline stages over ``devices`` of this process (:mod:`.pipeline`), every option checked
    first (:func:`distkeras.parallel.pipeline.plan_in_process`): one device per stage and replica, one process, no other way of
    splitting, a Keras 3 model."""
    from ...parallel import pipeline
    from . import pipeline as tensorflow_pipeline

    if stages is not None and keras_model.keras_package(model) == "tf_keras":
        raise OptionError("pipeline_stages needs a Keras 3 model; this is a tf.keras 2.x {}.".format(
            type(model).__name__))
    parts, microbatches = pipeline.plan_in_process(model, stages, microbatches, schedule, others, cluster, devices,
                                                   "TensorFlow")
    keras_model.unhook(model)  # an earlier distribute()'s hooks
    names = ["/device:{}:{}".format(d.kind.upper(), d.index) for d in devices]
    plan = tensorflow_pipeline.Plan(model, parts, pipeline.stage_devices(names, len(parts)), microbatches, schedule)
    tensorflow_pipeline.install(model, plan)
    policies.rank0_speaks_and_writes(model, cluster.rank)
    return model


def _board(cluster):
    """The job's :class:`~distkeras.backends.agreement.Board` on TensorFlow's coordination service (which
    MultiWorkerMirroredStrategy starts): an entry is inserted once (AlreadyExistsError after), and a read that
    waits 1 ms stands for "none yet" (DeadlineExceededError)."""
    import tensorflow as tf
    from tensorflow.python.eager import context  # the coordination service's key-value store has no public API

    def read(key):
        try:
            return context.context().get_config_key_value(key, timeout_in_ms=1)
        except tf.errors.DeadlineExceededError:
            return None

    def post(key, value):
        try:
            context.context().set_config_key_value(key, value)
            return value
        except tf.errors.AlreadyExistsError:
            return context.context().get_config_key_value(key)

    return agreement.Board(post, read, cluster.rank, cluster.world_size)


def write_tf_config(cluster, environ=None):
    """Describe ``cluster`` in TF_CONFIG, which MultiWorkerMirroredStrategy reads when it starts, where the
    environment gave every worker's address but no TF_CONFIG (Slurm's tasks: ``cluster.workers`` from the host
    list), or torchrun's store gives them (:mod:`distkeras.launch.exchange`). A TF_CONFIG already there (the user's, a cluster manager's, ``distkeras launch``'s) is left alone.

    Returns:
        Whether it wrote TF_CONFIG.
    """
    import json
    import os

    env = os.environ if environ is None else environ
    if not cluster.is_multi_worker or env.get("TF_CONFIG", "").strip():
        return False
    workers = cluster.workers
    if not workers and environ is None and exchange.applies(cluster):
        workers = exchange.tf_workers(cluster)  # torchrun: every rank's address through its store
    if not workers:
        return False
    env["TF_CONFIG"] = env[tf_config.WRITTEN] = json.dumps(
        {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": cluster.rank}})
    return True


def _local_task_prefix():
    """``/job:worker/replica:0/task:1/`` for this worker when TF_CONFIG names it, else None."""
    import json
    import os

    try:
        task = json.loads(os.environ.get("TF_CONFIG", "") or "{}").get("task") or {}
        return "/job:{}/replica:0/task:{}/".format(task["type"], task["index"])
    except (ValueError, KeyError, AttributeError):
        return None


def _split_cpu(count):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:
        current = len(tf.config.list_logical_devices("CPU"))
        if current != count:
            raise TooLateError(
                "TensorFlow has already started with {} CPU device(s), so it can't be split into {} now. Call "
                "distkeras.use_cpu_devices({}) (or set DISTKERAS_CPU_DEVICES={}) before building any model or "
                "running any TensorFlow op.".format(current, count, count, count)
            )


def _mirrored_strategy(tf, names, cross_device_ops):
    """A MirroredStrategy whose collective group keys don't collide with an earlier strategy's.

    Every MirroredStrategy numbers its collective groups from 1, so a second strategy over a different
    device set in the same process joins group 1 with the wrong size and TensorFlow aborts ("joining a
    group with size 3, but that group has size 2"). TensorFlow's own tests offset the numbering with
    the class attribute ``_collective_key_base``; each strategy distkeras makes gets its own offset.
    """
    cls = tf.distribute.MirroredStrategy
    saved = cls.__dict__.get("_collective_key_base", 0)
    cls._collective_key_base = next(_strategy_serial) * 100000
    try:
        return cls(devices=names, cross_device_ops=cross_device_ops)
    finally:
        cls._collective_key_base = saved


def _cross_device_ops(tf, name):
    if name is None:
        return None
    if name not in _CROSS_DEVICE_OPS:
        raise OptionError("Expected cross_device_ops in {}. Received: cross_device_ops={!r}".format(_CROSS_DEVICE_OPS, name))
    if name == "nccl":
        return tf.distribute.NcclAllReduce()
    if name == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


def _steps_of_an_execution_one_by_one(model, tf):
    """``steps_per_execution > 1`` under the strategy: the execution's steps run one by one from Python.

    Keras' TensorFlow trainer runs an execution's steps in a ``tf.while_loop`` whose body calls the strategy's
    ``run`` inside a ``tf.cond``; under a MirroredStrategy that graph fails at its first call ("You must feed a value
    for placeholder tensor 'while/cond/Placeholder_N'"), plain Keras in ``strategy.scope()`` included. The function
    Keras makes (its private ``_make_function``: why this reaches there) runs the steps of a Python iterator one
    call each (its own fallback for iterators that aren't TensorFlow's); each execution's iterator is handed to it
    as such, so the steps, their number per execution and the callbacks' cadence stay Keras', and the step itself
    is the single step Keras traces for ``steps_per_execution=1``. Pinned by
    tests/backends/test_tensorflow_round2.py.
    """
    own = getattr(model, "_make_function", None)
    if own is None:
        return

    @functools.wraps(own)
    def make_function(step_function):
        function = own(step_function)

        def stepwise(iterator):
            if model.steps_per_execution == 1 or not isinstance(
                    iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                return function(iterator)
            first = iterator.get_next_as_optional()
            if not bool(first.has_value()):
                raise StopIteration

            def steps():
                yield first.get_value()
                for _ in range(model.steps_per_execution - 1):
                    following = iterator.get_next_as_optional()
                    if not bool(following.has_value()):
                        return
                    yield following.get_value()

            return function(steps())

        return stepwise

    keras_model.hook(model, "_make_function", make_function)


def _predict_on_batch_as_one_batch(model):
    """``predict_on_batch(x)`` as one device's: the rows of ``x``, each predicted once.

    Keras' TensorFlow ``predict_on_batch`` hands its batch to the predict function as it is, so under a strategy
    every replica runs the whole batch and the replicas' outputs are concatenated: N copies of the rows (24 rows
    for 12 on 2 replicas). ``predict()`` of that one batch splits its rows over the replicas and returns them once,
    in order: what one device's ``predict_on_batch`` returns. An instance hook; nothing is saved.
    """
    import keras

    own = model.predict_on_batch

    @functools.wraps(own)
    def predict_on_batch(x):
        leaves = keras.tree.flatten(x)
        rows = int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "shape", None) else 0
        if not rows:
            return own(x)
        return model.predict(x, batch_size=rows, verbose=0)

    keras_model.hook(model, "predict_on_batch", predict_on_batch)


def _batchnorm_moments(model, tf, sync_batchnorm, rank):
    """BatchNormalization layers normalise, in training, with the statistics of the global batch, by the
    rule of :mod:`distkeras.backends.batchnorm` (:func:`~distkeras.backends.batchnorm.select`; a warning
    names the layers it leaves for their own ``_moments``).

    The layer's private ``_moments`` (what ``call`` uses for the batch statistics) is replaced on the
    instance by :func:`~distkeras.backends.batchnorm.global_moments`, whose one collective is an all-reduce
    in the replica context (gradients flow through ``ReplicaContext.all_reduce``). With
    ``sync_batchnorm=False`` the layers whose ``_moments`` is Keras' own take their replica's statistics
    through the same formula, so a replica left without samples by a short batch gets zeros instead of NaN
    (which would reach the moving statistics). A call outside a replica context keeps Keras' own
    computation. Pinned by a test.
    """
    batchnorm.unhook(model)  # an earlier distribute()'s
    selection = batchnorm.select(model, sync_batchnorm)
    batchnorm.warn_left(selection, rank)
    per_replica = [layer for layer, reason in selection.left
                   if reason == batchnorm.NOT_ASKED and batchnorm.own_moments(layer) is None]
    for layers, synchronized in ((selection.synchronized, True), (per_replica, False)):
        for layer in layers:
            keras_model.hook(layer, batchnorm.MOMENTS, _moments(layer, getattr(type(layer), batchnorm.MOMENTS).__get__(layer),
                                                               tf, synchronized))
    return selection


def _moments(layer, keras_moments, tf, synchronized):
    import keras

    def moments(inputs, mask):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return keras_moments(inputs, mask)
        replicas = context.num_replicas_in_sync

        def gather(row):
            if not synchronized:
                return tf.expand_dims(row, 0)
            mine = tf.one_hot(context.replica_id_in_sync_group, replicas, dtype=row.dtype)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.reshape(mine, [replicas] + [1] * row.shape.rank) * row)

        return batchnorm.global_moments(keras.ops, tf.convert_to_tensor(inputs), layer._reduction_axes, mask, gather,
                                        keras.backend.epsilon())

    return moments


def _reducible_step_logs(model, tf):
    """Let Keras 3 average a step's logs over the workers of a MultiWorkerMirroredStrategy.

    Keras reduces each step's logs with ``strategy.reduce("MEAN", value, axis=0)`` under that strategy,
    which fails on the scalar logs every step returns ("Invalid reduction dimension 0 for input with 0
    dimensions"). Returning each scalar as a 1-element vector makes that reduce a plain mean. Only the
    per-step logs (the progress bar) pass through here; the epoch logs fit() returns are read from the
    metric variables, which the strategy sums over all workers.
    """
    def vector(value):
        if isinstance(value, tf.Tensor) and value.shape.rank == 0:
            return tf.reshape(value, [1])
        return value

    for name in ("train_step", "test_step"):
        step = getattr(model, name)
        keras_model.hook(model, name, lambda data, _step=step: tf.nest.map_structure(vector, _step(data)))


def _uses_default_compute_loss(model):
    keras = keras_model.keras_module(model)
    method = getattr(type(model), "compute_loss", None)
    return method is not None and method is getattr(keras.Model, "compute_loss", None)


def _global_batch_of_each_run(tf, strategy):
    """tf.keras 2.x (Keras 3 models use tensorflow_steps.tell_replicas_their_rows): have ``strategy.run`` tell its replicas the global batch size; returns the function that reads it.

    Keras runs a step as ``strategy.run(step, args=(data,))`` from the cross-replica context, where
    ``data`` holds every replica's batch (each leaf a ``DistributedValues``; on one host, one value per
    replica). The first dimensions of the first leaf's values add up to the global batch, computed there,
    before the replicas start; each replica's function is wrapped to hold it while the step runs, in a
    thread-local (MirroredStrategy runs every replica in a thread of its own, and traces them all into the
    graph ``run`` is called in). Patched on this strategy instance only, which distkeras made for this
    model. A run it can't read that way (arguments whose first leaf isn't one batch per replica, a step
    that is itself a ``tf.function``) goes through unchanged, and the reader returns None there.
    """
    import threading

    held = threading.local()
    run = strategy.run
    replicas = strategy.num_replicas_in_sync

    def batch_sum(args, kwargs):
        for leaf in tf.nest.flatten((args, kwargs)):
            if leaf is None:
                continue
            if not isinstance(leaf, tf.distribute.DistributedValues) or len(leaf.values) != replicas:
                return None
            if not all(isinstance(value, tf.Tensor) and value.shape.rank for value in leaf.values):
                return None
            return tf.add_n([tf.shape(value)[0] for value in leaf.values])
        return None

    def run_telling_global_batch(fn, args=(), kwargs=None, options=None):
        size = None
        if not isinstance(fn, tf.types.experimental.GenericFunction):
            size = batch_sum(args, kwargs)
        if size is None:
            return run(fn, args=args, kwargs=kwargs, options=options)

        def replica_fn(*replica_args, **replica_kwargs):
            outer = getattr(held, "size", None)
            held.size = size
            try:
                return fn(*replica_args, **replica_kwargs)
            finally:
                held.size = outer

        return run(replica_fn, args=args, kwargs=kwargs, options=options)

    strategy.run = run_telling_global_batch
    return lambda: getattr(held, "size", None)


def _weigh_replicas_by_batch_share(model, tf, replicas, global_batch=None):
    """For a tf.keras 2.x model: have its ``compute_loss`` (whose losses tf.keras divides by the replica count)
    weigh each replica's gradient by its share of the global batch (:func:`~distkeras.backends.policies.relative_share`,
    computed in the graph; an instance attribute: nothing of it is saved). ``global_batch()`` gives the step's global batch size where it is known
    without communication (see :func:`_global_batch_of_each_run`); elsewhere the replicas all-reduce
    their batch sizes."""
    original = model.compute_loss
    keras = keras_model.keras_module(model)
    custom_step = getattr(type(model), "train_step", None) is not getattr(keras.Model, "train_step", None)

    def compute_loss(*args, **kwargs):
        # Keras 3: (x, y, y_pred, sample_weight, training); tf.keras 2.x: (x, y, y_pred, sample_weight).
        total = original(*args, **kwargs)
        y_pred = kwargs["y_pred"] if "y_pred" in kwargs else args[2]
        context = tf.distribute.get_replica_context()
        if total is None or context is None or context.num_replicas_in_sync == 1:
            return total
        # Keras adds regularisation and add_loss() terms already divided by the replica count; they
        # don't depend on the batch and stay as they are.
        extra = [tf.reduce_sum(tf.cast(loss, total.dtype)) / replicas for loss in model.losses]
        extra = tf.add_n(extra) if extra else tf.zeros((), total.dtype)
        compiled = total - extra
        local = tf.cast(tf.shape(tf.nest.flatten(y_pred)[0])[0], total.dtype)
        known = global_batch() if global_batch is not None else None
        if known is not None:
            global_ = tf.cast(known, total.dtype)
        else:
            global_ = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
        share = policies.relative_share(local, global_, replicas, divide=tf.math.divide_no_nan)
        weighted = compiled * share + extra  # its gradient: this replica's share of the global batch's
        if custom_step:
            # A train_step of the user's (the Keras guide's GradientTape step) reports the value it gets:
            # the replica's own mean loss, not Keras' 1/replicas of it, which only Keras' step undoes.
            return tf.stop_gradient(total * replicas - weighted) + weighted
        # Same value as Keras reports; gradient weighted by this replica's share of the global batch.
        return tf.stop_gradient(total - weighted) + weighted

    keras_model.hook(model, "compute_loss", compute_loss)
