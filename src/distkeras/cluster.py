"""The multi-worker environment, read once into a :class:`Cluster`.

A process learns its place in a job from whichever launcher started it:

- TF_CONFIG (a cluster manager, or ``distkeras launch`` for TensorFlow);
- RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun, ``distkeras launch``);
- JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or Keras' own
  KERAS_DISTRIBUTION_JOB_ADDRESSES / KERAS_DISTRIBUTION_NUM_PROCESSES / KERAS_DISTRIBUTION_PROCESS_ID;
- MPI: OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE (Open MPI), PMI_RANK / PMI_SIZE (MPICH, Intel MPI).

Pure Python: :func:`from_env` takes the environment as a mapping, so tests pass dicts. When several
sources are present they must agree on rank and world size, or :class:`ClusterError` says which
disagree. Part of the Python 3.6-compatible core.
"""

import json
import os
import typing
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import ClusterError


class Cluster(
    typing.NamedTuple(
        "Cluster",
        [
            ("rank", int),
            ("world_size", int),
            ("local_rank", int),
            ("local_world_size", int),
            ("coordinator", Optional[str]),
            ("source", str),
            ("workers", Optional[Tuple[str, ...]]),
            ("variables", Optional[Dict[str, str]]),
        ],
    )
):
    """Where this process stands in a job.

    Attributes:
        rank: this process' global rank, 0 .. world_size-1. Rank 0 prints and writes.
        world_size: the number of worker processes in the job.
        local_rank: the rank among the processes on this host.
        local_world_size: the number of worker processes on this host.
        coordinator: ``host:port`` of rank 0's rendezvous service, or None for one process.
        source: which environment it was read from (``"single"``, ``"TF_CONFIG"``, ``"torchrun"``,
            ``"jax"``, ``"keras"``, ``"mpi"``).
        workers: every rank's ``host:port``, in rank order, where the environment tells it (TensorFlow's
            TF_CONFIG needs one address per worker); None where it doesn't (the adapter then exchanges
            addresses through the rendezvous the launcher made).
        variables: the environment variables this was read from, ``{name: value}`` (for ``distkeras info``
            and error messages); None for :data:`SINGLE`.
    """

    __slots__ = ()

    @property
    def is_multi_worker(self):
        return self.world_size > 1

    @property
    def is_chief(self):
        return self.rank == 0


Cluster.__new__.__defaults__ = (None, None)  # workers, variables: Python 3.6's NamedTuple has no defaults

SINGLE = Cluster(rank=0, world_size=1, local_rank=0, local_world_size=1, coordinator=None, source="single")


def _int(env, name, source):
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ClusterError("Expected an integer in {} (set by {}). Received: {}={!r}".format(name, source, name, value))


def _opt_int(env, name, source, default):
    return _int(env, name, source) if env.get(name, "") != "" else default


def _from_tf_config(text):
    # type: (str) -> Tuple[Cluster, List[str]]
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ClusterError("TF_CONFIG is not valid JSON ({}). Received: TF_CONFIG={!r}".format(exc, text))
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterError(
            'TF_CONFIG needs a "cluster" object, e.g. {{"cluster": {{"worker": ["host1:port", "host2:port"]}}, '
            '"task": {{"type": "worker", "index": 0}}}}. Received: TF_CONFIG={!r}'.format(text)
        )
    cluster = config["cluster"]
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterError('TF_CONFIG needs "task": {{"type": ..., "index": ...}}. Received: TF_CONFIG={!r}'.format(text))
    unknown = sorted(set(cluster) - {"chief", "worker", "evaluator", "ps"})
    if unknown:
        raise ClusterError("TF_CONFIG names unknown job types {}. Known: chief, worker, evaluator, ps.".format(unknown))
    if cluster.get("ps"):
        raise ClusterError(
            "TF_CONFIG describes a parameter-server cluster; distkeras runs synchronous all-reduce training "
            "(MultiWorkerMirroredStrategy). Remove the 'ps' jobs."
        )
    for job in ("chief", "worker"):
        if not isinstance(cluster.get(job, []), list):
            raise ClusterError("TF_CONFIG cluster.{} must be a list of 'host:port'. Received: {!r}".format(job, cluster[job]))
    chiefs = cluster.get("chief", [])  # type: List[str]
    workers = cluster.get("worker", [])  # type: List[str]
    if len(chiefs) > 1:
        raise ClusterError("TF_CONFIG may name at most one chief. Received: {!r}".format(chiefs))
    members = chiefs + workers
    if not members:
        raise ClusterError("TF_CONFIG names no chief and no worker. Received: TF_CONFIG={!r}".format(text))
    kind, index = task["type"], task["index"]
    if kind not in ("chief", "worker") or not isinstance(index, int) or isinstance(index, bool):
        raise ClusterError(
            'TF_CONFIG task must be {{"type": "chief" or "worker", "index": int}}. Received: {!r}'.format(task)
        )
    of_kind = chiefs if kind == "chief" else workers
    if not 0 <= index < len(of_kind):
        raise ClusterError(
            "TF_CONFIG task {}:{} is not in the cluster, which has {} {}(s).".format(kind, index, len(of_kind), kind)
        )
    rank = index if kind == "chief" else len(chiefs) + index
    host = of_kind[index].rsplit(":", 1)[0]
    local = [m for m in members if m.rsplit(":", 1)[0] == host]
    local_rank = local.index(of_kind[index])
    return Cluster(rank, len(members), local_rank, len(local), members[0], "TF_CONFIG"), members


def _candidates(env):
    # type: (Mapping[str, str]) -> List[Cluster]
    found = []
    if env.get("TF_CONFIG", "").strip():
        found.append(_from_tf_config(env["TF_CONFIG"])[0])
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", "torchrun")
        address = env.get("MASTER_ADDR")
        coordinator = "{}:{}".format(address, env.get("MASTER_PORT", "29500")) if address else None
        found.append(
            Cluster(
                _int(env, "RANK", "torchrun"),
                world,
                _opt_int(env, "LOCAL_RANK", "torchrun", _int(env, "RANK", "torchrun")),
                _opt_int(env, "LOCAL_WORLD_SIZE", "torchrun", world),
                coordinator,
                "torchrun",
            )
        )
    for prefix, source in (("JAX", "jax"), ("KERAS_DISTRIBUTION", "keras")):
        count_var = prefix + "_NUM_PROCESSES"
        id_var = prefix + "_PROCESS_ID"
        if count_var in env and id_var in env:
            address_var = "JAX_COORDINATOR_ADDRESS" if prefix == "JAX" else "KERAS_DISTRIBUTION_JOB_ADDRESSES"
            coordinator = env.get(address_var, "").split(",")[0] or None
            world = _int(env, count_var, source)
            found.append(Cluster(_int(env, id_var, source), world, _int(env, id_var, source), world, coordinator, source))
    for rank_var, size_var, local_var, local_size_var in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if rank_var in env and size_var in env:
            rank = _int(env, rank_var, "MPI")
            world = _int(env, size_var, "MPI")
            found.append(
                Cluster(rank, world, _opt_int(env, local_var, "MPI", rank), _opt_int(env, local_size_var, "MPI", world), None, "mpi")
            )
            break
    return found


def from_env(environ=None):
    # type: (Optional[Mapping[str, str]]) -> Cluster
    """Read this process' place in the job from its environment.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        A :class:`Cluster`; :data:`SINGLE` when no launcher variables are set.

    Raises:
        ClusterError: malformed TF_CONFIG, a non-integer rank, a rank outside 0..world_size-1, or two
            launchers' variables that disagree.
    """
    env = os.environ if environ is None else environ
    found = _candidates(env)
    if not found:
        return SINGLE
    for cluster in found:
        if cluster.world_size < 1:
            raise ClusterError("Expected a world size >= 1 from {}. Received: {}".format(cluster.source, cluster.world_size))
        if not 0 <= cluster.rank < cluster.world_size:
            raise ClusterError(
                "Rank {} from {} is outside 0..{} (world size {}).".format(
                    cluster.rank, cluster.source, cluster.world_size - 1, cluster.world_size
                )
            )
        if not 0 <= cluster.local_rank < max(cluster.local_world_size, 1):
            raise ClusterError(
                "Local rank {} from {} is outside 0..{}.".format(cluster.local_rank, cluster.source, cluster.local_world_size - 1)
            )
    first = found[0]
    for other in found[1:]:
        if (other.rank, other.world_size) != (first.rank, first.world_size):
            raise ClusterError(
                "The launch environment disagrees with itself: {} says rank {} of {}, {} says rank {} of {}. "
                "Unset the variables of the launcher you are not using.".format(
                    first.source, first.rank, first.world_size, other.source, other.rank, other.world_size
                )
            )
    with_coordinator = [c for c in found if c.coordinator]
    if with_coordinator and not first.coordinator:
        first = first._replace(coordinator=with_coordinator[0].coordinator)
    return first


def describe(cluster):
    # type: (Cluster) -> Dict[str, object]
    """The cluster as a plain dict (for :func:`distkeras.describe`)."""
    return {"rank": cluster.rank, "workers": cluster.world_size, "local_rank": cluster.local_rank, "source": cluster.source}
