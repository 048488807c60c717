"""The interface of a cluster environment: one small class per scheduler or launcher.

Lightning's ``plugins/environments/`` is the model: each environment says whether it is present
(:meth:`Environment.detect`) and reads this process' place in the job from the variables it sets
(:meth:`Environment.read`). Pure Python, the environment passed in as a mapping, so tests pass dicts.
Part of the Python 3.6-compatible core.
"""

import abc
from typing import Dict, Iterable, Mapping, Optional

from ..cluster import Cluster
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


def picked(env: Mapping[str, str], names: Iterable[str] = (), prefixes: Iterable[str] = ()) -> Dict[str, str]:
    """The variables of ``env`` among ``names`` or starting with one of ``prefixes``, sorted by name."""
    names = set(names)
    prefixes = tuple(prefixes)
    return {k: env[k] for k in sorted(env) if k in names or (prefixes and k.startswith(prefixes))}


def address(host: Optional[str], port: object) -> Optional[str]:
    """``host:port``, or None without a host."""
    return "{}:{}".format(host, port) if host else None
