"""The multi-worker environment, read once into a :class:`Cluster`.

A process learns its place in a job from whichever launcher or scheduler started it. Each one is a
small module of :mod:`distkeras.environments`, tried in this order (innermost launcher first):

1. ``distkeras`` -- ``distkeras launch``: DISTKERAS_LAUNCHER_PID with RANK / WORLD_SIZE / ..., and
   TF_CONFIG for TensorFlow;
2. ``torchrun`` -- torchrun / TorchElastic: RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
   MASTER_ADDR / MASTER_PORT (TORCHELASTIC_RUN_ID);
3. ``ray`` -- Ray Train's workers;
4. ``mpi`` -- Open MPI (OMPI_COMM_WORLD_*), MVAPICH2 (MV2_COMM_WORLD_*), MPICH / Intel MPI (PMI_RANK /
   PMI_SIZE, MPI_LOCALRANKID / MPI_LOCALNRANKS or PMI_LOCAL_RANK / PMI_LOCAL_SIZE);
5. ``kubeflow`` -- Kubeflow's PyTorchJob (RANK / WORLD_SIZE / MASTER_ADDR, PET_*);
6. ``TF_CONFIG`` -- TensorFlow's cluster description (Kubeflow TFJob, Vertex AI);
7. ``jax`` -- JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
8. ``keras`` -- KERAS_DISTRIBUTION_JOB_ADDRESSES / KERAS_DISTRIBUTION_NUM_PROCESSES /
   KERAS_DISTRIBUTION_PROCESS_ID;

then the schedulers: 9. ``kubernetes`` (Indexed Job / JobSet: JOB_COMPLETION_INDEX) and 10. ``slurm``
(``srun`` tasks: SLURM_PROCID / SLURM_NTASKS ...). The first launcher found describes the workers; launchers
that disagree with it on rank or world size are a :class:`ClusterError`. A scheduler describes the workers
only without a launcher; under one (``srun ... torchrun``) it is context. ``DISTKERAS_ENVIRONMENT=<name>``
forces one environment, ``=single`` one process. :mod:`distkeras.environments` has the full rules.

Pure Python: :func:`from_env` takes the environment as a mapping, so tests pass dicts. Exports the record,
:class:`Cluster` and :data:`SINGLE` (defined in :mod:`distkeras.cluster.record`), :func:`from_env` and
:func:`describe`.
Part of the Python 3.6-compatible core.
"""

from typing import Mapping, Optional

from .record import SINGLE, Cluster, describe

__all__ = ["SINGLE", "Cluster", "describe", "from_env"]


def from_env(environ: Optional[Mapping[str, str]] = None) -> Cluster:
    """Read this process' place in the job from its environment.

    Asks the cluster environments of :mod:`distkeras.environments`, in their documented order (see the
    module docstring above).

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        A :class:`Cluster`; :data:`SINGLE` when no launcher or scheduler variables are set.

    Raises:
        ClusterError: malformed variables (TF_CONFIG, a non-integer rank), a rank outside 0..world_size-1,
            two launchers' (or two schedulers') variables that disagree, or a job distkeras can't join.
    """
    from .. import environments  # they import Cluster from .record

    return environments.find(environ).cluster
