"""The interface of a cluster environment: one small class per scheduler or launcher.

Lightning's ``plugins/environments/`` is the model: each environment says whether it is present
(:meth:`Environment.detect`) and reads this process' place in the job from the variables it sets
(:meth:`Environment.read`). Pure Python, the environment passed in as a mapping, so tests pass dicts.
Part of the Python 3.6-compatible core.
"""

import abc
from typing import Mapping

from ..cluster import Cluster


class Environment(abc.ABC):
    """One scheduler's or launcher's variables, read into a :class:`~distkeras.cluster.Cluster`."""

    #: The name ``Cluster.source`` and ``distkeras info`` give it ("slurm", "torchrun", ...).
    name = ""
    #: A launcher starts the workers inside a scheduler's allocation (``srun ... torchrun``): when a launcher
    #: and a scheduler are both present the launcher's variables describe the workers, the scheduler's the
    #: launchers. Two launchers, or two schedulers, that disagree are an error.
    launcher = True

    @staticmethod
    @abc.abstractmethod
    def detect(env):
        # type: (Mapping[str, str]) -> bool
        """Whether this environment's variables are present in ``env``."""

    @abc.abstractmethod
    def read(self, env):
        # type: (Mapping[str, str]) -> Cluster
        """This process' place in the job. Raises ClusterError, naming the variables, when they are malformed
        or describe a job distkeras can't join (it never trains alone when the scheduler says N > 1)."""
