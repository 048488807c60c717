"""Kubeflow's PyTorchJob (training-operator v1) and TrainJob (Kubeflow Trainer v2, torch runtime).

What the operators set in each pod's container (read from their source):

- training-operator ``pkg/controller.v1/pytorch/envvar.go`` and ``master.go``, for a PyTorchJob with a Master
  replica: ``MASTER_ADDR`` (the ``<job>-master-0`` service), ``MASTER_PORT`` (the master's ``pytorchjob-port``,
  23456 by default), ``WORLD_SIZE`` (all replicas times ``nprocPerNode``), ``RANK`` (0 for the master, the
  worker index + 1 for a worker: the *pod's* rank), ``PET_NPROC_PER_NODE`` (``spec.nprocPerNode``, "auto" by
  default), ``PET_NODE_RANK`` (= RANK), ``PET_NNODES`` (the replicas), and ``PYTHONUNBUFFERED=0``.
- ``elastic.go``, with ``spec.elasticPolicy``: ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<port>``),
  ``PET_RDZV_BACKEND`` (c10d), ``PET_NNODES`` (``min:max`` or the worker replicas), ``PET_MAX_RESTARTS``,
  ``PET_NPROC_PER_NODE``, ``PET_RDZV_ID``, ``PET_RDZV_CONF``, ``PET_STANDALONE`` -- and no RANK / WORLD_SIZE
  when there is no Master.
- Kubeflow Trainer v2 (``pkg/runtime/framework/plugins/torch``): ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (the pod's ``JOB_COMPLETION_INDEX``), ``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``),
  ``PET_MASTER_PORT`` (29400).

``PET_*`` are torchrun's own options (torch/distributed/argparse_util.py reads ``PET_<OPTION>``): these jobs
are meant to run ``torchrun`` in each pod. Under torchrun (or ``distkeras launch``) in the pod, that
launcher describes the workers and this environment is not detected. A plain ``python train.py`` pod is
read here when it is one process per pod -- ``RANK`` / ``WORLD_SIZE`` with ``nprocPerNode`` 1 or "auto"
(for which the operator counts one process per pod), or Trainer v2's ``PET_NODE_RANK`` / ``PET_NNODES``
with ``PET_NPROC_PER_NODE=1`` -- and is a ClusterError otherwise (several processes per pod, an elastic
job) saying to run torchrun: distkeras never trains alone where the job has more processes.
Part of the Python 3.6-compatible core.
"""

from typing import Mapping

from ..cluster.record import Cluster
from ..errors import ClusterError
from .base import Environment, address, integer, picked
from .torchrun import NAMES as TORCH_NAMES

#: Variables that only Kubeflow sets for a plain process (torchrun and distkeras launch consume them).
MARKERS = ("PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR")
#: A launcher running in the pod: it read the PET_* variables and describes its own workers.
INNER_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "DISTKERAS_LAUNCHER_PID")
RUN_TORCHRUN = ("Run torchrun in the pod (it reads the PET_* variables; `torchrun train.py` starts "
                "distkeras' workers on every Keras backend), or give the job one process per pod "
                "(PyTorchJob nprocPerNode: \"1\"; TrainJob numProcPerNode: 1).")


def _one_per_pod(nproc: str) -> bool:
    """Whether PET_NPROC_PER_NODE means one process per pod for a plain process: 1, or a word ("auto",
    "gpu", "cpu") for which training-operator counts one process per pod in WORLD_SIZE."""
    return nproc == "" or not nproc.isdigit() or int(nproc) == 1


class KubeflowPyTorchJob(Environment):
    """PET_* variables in a pod that runs no launcher of its own."""

    name = "kubeflow"
    launcher = True
    requires = "one of {} without TORCHELASTIC_RUN_ID".format(", ".join(MARKERS))

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return any(m in env for m in MARKERS) and not any(v in env for v in INNER_LAUNCHERS)

    def read(self, env: Mapping[str, str]) -> Cluster:
        variables = picked(env, TORCH_NAMES + ("PYTHONUNBUFFERED",), prefixes=("PET_",))
        nproc = env.get("PET_NPROC_PER_NODE", "").strip()
        if "RANK" in env and "WORLD_SIZE" in env:  # training-operator v1, with a Master replica
            rank, world = integer(env, "RANK", self.name), integer(env, "WORLD_SIZE", self.name)
            if not _one_per_pod(nproc):
                raise ClusterError(
                    "This Kubeflow PyTorchJob runs {} processes per pod (PET_NPROC_PER_NODE={}), so WORLD_SIZE={} "
                    "counts processes but RANK={} is this pod's rank: a plain process can't take its place. {} "
                    "Received: {}".format(nproc, nproc, world, rank, RUN_TORCHRUN, variables))
            coordinator = address(env.get("MASTER_ADDR"), env.get("MASTER_PORT") or "23456")
            return Cluster(rank, world, 0, 1, coordinator, self.name, variables=variables)
        nnodes = env.get("PET_NNODES", "").strip()
        if "PET_NODE_RANK" in env and "PET_MASTER_ADDR" in env and nnodes.isdigit():  # Kubeflow Trainer v2
            if nproc != "1":
                raise ClusterError(
                    "This Kubeflow TrainJob asks torchrun for PET_NPROC_PER_NODE={!r} processes per pod, and "
                    "this process is no torchrun worker. {} Received: {}".format(nproc, RUN_TORCHRUN, variables))
            return Cluster(integer(env, "PET_NODE_RANK", self.name), int(nnodes), 0, 1,
                           address(env["PET_MASTER_ADDR"], env.get("PET_MASTER_PORT") or "29400"), self.name,
                           variables=variables)
        raise ClusterError(
            "This pod belongs to a Kubeflow job meant for torchrun (an elastic PyTorchJob, or no RANK / "
            "WORLD_SIZE): only torchrun can join its rendezvous{}. {} Received: {}".format(
                " at PET_RDZV_ENDPOINT={}".format(env["PET_RDZV_ENDPOINT"]) if env.get("PET_RDZV_ENDPOINT") else "",
                RUN_TORCHRUN, variables))
