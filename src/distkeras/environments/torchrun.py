"""torchrun / TorchElastic, and any launcher that sets torch.distributed's ``env://`` variables.

torchrun gives each worker (PyTorch docs, "torchrun (Elastic Launch)", *Environment Variables*):
``LOCAL_RANK``, ``RANK``, ``GROUP_RANK``, ``ROLE_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``, ``PYTHON_EXEC``. ``TORCHELASTIC_RUN_ID``
names torchrun itself; plain ``RANK`` / ``WORLD_SIZE`` (``MASTER_ADDR`` / ``MASTER_PORT``) without it
count too -- ``torch.distributed.launch``, a hand-written script, distkeras' own torch re-launch -- but
then a launcher that names itself (Kubeflow's ``PET_*``, MPI's ranks, Ray Train) describes the workers
and these must agree with it. Part of the Python 3.6-compatible core.
"""

from typing import Mapping, Optional

from ..cluster.record import Cluster
from .base import Environment, address, integer, optional_integer, partial_pair, picked

#: What torchrun sets besides the rank variables (all recorded in ``Cluster.variables``).
NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
#: torch.distributed's default port when MASTER_PORT is unset.
DEFAULT_PORT = 29500


def read_env_vars(env: Mapping[str, str], source: str, extra: tuple = ()) -> Cluster:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT as a Cluster with
    ``source``; LOCAL_RANK defaults to RANK and LOCAL_WORLD_SIZE to WORLD_SIZE (one host)."""
    rank = integer(env, "RANK", source)
    world = integer(env, "WORLD_SIZE", source)
    return Cluster(
        rank, world,
        optional_integer(env, "LOCAL_RANK", source, rank),
        optional_integer(env, "LOCAL_WORLD_SIZE", source, world),
        address(env.get("MASTER_ADDR"), env.get("MASTER_PORT") or DEFAULT_PORT),
        source,
        variables=picked(env, NAMES + tuple(extra)),
    )


class TorchElastic(Environment):
    """RANK and WORLD_SIZE set; torchrun's own when TORCHELASTIC_RUN_ID is set too."""

    name = "torchrun"
    launcher = True
    requires = "RANK and WORLD_SIZE (torchrun also sets TORCHELASTIC_RUN_ID)"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    @staticmethod
    def generic(env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" not in env

    @staticmethod
    def partial(env: Mapping[str, str]) -> Optional[str]:
        # MASTER_ADDR / MASTER_PORT alone place nothing (a shell profile may set them): only the ranks count.
        return partial_pair(env, "RANK", "WORLD_SIZE", "LOCAL_RANK")

    def read(self, env: Mapping[str, str]) -> Cluster:
        return read_env_vars(env, self.name)
