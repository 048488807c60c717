"""jax.distributed's own variables: ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
(what ``jax.distributed.initialize()`` reads when called without arguments).

They say nothing about hosts, so the local rank is taken to be the rank, on one host (as before).
Part of the Python 3.6-compatible core.
"""

from typing import Mapping, Optional

from ..cluster.record import Cluster
from .base import Environment, integer, partial_pair, picked

COORDINATOR, COUNT, INDEX = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def read_counted(env: Mapping[str, str], source: str, coordinator_var: str, count_var: str, index_var: str) -> Cluster:
    world = integer(env, count_var, source)
    rank = integer(env, index_var, source)
    coordinator = env.get(coordinator_var, "").split(",")[0].strip() or None
    return Cluster(rank, world, rank, world, coordinator, source,
                   variables=picked(env, (coordinator_var, count_var, index_var)))


class JAX(Environment):
    """JAX_NUM_PROCESSES and JAX_PROCESS_ID set; the coordinator from JAX_COORDINATOR_ADDRESS."""

    name = "jax"
    launcher = True
    requires = "JAX_NUM_PROCESSES and JAX_PROCESS_ID"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return COUNT in env and INDEX in env

    @staticmethod
    def partial(env: Mapping[str, str]) -> Optional[str]:
        # JAX_COORDINATOR_ADDRESS alone is no job: jax.distributed then asks the cluster (Slurm, MPI) for the rest.
        return partial_pair(env, INDEX, COUNT)

    def read(self, env: Mapping[str, str]) -> Cluster:
        return read_counted(env, self.name, COORDINATOR, COUNT, INDEX)
