"""The interface of a cluster environment: one small class per scheduler or launcher.

Lightning's ``plugins/environments/`` is the model: each environment says whether it is present
(:meth:`Environment.detect`) and reads this process' place in the job from the variables it sets
(:meth:`Environment.read`). Pure Python, the environment passed in as a mapping, so tests pass dicts.
Part of the Python 3.6-compatible core.
"""

import abc
from typing import Dict, Iterable, Mapping, Optional

from ..cluster.record import Cluster
from ..errors import ClusterError


class Environment(abc.ABC):
    """One scheduler's or launcher's variables, read into a :class:`~distkeras.cluster.Cluster`."""

    #: The name ``Cluster.source`` and ``distkeras info`` give it ("slurm", "torchrun", ...).
    name = ""
    #: A launcher starts the workers inside a scheduler's allocation (``srun ... torchrun``): when a launcher
    #: and a scheduler are both present the launcher's variables describe the workers, the scheduler's the
    #: launchers. Two launchers, or two schedulers, that disagree are an error.
    launcher = True
    #: What :meth:`detect` looks for, for error messages ("RANK and WORLD_SIZE").
    requires = ""

    @staticmethod
    @abc.abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether this environment's variables are present in ``env``."""

    @staticmethod
    def generic(env: Mapping[str, str]) -> bool:
        """Whether ``env`` shows this environment only through variables other launchers set too (plain
        RANK / WORLD_SIZE / MASTER_ADDR): then a launcher that names itself describes the workers instead."""
        return False

    @staticmethod
    def partial(env: Mapping[str, str]) -> Optional[str]:
        """Where :meth:`detect` is false: what of this environment's variables is set that places this process in
        a job of several (``WORLD_SIZE=2`` without ``RANK``), or None. :func:`distkeras.environments.find` refuses
        to make such a process a job of one: every process of the job would take itself for rank 0."""
        return None

    @abc.abstractmethod
    def read(self, env: Mapping[str, str]) -> Cluster:
        """This process' place in the job. Raises ClusterError, naming the variables, when they are malformed
        or describe a job distkeras can't join (it never trains alone when the scheduler says N > 1)."""


def integer(env: Mapping[str, str], name: str, source: str) -> int:
    """``env[name]`` as an int, or a ClusterError naming the variable and who set it."""
    value = env[name]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ClusterError("Expected an integer in {} (set by {}). Received: {}={!r}".format(name, source, name, value))


def optional_integer(env: Mapping[str, str], name: str, source: str, default: int) -> int:
    """``env[name]`` as an int when it is set and not empty, else ``default``."""
    return integer(env, name, source) if env.get(name, "") != "" else default


def claims_several(value: str) -> bool:
    """Whether a size or rank variable's value says there are other processes (not unset, empty, 0 or 1)."""
    return value.strip() not in ("", "0", "1")


def partial_pair(env: Mapping[str, str], rank_var: str, size_var: str, local_var: Optional[str] = None) -> Optional[str]:
    """What is missing of a rank and size pair that, as set, places this process in a job of several: the rank
    without the size (it alone says nothing of the job's size), the size > 1 without the rank, or a local rank > 0
    without either; None where both are set, or what is set is a job of one (``WORLD_SIZE=1``, ``LOCAL_RANK=0``)."""
    rank, size = env.get(rank_var), env.get(size_var)
    if rank is not None and size is None:
        return "{}={!r} without {}".format(rank_var, rank, size_var)
    if size is not None and rank is None and claims_several(size):
        return "{}={!r} without {}".format(size_var, size, rank_var)
    if local_var and rank is None and size is None and env.get(local_var, "").strip() not in ("", "0"):
        return "{}={!r} without {} and {}".format(local_var, env[local_var], rank_var, size_var)
    return None


def picked(env: Mapping[str, str], names: Iterable[str] = (), prefixes: Iterable[str] = ()) -> Dict[str, str]:
    """The variables of ``env`` among ``names`` or starting with one of ``prefixes``, sorted by name."""
    names = set(names)
    prefixes = tuple(prefixes)
    return {k: env[k] for k in sorted(env) if k in names or (prefixes and k.startswith(prefixes))}


def address(host: Optional[str], port: object) -> Optional[str]:
    """``host:port``, or None without a host."""
    return "{}:{}".format(host, port) if host else None
