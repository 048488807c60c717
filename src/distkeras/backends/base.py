"""The adapter interface every backend implements. Part of the Python 3.6-compatible core."""

import abc
import contextlib
import difflib
import logging
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .. import cluster as cluster_lib
from ..cluster import Cluster
from ..devices import Device
from ..errors import ClusterError, OptionError

logger = logging.getLogger("distkeras")

#: Values of the ``compression`` option: the dtype gradients travel in during the all-reduce.
COMPRESSIONS = ("bf16", "fp16")
COMPRESSION_HELP = ("the dtype gradients are all-reduced in: 'bf16' or 'fp16' (half the bytes; cast back before "
                    "the optimizer), default None (the gradients' own dtype)")


def check_compression(value: object) -> Optional[str]:
    """``None``, ``"bf16"`` or ``"fp16"`` (also ``"bfloat16"``/``"float16"``); anything else is an OptionError."""
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
    if value is None:
        return None
    name = aliases.get(value, value) if isinstance(value, str) else value
    if name not in COMPRESSIONS:
        raise OptionError(
            "Expected compression to be None, 'bf16' or 'fp16'. Received: compression={!r}".format(value))
    return name


#: Values of the ``shard`` option besides None (ZeRO's stages 1, 2 and 3).
SHARD_MODES = ("optimizer", "gradients", "all")
SHARD_HELP = ("sharded training state (ZeRO): None (default: every replica holds everything), 'optimizer' (each "
              "replica keeps 1/N of the optimizer state), 'gradients' (and gradients are reduce-scattered), 'all' "
              "(and the weights themselves, gathered when a layer runs)")
#: The backends whose adapters take ``shard``, and their names in the error the others give.
SHARDING_BACKENDS = ("torch", "jax")
_SHARDING_NAMES = "PyTorch and JAX"
#: The options of model parallelism (``strategy="model"``), and the backends whose adapters take them.
MODEL_PARALLEL_OPTIONS = ("strategy", "layout_map", "model_shards")
_MODEL_PARALLEL_NAMES = "PyTorch and JAX"
#: The options :func:`distkeras.distribute` takes itself, on every backend (suggested for a misspelt name).
COMMON_OPTIONS = ("devices", "verify", "verify_tolerance")


def check_shard(value: object) -> Optional[str]:
    """``None``, ``"optimizer"``, ``"gradients"`` or ``"all"``; anything else is an OptionError listing them."""
    if value is None or (isinstance(value, str) and value in SHARD_MODES):
        return value  # type: ignore[return-value]
    raise OptionError(
        "Expected shard to be one of None, 'optimizer', 'gradients', 'all'. Received: shard={!r}".format(value))


#: Where the NVIDIA driver lists the node's GPUs, one folder each: counted without a framework.
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def pin_local_gpus(cluster: Cluster,
                   environ: Optional[Dict[str, str]] = None,
                   gpus_dir: str = NVIDIA_GPUS) -> Optional[str]:
    """Give this task its share of the node's GPUs by local rank, in ``CUDA_VISIBLE_DEVICES``, before the
    framework starts (:func:`distkeras.environments.local_gpus` decides; a scheduler's binding is kept).

    For engines that use every GPU a process sees (TensorFlow's MultiWorkerMirroredStrategy, JAX): several
    tasks on a node that all see every GPU (``srun --ntasks-per-node=4 --gres=gpu:4``) would each take all.

    Returns:
        The value set, or None where nothing changed.
    """
    import os

    from .. import environments

    env = os.environ if environ is None else environ
    try:
        count = len(os.listdir(gpus_dir))
    except OSError:  # no NVIDIA driver here
        count = 0
    value = environments.local_gpus(env, cluster, count)
    if value is None or value == env.get(environments.CUDA_ENV):
        return None
    env[environments.CUDA_ENV] = value
    return value


#: What ``distkeras launch`` knows of a job on this host when it asks a backend what its workers need (pure data).
#: ``engine`` is HOST:PORT of the engine's rendezvous; across hosts ``addresses`` holds every host's address by node
#: rank, and the engine may use ``engine_ports(nproc_per_node)`` ports from the engine's port up on every host.
LaunchJob = NamedTuple("LaunchJob", [
    ("nproc_per_node", int), ("nnodes", int), ("node_rank", int), ("engine", str), ("addresses", Optional[List[str]]),
])

#: A process ``distkeras launch`` starts beside the workers: (command, environment, label in its output).
Role = Tuple[List[str], Dict[str, str], str]


class Adapter(abc.ABC):
    """What distkeras needs from a backend: its devices, and a way to make a model data-parallel.

    An adapter returns a real Keras model whose ``fit``/``evaluate``/``predict``/``save`` keep their
    Keras meaning. Backend knobs pass through ``**options``; :attr:`options` names the ones an adapter
    accepts and :meth:`check_options` rejects the rest, so a misspelt option is an error, not a no-op.
    """

    #: The Keras backend name this adapter serves ("tensorflow", "jax", "torch", "mxnet", "cntk").
    name = ""
    #: The framework module whose presence :meth:`is_available` checks.
    framework = ""
    #: The pip requirement that installs the framework, for error messages.
    install_hint = ""
    #: Option names :meth:`distribute` accepts, with a one-line description each.
    options: Dict[str, str] = {}
    #: Why this backend can't shard training state (``shard=``), for the OptionError; None where it can (its
    #: :attr:`options` then name ``shard``).
    shard_unsupported: Optional[str] = "it has no sharded variables"
    #: Why this backend can't split a model over devices (``strategy="model"``), for the OptionError.
    model_parallel_unsupported = "its adapter replicates whole models"
    #: Whether :meth:`distribute` takes a model that is not built yet (Keras 3): the variables it creates
    #: later, when its first ``fit()`` builds it, are created distributed. Keras 2 adapters need them now.
    late_variables = False
    #: Whether :meth:`distribute` lays a model it distributed already onto other devices of this process (JAX:
    #: its arrays are laid out again on the new mesh, optimizer state included). Elsewhere distributing a
    #: distributed model on other devices is refused (:func:`distkeras.distribute`).
    moves_distributed_models = False

    @abc.abstractmethod
    def list_devices(self) -> List[Device]:
        """The devices this process can use, in the backend's order (accelerators first)."""

    @abc.abstractmethod
    def set_cpu_devices(self, count: int) -> None:
        """Split the host CPU into ``count`` devices. Raises TooLateError once the backend is initialised."""

    @abc.abstractmethod
    def distribute(self, model: object, devices: Sequence[Device], cluster: Cluster, **options: object) -> object:
        """Return a Keras model equal to ``model`` (architecture, weights, compile config) that trains
        data-parallel over ``devices`` on every worker of ``cluster``."""

    def prepare(self, cluster: Cluster) -> None:
        """Called by ``import distkeras`` in a worker of a multi-worker job, before any model exists.

        Engines that must start before the framework runs its first op (TensorFlow's collectives,
        ``jax.distributed``) start here, usually through ``backends.when_imported``. Default: nothing.
        """

    def replicas(self, devices: Sequence[Device], cluster: Cluster) -> int:
        """How many replicas train in ``cluster`` when each process is given ``devices``: the devices
        training, over all processes of the job (``describe()["replicas"]``).

        By default every process of the job drives all of ``devices``: ``len(devices) * world_size``. An
        adapter whose replicas are processes, one device each (PyTorch), counts its processes instead.
        ``describe()["workers"]`` is not the adapter's to decide: it is the job's processes on every backend.
        """
        return len(devices) * cluster.world_size

    def any_process(self, model: object, flag: bool) -> bool:
        """Whether ``flag`` is true in any process of ``model``'s job: every process calls it at the same
        point of training (after the same step), and every process gets the same answer.

        distkeras' :class:`~distkeras.callbacks.BackupAndRestore` calls it after every training step, so
        that a SIGTERM one worker got stops every worker after the same step. A cheap collective on the
        backend's own engine (one integer). Default: a job of one process, where ``flag`` is the answer;
        an adapter whose jobs span processes overrides it.

        Raises:
            ClusterError: this process is one worker of several and the adapter has no collective for it.
        """
        cluster = cluster_lib.from_env()
        if cluster.is_multi_worker:
            raise ClusterError(
                "Expected the {} backend to agree across workers on when to stop after a SIGTERM; it can't. "
                "Received: rank {} of {} ({}). Pass save_before_preemption=False to "
                "distkeras.callbacks.BackupAndRestore (a SIGTERM then ends the job, which resumes from the last "
                "epoch).".format(self.name, cluster.rank, cluster.world_size, cluster.source))
        return bool(flag)

    def random_states(self) -> Dict[str, object]:
        """The framework's global random states that decide a data order (a torch DataLoader's shuffle), for a
        checkpoint taken mid-epoch (:class:`~distkeras.callbacks.BackupAndRestore`). Default: none."""
        return {}

    def set_random_states(self, states: Dict[str, object]) -> None:
        """Restore the states :meth:`random_states` gave (``states`` may hold others too). Default: nothing."""

    def shard_mode(self, model: object) -> Optional[str]:
        """The ``shard`` value ``model`` was distributed with and trains under (for :func:`distkeras.describe`):
        ``"optimizer"``, ``"gradients"``, ``"all"``, or None. Default: None (a backend that can't shard)."""
        return None

    def check_alone(self) -> None:
        """Called by :func:`distkeras.distribute` where no environment describes a job of several processes:
        raise ClusterError if the framework itself says this process is one of several (an engine someone else
        started), which would otherwise train alone. Default: nothing."""

    def shutdown(self) -> None:
        """Called by :func:`distkeras.shutdown`: stop what the adapter started for a multi-worker job
        (CNTK finalizes MPI). No collective operation may follow. Default: nothing."""

    # ---- launching: called by ``distkeras launch`` before any worker exists. Class methods that import no
    # ---- framework (the launcher may run where the backend's framework is not installed).

    @classmethod
    def engine_ports(cls, nproc_per_node: int) -> int:
        """How many ports the engine needs on every host, from the engine's port up. Default: one rendezvous."""
        return 1

    @classmethod
    def workers_env(cls, job: LaunchJob, environ: Dict[str, str]) -> List[Dict[str, str]]:
        """The variables this backend's engine reads, for each of this host's workers (local rank order), on top
        of the ones every worker gets (RANK, WORLD_SIZE, MASTER_ADDR, JAX_*: :func:`distkeras.launch.command.worker_env`).
        Default: none."""
        return [{} for _ in range(job.nproc_per_node)]

    @classmethod
    def launch_roles(cls, job: LaunchJob, environ: Dict[str, str]) -> List[Role]:
        """Processes the engine needs beside the workers on this host (MXNet's parameter-server scheduler and
        servers), watched by the launcher like the workers. Default: none."""
        return []

    @classmethod
    def launch_command(cls,
                       script_args: List[str],
                       nproc_per_node: int,
                       nnodes: int,
                       environ: Dict[str, str]) -> Optional[Tuple[List[List[str]], List[Dict[str, str]], List[object]]]:
        """Where the backend's engine starts the workers itself (CNTK: ``mpiexec``): the ``(commands, envs,
        labels)`` the launcher runs instead of one process per worker. Default None: the launcher starts them.

        Raises:
            LaunchError: the engine's own launcher can't start this job here.
        """
        return None

    def pass_over_function(self, take):
        """A stand-in for the model's train function that trains nothing: called as Keras' trainer of this backend
        calls its train function, it calls ``take(iterator)`` on the batch iterator it is given (which takes one
        call's batches from it) and returns empty logs. :class:`~distkeras.callbacks.BackupAndRestore` uses it to
        pass over the batches a resumed epoch already trained. Default: Keras' torch trainer, which takes the batch
        itself before it calls the function (keras/src/backend/torch/trainer.py)."""
        return lambda *args: {}

    def verify(self, model: object, check: object) -> None:
        """Install the one-device check (:class:`distkeras.verify.check.Check`) on a distributed ``model``. Default: the
        check can't run on this backend, which ``check.skip`` says once."""
        check.skip("the {} backend has no one-device check".format(self.name))

    def check_data(self, model: object, mode: str, rank: int, workers: int) -> None:
        """Install the data check (:mod:`distkeras.verify.datacheck`) on ``model``, distributed over ``workers`` processes
        (more than one). Default: this backend's pipelines can't be compared yet, which is said once."""
        logger.info("the data check doesn't run on the %s backend: each worker's data is its own to keep alike", self.name)

    def check_options(self, options: Dict[str, object]) -> None:
        """Reject options this adapter doesn't know, naming the ones it does.

        ``shard`` is checked on every backend (a bad value lists the valid ones); a backend that can't shard
        accepts ``shard=None`` and stops at any other value with its reason and the backends that shard.
        """
        if "shard" in options and "shard" not in self.options:
            mode = check_shard(options["shard"])
            if mode is not None:
                raise OptionError(
                    "shard={!r} needs sharded training state, and the {} backend can't hold it: {}. Sharding runs "
                    "on the {} backends (set KERAS_BACKEND); on {} use shard=None (the default).".format(
                        mode, self.name, self.shard_unsupported, _SHARDING_NAMES, self.name))
            options = {k: v for k, v in options.items() if k != "shard"}
        if "strategy" not in self.options and any(k in options for k in MODEL_PARALLEL_OPTIONS):
            if options.get("strategy", "data") != "data" or any(
                    options.get(k) is not None for k in MODEL_PARALLEL_OPTIONS[1:]):
                raise OptionError(
                    "strategy='model' (with layout_map, model_shards) splits the model's layers over the devices, and "
                    "the {} backend can't: {}. Model parallelism runs on the {} backends (set KERAS_BACKEND); on {} "
                    "use strategy='data' (the default). Received: {}".format(
                        self.name, self.model_parallel_unsupported, _MODEL_PARALLEL_NAMES, self.name,
                        ", ".join("{}={!r}".format(k, options[k]) for k in MODEL_PARALLEL_OPTIONS if k in options)))
            options = {k: v for k, v in options.items() if k not in MODEL_PARALLEL_OPTIONS}
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise OptionError(self.unknown_options_message(unknown))

    def unknown_options_message(self, unknown: Sequence[str]) -> str:
        """The OptionError's message for option names this adapter doesn't take. Where a name is close to one it
        does (``compresion``), short: the name and ``did you mean 'compression'?``, then the valid names;
        otherwise every option with its description."""
        names = sorted(set(self.options) | set(COMMON_OPTIONS))
        close = {name: difflib.get_close_matches(name, names, n=1, cutoff=0.6) for name in unknown}
        if any(close.values()):
            return "{} The {} backend's options: {}; every backend's: {}.".format(
                " ".join("{}: did you mean {!r}?".format(name, close[name][0])
                         if close[name] else "{}: no such option.".format(name) for name in unknown),
                self.name, ", ".join(sorted(self.options)) or "none", ", ".join(COMMON_OPTIONS))
        known = ", ".join("{} ({})".format(k, v) for k, v in sorted(self.options.items())) or "none"
        return "Unknown option(s) {} for the {} backend. Options it accepts: {}.".format(
            ", ".join(unknown), self.name, known)


@contextlib.contextmanager
def swapped(holder, name, value):
    """``holder.name`` set to ``value`` for the ``with`` block, then what it was again (a thread-local's slot, an
    object's attribute)."""
    outer = getattr(holder, name, None)
    setattr(holder, name, value)
    try:
        yield
    finally:
        setattr(holder, name, outer)
