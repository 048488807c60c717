"""The public calls: resolve the backend, parse the devices, read the cluster, delegate to the adapter.

Glue only; every decision with a rule in it lives in a module of its own. Part of the Python
3.6-compatible core.
"""

import logging
import os
import sys
import weakref
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Union

from . import backends, sharding
from . import cluster as cluster_lib
from . import devices as devices_lib
from .verify import datacheck
from .verify import check as verify_lib
from .devices import CPU_DEVICES_ENV, Device
from .errors import ClusterError, DeviceSpecError, ModelError, ModelTypeError, TooLateError

if TYPE_CHECKING:  # the annotations only: importing distkeras imports no framework
    import keras

logger = logging.getLogger("distkeras")


_described: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _RankZero(logging.Filter):
    """Only rank 0 speaks; other ranks log warnings and errors only."""

    def filter(self, record):
        if record.levelno >= logging.WARNING:
            return True
        try:
            return cluster_lib.from_env().rank == 0
        except Exception:  # a malformed environment is reported by distribute(), not by a log line
            return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is logged (test runners and notebooks swap it)."""

    def emit(self, record):
        self.stream = sys.stderr
        super(_StderrHandler, self).emit(record)


def install_log_handler():
    if logger.handlers:
        return
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("distkeras: %(message)s"))
    handler.addFilter(_RankZero())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _check_count(count, what):
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise DeviceSpecError("Expected a positive int for {}. Received: {!r}".format(what, count))


def use_cpu_devices(count: int) -> None:
    """Split the host CPU into ``count`` devices, so data-parallel code runs on a machine without GPUs.

    TensorFlow gets ``count`` logical CPU devices, JAX ``count`` host-platform devices, PyTorch ``count``
    CPU worker processes. Call it before the backend initialises — before any model is built — or set
    ``DISTKERAS_CPU_DEVICES=count`` in the environment, which ``import distkeras`` applies.

    Args:
        count: the number of CPU devices, >= 1.

    Raises:
        DeviceSpecError: ``count`` is not a positive int.
        TooLateError: the backend already initialised its devices (with another count).

    Examples:
        >>> import distkeras
        >>> distkeras.use_cpu_devices(2)      # before building the model
    """
    _check_count(count, "use_cpu_devices(count)")
    backends.get(backends.active_name()).set_cpu_devices(count)
    # Worker processes started later inherit it. Set only once the backend took it: after a TooLateError
    # it would make every later distribute() in this process fail on a count the backend never had.
    os.environ[CPU_DEVICES_ENV] = str(count)


def apply_env_cpu_devices():
    """Applied at import: honour DISTKERAS_CPU_DEVICES; a problem is reported by distribute() instead."""
    value = os.environ.get(CPU_DEVICES_ENV, "").strip()
    if not value:
        return
    try:
        use_cpu_devices(int(value))
    except Exception as exc:  # import must not fail; _env_cpu_devices() re-raises it where it matters
        logger.debug("DISTKERAS_CPU_DEVICES=%s not applied at import: %s", value, exc)


def _check_not_an_unread_job(adapter):
    """No launch environment says this process is one of several, yet it is: a Ray Train worker whose trainer
    set no variables (JaxTrainer, DataParallelTrainer), or (the adapter asks its framework) a process whose
    engine someone else joined to several processes. Training alone would be silent: a ClusterError."""
    from .environments import ray as ray_environment

    found = ray_environment.unread_train_worker(os.environ)
    if found is not None:
        raise ClusterError(
            "Expected variables distkeras reads in this Ray Train worker, which is worker {} of {}; Ray's trainer "
            "set none (JaxTrainer and a plain DataParallelTrainer don't), and distkeras would train alone. "
            "Received: RAY_RAYLET_PID with no RANK / WORLD_SIZE and no TF_CONFIG. For JAX, call "
            "distkeras.environments.ray.prepare_jax() first in a DataParallelTrainer's train loop; for PyTorch "
            "and TensorFlow use TorchTrainer or TensorflowTrainer.".format(found[0], found[1])
        )
    adapter.check_alone()


def _env_cpu_devices() -> Optional[int]:
    value = os.environ.get(CPU_DEVICES_ENV, "").strip()
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise DeviceSpecError("Expected a positive int in {}. Received: {}={!r}".format(CPU_DEVICES_ENV, CPU_DEVICES_ENV, value))
    return count


def _check_virtual_cpus(available, name):
    requested = _env_cpu_devices()
    if requested is None or any(d.is_accelerator for d in available):
        return
    cpus = [d for d in available if d.kind == "cpu"]
    if len(cpus) != requested:
        raise TooLateError(
            "{}={} asks for {} CPU devices, but the {} backend had already started with {}. Import distkeras "
            "(or call distkeras.use_cpu_devices({})) before building any model or running any op.".format(
                CPU_DEVICES_ENV, requested, requested, name, len(cpus), requested
            )
        )


def _check_model(model):
    """A ModelTypeError unless ``model`` is a keras.Model (Keras 3, tf_keras or Keras 2: a class named Model of
    the keras package in its MRO; Sequential and functional models are subclasses). Nothing is imported."""
    package = backends.keras_package(model)
    if package is not None and any(cls.__name__ == "Model" and cls.__module__.split(".")[0] == package
                                   for cls in type(model).__mro__):
        return
    if package is not None:  # a layer: keras_package() takes layers too
        raise ModelTypeError(
            "Expected a Keras model (keras.Model, keras.Sequential, a functional model or a subclass). Received: "
            "{!r} of type {}, a Keras layer, not a model: it has no loss, optimizer or fit() to distribute. Wrap it "
            "in a model, e.g. model = keras.Sequential([keras.Input(shape=...), layer]), compile it, and distribute "
            "the model.".format(model, type(model).__name__))
    raise ModelTypeError(
        "Expected a Keras model (keras.Model, keras.Sequential, a functional model or a subclass). Received: {!r} "
        "of type {}, which is no Keras model. Build a keras.Model and distribute it.".format(
            model, type(model).__name__))


def _adapter_for(model):
    _check_model(model)
    return backends.get(backends.active_name(model))


def _check_not_moved(model, chosen, adapter, cluster):
    """A ModelError where ``model`` is distributed already, on other devices: its variables live there (mirrored,
    in other processes) and the adapter can't move them (returned unchanged, it trained on the first devices
    while describe() named the new ones). The same devices again are fine; an adapter that
    ``moves_distributed_models`` (JAX, in one process) lays it onto several other devices itself."""
    try:
        known = _described.get(model)
    except TypeError:
        known = None
    if known is None or not known["distributed"]:
        return
    asked = [str(d) for d in chosen]
    if adapter.moves_distributed_models and len(chosen) > 1 and not cluster.is_multi_worker:
        return
    if asked != known["devices"]:
        raise ModelError(
            "This {} is distributed already, on {} ({} backend), and distkeras can't move a distributed model: its "
            "variables live on those devices{}. Received: devices={}. Build the model again (or load it from a file "
            "model.save() wrote: that is the plain single-device model) and distribute the new one, or distribute "
            "it with the same devices as before.".format(
                type(model).__name__, ", ".join(known["devices"]), known["backend"],
                " (the {} backend moves a model onto several devices of one process only)".format(adapter.name)
                if adapter.moves_distributed_models else "", ", ".join(asked)))


def _record(model, adapter, devices, cluster, distributed):
    # Model parallelism: the devices (processes) training form a mesh of replicas x model shards.
    model_shards = getattr(adapter, "model_shards", None)
    shards = model_shards(model) if distributed and model_shards is not None else 1
    info = {
        "backend": adapter.name,
        "devices": [str(d) for d in devices],
        "replicas": adapter.replicas(devices, cluster) // shards,
        "model_shards": shards,
        "rank": cluster.rank,
        "workers": cluster.world_size,
        "distributed": distributed,
        "shard": adapter.shard_mode(model) if distributed else None,
    }
    try:
        _described[model] = info
    except TypeError:  # not weak-referenceable: describe() then reports the defaults
        pass
    return info


def distribute(
    model: "keras.Model", devices: Union[None, str, int, Sequence[Union[int, str, Device]]] = None, **options: object
) -> "keras.Model":
    """Make a Keras model train data-parallel on ``devices``, in place.

    The model itself is distributed and returned (``distribute(model) is model``): its own variables
    (weights, metric state, optimizer slots) are placed on the devices, nothing is rebuilt from its
    config, so any model that trains on one device works, subclassed ones included. Its compile
    configuration and optimizer state stay as they were. Its ``fit``/``evaluate``/``predict`` run on every
    device; the ``batch_size`` given to ``fit`` is the global batch, split evenly over the replicas,
    and each step computes what one device would compute on that whole batch. ``save()`` writes the
    plain single-device model, which loads in Keras without distkeras.

    Args:
        model: a ``keras.Model`` (compiled or not). On Keras 3 it may be unbuilt, or have no ``call()`` of
            its own (a GAN wrapper whose ``train_step`` calls sub-models): the variables it creates when it
            first builds are created distributed. Keras 2 (MXNet, CNTK) models must be built.
        devices: ``None``/``"auto"`` (every accelerator, else every CPU device), an int N (the first N),
            a list of accelerator ids, or device strings such as ``"gpu:0"``, ``"/device:GPU:1"``.
        **options: backend options; each adapter lists the ones it accepts (an unknown one is an error). On
            every backend also ``verify`` (True/"raise", "warn" or False; default: the ``DISTKERAS_VERIFY``
            environment variable): the first step of each ``fit()`` runs again as one device would, and a
            difference raises :class:`~distkeras.errors.VerifyError` or warns (:mod:`distkeras.verify`); and
            ``verify_tolerance=(rtol, atol)``, its float tolerance (default (1e-4, 1e-5)); and ``check_data``
            (True/"raise", the default, "warn" or False; or the ``DISTKERAS_CHECK_DATA`` environment variable): in a
            job of several workers, the first global batch of every pass over the data must be the same on every
            worker, or :class:`~distkeras.errors.DataError` is raised on all of them (:mod:`distkeras.verify.datacheck`).

    Returns:
        ``model`` itself, data-parallel (unchanged when one device is asked for in a one-process job).

    Raises:
        ModelTypeError: ``model`` is no ``keras.Model`` (a layer: wrap it in ``keras.Sequential([...])``).
        ModelError: a Keras 2 model that is not built, or a model distributed already on other devices (the
            same devices again are fine; build or load the model again to distribute it elsewhere).
        DeviceSpecError: ``devices`` is malformed or names a device that isn't there.
        BackendError / BackendUnavailableError: the Keras backend is unsupported or not installed.
        OptionError: an option the backend doesn't know, or ``shard`` on a backend that can't shard.

    Examples:
        >>> model = distkeras.distribute(model, devices=2)   # distkeras: the one added line
        >>> model.fit(x, y, batch_size=64)                    # 32 samples per device
    """
    adapter = _adapter_for(model)
    verify_mode = verify_lib.mode(options.pop("verify", None))
    rtol, atol = verify_lib.tolerance(options.pop("verify_tolerance", None))
    data_mode = datacheck.mode(options.pop("check_data", None))
    adapter.check_options(options)
    if "shard" not in adapter.options:
        options.pop("shard", None)  # None, which check_options allowed on a backend that doesn't shard
    if not getattr(model, "built", False) and not adapter.late_variables:
        raise ModelError(
            "The {} backend replicates the variables a model has when it is distributed, and this {} is not "
            "built, so it has none yet. Build it first: give it an Input layer, call model.build(input_shape), "
            "or call it once on a batch of data (model(x[:1])), then distribute it.".format(
                adapter.name, type(model).__name__)
        )
    cluster = cluster_lib.from_env()
    if not cluster.is_multi_worker:
        _check_not_an_unread_job(adapter)
    available = adapter.list_devices()
    if not cluster.is_multi_worker:
        _check_virtual_cpus(available, adapter.name)
    chosen = devices_lib.parse(devices, available)
    _check_not_moved(model, chosen, adapter, cluster)
    if len(chosen) == 1 and not cluster.is_multi_worker:
        if cluster.source != "single":
            logger.warning("this %s job has one worker: it trains alone on %s, as without a launcher", cluster.source, chosen[0])
        logger.info("one device (%s): the model is returned unchanged, nothing to distribute", chosen[0])
        _record(model, adapter, chosen, cluster, distributed=False)
        return model
    result = adapter.distribute(model, chosen, cluster, **options)
    # Read again: distribute() may have made this process part of a job (PyTorch's self-launch makes a
    # plain process rank 0 of the processes it starts, through os.environ).
    info = _record(result, adapter, chosen, cluster_lib.from_env(), distributed=True)
    if data_mode is not None and info["workers"] > 1:
        adapter.check_data(result, data_mode, info["rank"], info["workers"])
    if verify_mode is not None:
        adapter.verify(result, verify_lib.Check(verify_mode, adapter.name, info["replicas"], info["rank"], rtol, atol))
    pipelined = options.get("pipeline_stages") is not None
    logger.info(
        "%s backend, %d replica(s)%s on %s%s; fit()'s batch_size is the global batch, %s",
        adapter.name,
        info["replicas"],
        " x {} {}(s)".format(info["model_shards"], "pipeline stage" if pipelined else "model shard")
        if info["model_shards"] > 1 else "",
        ", ".join(info["devices"]),
        " in {} worker processes".format(info["workers"]) if info["workers"] > 1 else "",
        _batch_split(info, pipelined),
    )
    return result


def _batch_split(info: Dict[str, object], pipelined: bool) -> str:
    """How the log line says the global batch is shared: cut into micro-batches (pipeline stages), run whole by
    every model shard (tensor parallelism), split evenly over the replicas."""
    over = ", split evenly over the replicas" if info["replicas"] > 1 else ""
    if pipelined:
        return "cut into micro-batches" + over
    if info["model_shards"] > 1:
        return "run whole by every model shard" + over
    return "split evenly"


def shutdown() -> None:
    """End this process' part in a multi-worker job: each adapter in use stops what it started.

    With the CNTK backend this is ``Communicator.finalize()``, without which mpiexec reports the job as
    failed; distkeras also calls it at exit, so call it yourself only to finish early. No training or
    other collective operation may follow. Calling it again, or without a job, does nothing.

    Examples:
        >>> model.fit(x, y, batch_size=64)
        >>> distkeras.shutdown()
    """
    for adapter in backends.loaded():
        adapter.shutdown()


def describe(model: object) -> Dict[str, object]:
    """What distkeras did with ``model``.

    Returns:
        A dict with ``backend``; ``devices`` (strings: the devices given to this process, on PyTorch this
        host's, one process each); ``replicas``: the model's copies training, over all processes (the devices
        training, divided by ``model_shards``: with ``strategy="model"`` the size of the mesh's "batch" axis);
        ``model_shards``: the devices each copy is split over (1 unless ``strategy="model"`` or ``pipeline_stages``: then its shards or stages); ``rank``;
        ``workers``: the number of worker processes in the job, on every backend; ``distributed``
        (False for a model distkeras left unchanged or never saw); and ``shard``: the sharded training state
        it trains with (``"optimizer"``, ``"gradients"``, ``"all"``; None: unsharded).

    Examples:
        >>> distkeras.describe(model)   # PyTorch, `python train.py` asking for devices=2
        {'backend': 'torch', 'devices': ['cpu:0', 'cpu:1'], 'replicas': 2, 'model_shards': 1, 'rank': 0, 'workers': 2, 'distributed': True, 'shard': None}
    """
    adapter = _adapter_for(model)
    try:
        known = _described.get(model)
    except TypeError:
        known = None
    if known is not None:
        return dict(known)
    cluster = cluster_lib.from_env()
    first = devices_lib.parse(1, adapter.list_devices())
    return _record(model, adapter, first, cluster._replace(world_size=1, local_world_size=1), distributed=False)


def global_batch_size(per_device: int, devices: object = None) -> int:
    """The global batch for ``per_device`` samples on each replica: the "32 per GPU" habit.

    Args:
        per_device: samples per replica per step.
        devices: a model returned by :func:`distribute`, or a device spec as :func:`distribute` takes
            (``None`` = every device), counted over all processes of a multi-worker job as
            ``describe()["replicas"]`` counts them.

    Examples:
        >>> distkeras.global_batch_size(32, devices=4)
        128
    """
    if backends.keras_package(devices) is not None:
        replicas = describe(devices)["replicas"]
    else:
        adapter = backends.get(backends.active_name())
        chosen: List[devices_lib.Device] = devices_lib.parse(devices, adapter.list_devices())
        replicas = adapter.replicas(chosen, cluster_lib.from_env())
    return sharding.global_batch_size(per_device, replicas)
