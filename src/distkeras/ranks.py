"""Which process am I: helpers for the user's script, which runs whole on every rank of a job.

    if distkeras.is_main_process():
        write_report(history)
    distkeras.print0("data:", x.shape)          # printed once, by rank 0

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
