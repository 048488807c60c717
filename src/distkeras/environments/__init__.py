"""Cluster environments, one module per scheduler or launcher, and the order that decides between them.

:func:`distkeras.cluster.from_env` asks :func:`find`. The registry, :data:`REGISTRY`, is an ordered list
of ``"module:Class"`` names in this package, imported with importlib only when asked for; an entry whose
module is not in this install (a partial install, or a tree without it) is skipped, as if its variables
were absent.

The order, innermost launcher first (a launcher runs inside a scheduler's allocation, and the innermost
one started this process):

1. ``distkeras`` -- ``distkeras launch`` (DISTKERAS_LAUNCHER_PID with RANK / WORLD_SIZE)
2. ``torchrun`` -- torchrun / TorchElastic (RANK / WORLD_SIZE; TORCHELASTIC_RUN_ID)
3. ``ray`` -- Ray Train's workers
4. ``mpi`` -- Open MPI, MVAPICH2, MPICH / Intel MPI (OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, PMI_*)
5. ``kubeflow`` -- Kubeflow PyTorchJob (RANK / WORLD_SIZE / MASTER_ADDR with PET_*)
6. ``TF_CONFIG`` -- TensorFlow's cluster description (TFJob, Vertex AI)
7. ``jax`` -- JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
8. ``keras`` -- KERAS_DISTRIBUTION_JOB_ADDRESSES / _NUM_PROCESSES / _PROCESS_ID

then the schedulers, which start one process per task themselves:

9. ``kubernetes`` -- a Kubernetes Indexed Job or JobSet (JOB_COMPLETION_INDEX)
10. ``slurm`` -- Slurm's ``srun`` tasks (SLURM_PROCID / SLURM_NTASKS)

The rules:

- The first launcher found describes the workers. A launcher seen only through variables others set too
  (plain RANK / WORLD_SIZE without TORCHELASTIC_RUN_ID: a wrapper script's, Kubeflow's, Ray's) gives way to
  the first one that names itself.
- Every launcher found must agree on rank and world size, or :class:`~distkeras.errors.ClusterError`
  names both. The first one's coordinator is used, else the first agreeing launcher's.
- Without a launcher, the first scheduler describes the workers, and every scheduler found must agree.
- Schedulers found under a launcher are only context: ``srun ... distkeras launch``, ``srun ... torchrun``,
  ``mpirun`` inside an allocation each start workers of their own, which the scheduler doesn't count, and
  whose ranks need not follow the scheduler's tasks. Nothing is taken from them, and one that can't be
  read is no error (:attr:`Found.context` says what was seen, and ``distkeras info`` shows it). (srun's own
  PMI variables, ``srun --mpi=pmi2``, are Slurm's tasks, not an MPI launcher: see :mod:`.mpi`.)
- Variables of an environment set only in part, so that they place this process in a job of several without
  saying its rank (``WORLD_SIZE=2`` without ``RANK``, ``RANK`` without ``WORLD_SIZE``, ``JAX_NUM_PROCESSES=2``
  without ``JAX_PROCESS_ID``: :meth:`~.base.Environment.partial`), are a ClusterError naming them where this
  process would otherwise be a job of one -- never a silent rank 0. What places it in no job of several is no
  error: ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``MASTER_ADDR`` / ``MASTER_PORT`` or ``JAX_COORDINATOR_ADDRESS``
  alone.
- ``DISTKERAS_ENVIRONMENT=<name>`` reads that environment alone (an error if its variables are absent);
  ``DISTKERAS_ENVIRONMENT=single`` makes this process a job of one, whatever else is set.

Part of the Python 3.6-compatible core: no framework import.
"""

import importlib
import os
import typing
from typing import Dict, List, Mapping, Optional, Tuple

from ..cluster.record import SINGLE, Cluster
from ..errors import ClusterError

#: Forces one environment by name (``Cluster.source``), or ``single``.
FORCE_ENV = "DISTKERAS_ENVIRONMENT"

#: Every environment, ``"module:Class"`` in this package, in the order that decides.
REGISTRY = [
    "distkeras:DistKerasLaunch",
    "torchrun:TorchElastic",
    "ray:RayTrain",
    "mpi:MPI",
    "kubeflow:KubeflowPyTorchJob",
    "tf_config:TFConfig",
    "jax:JAX",
    "keras:KerasDistribution",
    "kubernetes:KubernetesIndexedJob",
    "slurm:Slurm",
]


def _load(entry):
    """The class ``entry`` ("module:Class") names, or None when its module is not in this install."""
    module_name, _, class_name = entry.partition(":")
    full = "{}.{}".format(__name__, module_name)
    try:
        module = importlib.import_module(full)
    except ImportError as exc:
        if getattr(exc, "name", None) == full:
            return None  # not part of this install: as if its variables were absent
        raise  # the module is there but broken, or needs something missing: a bug to report, not to hide
    return getattr(module, class_name)


def available() -> List[type]:
    """The environment classes of :data:`REGISTRY` this install has, in order."""
    return [cls for cls in (_load(entry) for entry in REGISTRY) if cls is not None]


def missing() -> List[str]:
    """The entries of :data:`REGISTRY` whose module this install lacks."""
    return [entry for entry in REGISTRY if _load(entry) is None]


def get(name: str) -> Optional[type]:
    """The environment class named ``name`` (its ``name``, e.g. "slurm", "TF_CONFIG", or its module's, e.g.
    "tf_config"; any case), or None when there is none in this install."""
    for cls in available():
        if name.lower() in (cls.name.lower(), cls.__module__.rpartition(".")[2]):
            return cls
    return None


class Found(
    typing.NamedTuple(
        "Found",
        [
            ("cluster", Cluster),
            ("agreeing", List[Cluster]),
            ("context", List[Tuple[str, Dict[str, str], str]]),
        ],
    )
):
    """What :func:`find` found.

    Attributes:
        cluster: this process' place in the job (``cluster.source`` names the environment that describes it).
        agreeing: every environment read that describes the workers and agrees with ``cluster`` (it first);
            where ``cluster`` has no coordinator (or worker addresses), the first of these that has one lends it.
        context: ``(name, variables, why)`` of each environment found but not used to describe the workers
            (a scheduler under a launcher), ``why`` saying so.
    """

    __slots__ = ()


def check(cluster: Cluster) -> Cluster:
    """``cluster``, or a ClusterError when its ranks are impossible."""
    if cluster.world_size < 1:
        raise ClusterError(
            "Expected a world size >= 1 from {}. Received: {}".format(cluster.source, cluster.world_size))
    if not 0 <= cluster.rank < cluster.world_size:
        raise ClusterError(
            "Rank {} from {} is outside 0..{} (world size {}).".format(
                cluster.rank, cluster.source, cluster.world_size - 1, cluster.world_size
            )
        )
    if not 0 <= cluster.local_rank < max(cluster.local_world_size, 1):
        raise ClusterError(
            "Local rank {} from {} is outside 0..{}.".format(
                cluster.local_rank, cluster.source, cluster.local_world_size - 1)
        )
    if cluster.workers is not None and len(cluster.workers) != cluster.world_size:
        raise ClusterError("{} names {} worker addresses for a world size of {}. Received: {}".format(
            cluster.source, len(cluster.workers), cluster.world_size, list(cluster.workers)))
    return cluster


def _agree(found: List[Cluster], what: str) -> None:
    for i, one in enumerate(found):
        for other in found[i + 1:]:
            if (other.rank, other.world_size) != (one.rank, one.world_size):
                raise ClusterError(
                    "The launch environment disagrees with itself: {} says rank {} of {}, {} says rank {} of {}. "
                    "Unset the variables of the {} you are not using.".format(
                        one.source, one.rank, one.world_size, other.source, other.rank, other.world_size, what
                    )
                )


def _forced(name: str, env: Mapping[str, str]) -> Found:
    if name.lower() == "single":
        return Found(SINGLE._replace(variables={FORCE_ENV: name}), [], [])
    cls = get(name)
    if cls is None:
        absent = missing()
        raise ClusterError("Expected {} to name a cluster environment: {} or single{}. Received: {}={!r}".format(
            FORCE_ENV, ", ".join(c.name for c in available()),
            " ({} not in this install)".format(", ".join(absent)) if absent else "", FORCE_ENV, name))
    if not cls.detect(env):
        raise ClusterError(
            "{}={} asks for the {} environment, but its variables are absent: expected {}. Unset {} to let "
            "distkeras find the environment, or set it to single for one process.".format(
                FORCE_ENV, name, cls.name, cls.requires or "its variables", FORCE_ENV))
    cluster = check(cls().read(env))
    variables = dict(cluster.variables or {})
    variables[FORCE_ENV] = name
    return Found(cluster._replace(variables=variables), [cluster], [])


def find(environ: Optional[Mapping[str, str]] = None) -> Found:
    """Find the environment that describes this process' job, following the rules above.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        A :class:`Found`; its cluster is :data:`~distkeras.cluster.SINGLE` when no environment is present.

    Raises:
        ClusterError: malformed variables, a rank outside 0..world_size-1, environments that disagree, or
            DISTKERAS_ENVIRONMENT naming an unknown or absent environment.
    """
    env = os.environ if environ is None else environ
    if env.get(FORCE_ENV, "").strip():
        return _forced(env[FORCE_ENV].strip(), env)
    found = _detected(env)
    if found.cluster.world_size == 1:
        _refuse_partial(env, found.cluster)
    return found


def _refuse_partial(env: Mapping[str, str], cluster: Cluster) -> None:
    """A ClusterError where this process would be a job of one but an environment's variables, partly set, place it
    in a job of several (``WORLD_SIZE=2`` without ``RANK``): each process of that job would be rank 0, alone."""
    partial = [(cls.name, why) for cls in available() if not cls.detect(env) for why in [cls.partial(env)] if why]
    if not partial:
        return
    raise ClusterError(
        "The launch variables are partly set: {}. They place this process in a job of several, but without the "
        "rest distkeras can't tell its rank, and it would run as {} (every process of the job as rank 0). Set them "
        "all in each process (RANK 0..WORLD_SIZE-1 with WORLD_SIZE, as torchrun and distkeras launch do; "
        "JAX_PROCESS_ID with JAX_NUM_PROCESSES), or unset the partial ones; to train alone on purpose, set "
        "{}=single.".format(
            "; ".join("{} ({}'s)".format(why, name) for name, why in partial),
            "a job of one" if cluster.source == SINGLE.source else "rank 0 of 1 from {}".format(cluster.source),
            FORCE_ENV))


def _detected(env: Mapping[str, str]) -> Found:
    """:func:`find`'s rules, without the partial variables' check."""
    launchers: List[Tuple[type, Cluster]] = []
    schedulers: List[type] = []
    for cls in available():
        if cls.detect(env):
            if cls.launcher:
                launchers.append((cls, check(cls().read(env))))
            else:
                schedulers.append(cls)
    context: List[Tuple[str, Dict[str, str], str]] = []
    if launchers:
        clusters = [c for _, c in launchers]
        _agree(clusters, "launcher")
        named = [c for cls, c in launchers if not cls.generic(env)]
        first = (named or clusters)[0]
        agreeing = [first] + [c for c in clusters if c is not first]
        for cls in schedulers:
            try:
                seen = check(cls().read(env))
            except ClusterError as exc:
                context.append((cls.name, {}, "ignored under {}: {}".format(first.source, exc)))
                continue
            why = "context under {}, which starts the workers (the scheduler's task: rank {} of {})".format(
                first.source, seen.rank, seen.world_size)
            context.append((cls.name, dict(seen.variables or {}), why))
    elif schedulers:
        agreeing = [check(cls().read(env)) for cls in schedulers]
        _agree(agreeing, "scheduler")
        first = agreeing[0]
    else:
        return Found(SINGLE, [], [])
    if not first.coordinator:
        lent = [c.coordinator for c in agreeing if c.coordinator]
        if lent:
            first = first._replace(coordinator=lent[0])
    if first.workers is None:
        lent_workers = [c.workers for c in agreeing if c.workers is not None and len(c.workers) == first.world_size]
        if lent_workers:
            first = first._replace(workers=lent_workers[0])
    return Found(first, agreeing, context)


#: The variable CUDA reads, and Slurm's sign that it bound GPUs to each task itself (``srun --gpus-per-task``).
CUDA_ENV = "CUDA_VISIBLE_DEVICES"
BOUND_PER_TASK = ("SLURM_GPUS_PER_TASK",)


def local_gpus(env: Mapping[str, str], cluster: Cluster, count: Optional[int] = None) -> Optional[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value this task should run with, when several tasks share a node.

    A scheduler that starts several tasks per node (``srun --ntasks-per-node=4 --gres=gpu:4``, an MPI
    launcher) often lets every task see every GPU of the node; then each task takes its share by local rank,
    in the order CUDA_VISIBLE_DEVICES lists them (indices or UUIDs): one GPU per task when the node has as
    many GPUs as tasks, ``gpus // tasks`` consecutive GPUs otherwise. Unchanged (the value in ``env``, None if
    unset) when the task is alone on its node, when the scheduler already bound GPUs to each task
    (``SLURM_GPUS_PER_TASK``, or fewer GPUs visible than tasks on the node: one GPU each, as ``srun
    --gpus-per-task=1`` or ``--gpu-bind`` give), or when there are no GPUs.

    Args:
        env: the task's environment (CUDA_VISIBLE_DEVICES, SLURM_GPUS_PER_TASK).
        cluster: the task's place: ``local_rank`` and ``local_world_size`` (Slurm's SLURM_LOCALID and tasks
            on the node, torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, ...).
        count: the node's GPUs, for a task whose CUDA_VISIBLE_DEVICES is unset (``len(os.listdir(
            "/proc/driver/nvidia/gpus"))`` tells without a framework); None or 0 leaves it unset.

    Returns:
        The value to set, or None to leave CUDA_VISIBLE_DEVICES unset.

    Examples:
        >>> task = Cluster(5, 8, 1, 4, "node0:29500", "slurm")
        >>> local_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, task)
        '1'
        >>> local_gpus({"CUDA_VISIBLE_DEVICES": "2"}, task)  # srun --gpus-per-task=1 bound it already
        '2'
    """
    current = env.get(CUDA_ENV)
    tasks = cluster.local_world_size
    if tasks <= 1 or any(name in env for name in BOUND_PER_TASK):
        return current
    if current is None:
        if not count:
            return None
        visible = [str(i) for i in range(count)]
    else:
        visible = [v.strip() for v in current.split(",") if v.strip()]
    if len(visible) < tasks:
        return current
    if not 0 <= cluster.local_rank < tasks:
        raise ClusterError("Expected a local rank in 0..{} to pick this task's GPUs. Received: local rank {} from {}"
                           .format(tasks - 1, cluster.local_rank, cluster.source))
    share = len(visible) // tasks
    return ",".join(visible[cluster.local_rank * share:(cluster.local_rank + 1) * share])
