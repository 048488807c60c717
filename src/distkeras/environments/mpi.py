"""MPI launchers: Open MPI, MVAPICH2, and MPICH / Intel MPI (Hydra) / Cray PMI.

What each sets in every rank:

- Open MPI (``mpirun``; its docs, "Environment variables set for MPI applications"):
  ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE`` (and ``OMPI_COMM_WORLD_NODE_RANK``, ``OMPI_UNIVERSE_SIZE``).
- MVAPICH2: ``MV2_COMM_WORLD_RANK``, ``MV2_COMM_WORLD_SIZE``, ``MV2_COMM_WORLD_LOCAL_RANK``,
  ``MV2_COMM_WORLD_LOCAL_SIZE``.
- MPICH's and Intel MPI's Hydra (``mpiexec``/``mpiexec.hydra``; also ``srun --mpi=pmi2``): ``PMI_RANK``,
  ``PMI_SIZE``, with the host's ranks in ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS`` (Hydra's proxy) or, on
  Cray MPICH / PALS, ``PMI_LOCAL_RANK`` / ``PMI_LOCAL_SIZE``.

``srun --mpi=pmi2`` (or ``MpiDefault=pmi2`` in slurm.conf) gives every Slurm task ``PMI_RANK`` /
``PMI_SIZE`` equal to its ``SLURM_PROCID`` / ``SLURM_NTASKS``, without Hydra's ``MPI_LOCALRANKID``: those are
Slurm's tasks, not an MPI launcher's ranks, and are left to the Slurm environment (which knows the hosts).

MPI names no coordinator address: one comes from another environment that agrees (torchrun variables set
by a wrapper script, Slurm's first node), else the adapter needs ``distkeras launch``. Without local
variables, the job is taken to be on one host (local rank = rank), as before.
Part of the Python 3.6-compatible core.
"""

from typing import List, Mapping, Optional, Sequence, Tuple

from ..cluster.record import Cluster
from .base import Environment, integer, optional_integer, partial_pair, picked

#: (implementation, rank, size, [(local rank, local size), ...]) in the order they are tried.
FLAVOURS: Sequence[Tuple[str, str, str, Sequence[Tuple[str, str]]]] = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),)),
    ("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
     (("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),)),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE",
     (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"))),
)
#: Recorded in Cluster.variables when present.
CONTEXT = ("OMPI_COMM_WORLD_NODE_RANK", "OMPI_UNIVERSE_SIZE", "PMI_FD", "PMI_PORT", "PMI_ID", "PMI_JOBID",
           "PMIX_RANK", "PMIX_NAMESPACE")


def srun_pmi(env: Mapping[str, str]) -> bool:
    """Whether PMI_RANK / PMI_SIZE are srun's own (``srun --mpi=pmi2``): Slurm's task id and count, in a
    Slurm step, without Hydra's MPI_LOCALRANKID."""
    return ("SLURM_STEP_ID" in env and "MPI_LOCALRANKID" not in env
            and env.get("PMI_RANK") == env.get("SLURM_PROCID") and env.get("PMI_SIZE") == env.get("SLURM_NTASKS"))


def _flavours(env: Mapping[str, str]) -> List[Tuple[str, str, str, Sequence[Tuple[str, str]]]]:
    return [f for f in FLAVOURS if f[1] in env and f[2] in env and not (f[1] == "PMI_RANK" and srun_pmi(env))]


class MPI(Environment):
    """An MPI rank: the first of Open MPI's, MVAPICH2's and PMI's rank and size pairs that is set."""

    name = "mpi"
    launcher = True
    requires = "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_RANK and MV2_COMM_WORLD_SIZE, " \
               "or PMI_RANK and PMI_SIZE"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return bool(_flavours(env))

    @staticmethod
    def partial(env: Mapping[str, str]) -> Optional[str]:
        found = [partial_pair(env, rank_var, size_var) for _, rank_var, size_var, _ in FLAVOURS]
        return "; ".join(f for f in found if f) or None

    def read(self, env: Mapping[str, str]) -> Cluster:
        _, rank_var, size_var, locals_ = _flavours(env)[0]
        rank = integer(env, rank_var, self.name)
        world = integer(env, size_var, self.name)
        local_rank, local_size = rank, world  # no local variables: one host, as before
        names = [rank_var, size_var]
        for local_var, local_size_var in locals_:
            if env.get(local_var, "") != "":
                local_rank = integer(env, local_var, self.name)
                local_size = optional_integer(env, local_size_var, self.name, world)
                names += [local_var, local_size_var]
                break
        return Cluster(rank, world, local_rank, local_size, None, self.name,
                       variables=picked(env, tuple(names) + CONTEXT))
