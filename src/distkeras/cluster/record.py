"""The :class:`Cluster` record: where this process stands in a job, and :data:`SINGLE`, one process alone.

Read from the environment by :func:`distkeras.cluster.from_env`; built by the plugins of
:mod:`distkeras.environments`. Part of the Python 3.6-compatible core.
"""

import typing
from typing import Dict, Optional, Tuple


class Cluster(
    typing.NamedTuple(
        "Cluster",
        [
            ("rank", int),
            ("world_size", int),
            ("local_rank", int),
            ("local_world_size", int),
            ("coordinator", Optional[str]),
            ("source", str),
            ("workers", Optional[Tuple[str, ...]]),
            ("variables", Optional[Dict[str, str]]),
        ],
    )
):
    """Where this process stands in a job.

    Attributes:
        rank: this process' global rank, 0 .. world_size-1. Rank 0 prints and writes.
        world_size: the number of worker processes in the job.
        local_rank: the rank among the processes on this host.
        local_world_size: the number of worker processes on this host.
        coordinator: ``host:port`` of rank 0's rendezvous service, or None for one process.
        source: the name of the environment it was read from (``"single"``, ``"distkeras"``, ``"torchrun"``,
            ``"ray"``, ``"mpi"``, ``"kubeflow"``, ``"TF_CONFIG"``, ``"jax"``, ``"keras"``, ``"kubernetes"``,
            ``"slurm"``).
        workers: every rank's ``host:port``, in rank order, where the environment tells it (TensorFlow's
            TF_CONFIG needs one address per worker); None where it doesn't (the adapter then exchanges
            addresses through the rendezvous the launcher made).
        variables: the environment variables this was read from, ``{name: value}`` (for ``distkeras info``
            and error messages); None for :data:`SINGLE`.
    """

    __slots__ = ()

    @property
    def is_multi_worker(self):
        return self.world_size > 1

    @property
    def is_chief(self):
        return self.rank == 0


Cluster.__new__.__defaults__ = (None, None)  # workers, variables: Python 3.6's NamedTuple has no defaults

SINGLE = Cluster(rank=0, world_size=1, local_rank=0, local_world_size=1, coordinator=None, source="single")


def describe(cluster: Cluster) -> Dict[str, object]:
    """The cluster as a plain dict (for :func:`distkeras.describe`)."""
    return {"rank": cluster.rank, "workers": cluster.world_size, "local_rank": cluster.local_rank,
            "source": cluster.source}
