"""Keras' own multi-process variables: ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` /
``KERAS_DISTRIBUTION_NUM_PROCESSES`` / ``KERAS_DISTRIBUTION_PROCESS_ID`` (what
``keras.distribution.initialize()`` reads). The first job address is the coordinator.
Part of the Python 3.6-compatible core.
"""

from typing import Mapping, Optional

from ..cluster.record import Cluster
from .base import Environment, partial_pair
from .jax import read_counted

ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
COUNT = "KERAS_DISTRIBUTION_NUM_PROCESSES"
INDEX = "KERAS_DISTRIBUTION_PROCESS_ID"


class KerasDistribution(Environment):
    """KERAS_DISTRIBUTION_NUM_PROCESSES and KERAS_DISTRIBUTION_PROCESS_ID set."""

    name = "keras"
    launcher = True
    requires = "KERAS_DISTRIBUTION_NUM_PROCESSES and KERAS_DISTRIBUTION_PROCESS_ID"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return COUNT in env and INDEX in env

    @staticmethod
    def partial(env: Mapping[str, str]) -> Optional[str]:
        return partial_pair(env, INDEX, COUNT)

    def read(self, env: Mapping[str, str]) -> Cluster:
        return read_counted(env, self.name, ADDRESSES, COUNT, INDEX)
