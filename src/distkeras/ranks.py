"""Which process am I: helpers for the user's script, which runs whole on every rank of a job.

    if distkeras.is_main_process():
        write_report(history)
    distkeras.print0("data:", x.shape)          # printed once, by rank 0
    log = "log-{}.txt".format(distkeras.rank())  # hvd.rank(), torch.distributed.get_rank()

The rank is read as :func:`distkeras.distribute` reads it (:func:`distkeras.cluster.from_env`: ``distkeras
launch``, torchrun, Slurm, MPI, TF_CONFIG, ...), so the answer is the same before and after ``distribute()``. No
framework is imported. Part of the Python 3.6-compatible core.
"""

from . import cluster as cluster_lib


def is_main_process() -> bool:
    """Whether this process is rank 0 of its job, or not part of a job at all: the process that prints and writes.

    Raises:
        ClusterError: the environment describes a job distkeras can't read (as :func:`distkeras.distribute` would).

    Examples:
        >>> distkeras.is_main_process()   # python train.py, or rank 0 under distkeras launch
        True
    """
    return cluster_lib.from_env().rank == 0


def print0(*args, **kwargs) -> None:
    """``print(*args, **kwargs)`` on rank 0 only (:func:`is_main_process`); nothing on the other ranks.

    Examples:
        >>> distkeras.print0("epochs:", 10)   # once per job, not once per rank
        epochs: 10
    """
    if is_main_process():
        print(*args, **kwargs)


def rank() -> int:
    """This process' rank in its job, 0..``size() - 1`` (0 outside a job): Horovod's ``hvd.rank()``, torch's
    ``dist.get_rank()``. Read from the launcher's or scheduler's variables, before ``distribute()`` or after.

    A plain ``python train.py`` on PyTorch that asks ``distribute(model, 2)`` becomes a job only there: before that
    call its process is rank 0 of 1.

    Examples:
        >>> distkeras.rank()   # under distkeras launch --nproc-per-node 4: 0, 1, 2 or 3
        0
    """
    return cluster_lib.from_env().rank


def size() -> int:
    """The number of worker processes of the job (1 outside a job): Horovod's ``hvd.size()``, torch's
    ``dist.get_world_size()``. Processes, not devices: one process driving 4 GPUs (TensorFlow, JAX) counts once;
    ``distkeras.describe(model)["replicas"]`` gives the replicas."""
    return cluster_lib.from_env().world_size


def local_rank() -> int:
    """This process' rank among the job's processes on this host (0 outside a job): ``hvd.local_rank()``,
    torchrun's ``LOCAL_RANK``."""
    return cluster_lib.from_env().local_rank


def local_size() -> int:
    """The number of the job's processes on this host (1 outside a job): ``hvd.local_size()``, torchrun's
    ``LOCAL_WORLD_SIZE``."""
    return cluster_lib.from_env().local_world_size
