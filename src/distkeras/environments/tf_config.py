"""TF_CONFIG: TensorFlow's own cluster description (Kubeflow TFJob, Vertex AI, ``distkeras launch`` for
TensorFlow, or set by hand).

``{"cluster": {"chief": [...], "worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}``:
the chief (if any) is rank 0, then the workers in order. It names every worker's address, so the
:class:`~distkeras.cluster.Cluster` it gives has ``workers``. Part of the Python 3.6-compatible core.
"""

import json
from typing import List, Mapping, Tuple

from ..cluster.record import Cluster
from ..errors import ClusterError
from .base import Environment

VARIABLE = "TF_CONFIG"
#: Holds the TF_CONFIG distkeras' TensorFlow adapter wrote itself, from another environment's description of
#: the job (Slurm's host list, torchrun's store): that TF_CONFIG is a consequence, not an environment.
WRITTEN = "DISTKERAS_WROTE_TF_CONFIG"


def parse(text: str) -> Tuple[Cluster, List[str]]:
    """TF_CONFIG's text -> ``(cluster, members)``: this task's place, and every member's ``host:port`` in
    rank order (chief first). Raises ClusterError for anything distkeras can't run (parameter servers)."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ClusterError("TF_CONFIG is not valid JSON ({}). Received: TF_CONFIG={!r}".format(exc, text))
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterError(
            'TF_CONFIG needs a "cluster" object, e.g. {{"cluster": {{"worker": ["host1:port", "host2:port"]}}, '
            '"task": {{"type": "worker", "index": 0}}}}. Received: TF_CONFIG={!r}'.format(text)
        )
    cluster = config["cluster"]
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterError(
            'TF_CONFIG needs "task": {{"type": ..., "index": ...}}. Received: TF_CONFIG={!r}'.format(text))
    unknown = sorted(set(cluster) - {"chief", "worker", "evaluator", "ps"})
    if unknown:
        raise ClusterError("TF_CONFIG names unknown job types {}. Known: chief, worker, evaluator, ps.".format(unknown))
    if cluster.get("ps"):
        raise ClusterError(
            "TF_CONFIG describes a parameter-server cluster; distkeras runs synchronous all-reduce training "
            "(MultiWorkerMirroredStrategy). Remove the 'ps' jobs."
        )
    for job in ("chief", "worker"):
        if not isinstance(cluster.get(job, []), list):
            raise ClusterError(
                "TF_CONFIG cluster.{} must be a list of 'host:port'. Received: {!r}".format(job, cluster[job]))
    chiefs: List[str] = cluster.get("chief", [])
    workers: List[str] = cluster.get("worker", [])
    if len(chiefs) > 1:
        raise ClusterError("TF_CONFIG may name at most one chief. Received: {!r}".format(chiefs))
    members = chiefs + workers
    if not members:
        raise ClusterError("TF_CONFIG names no chief and no worker. Received: TF_CONFIG={!r}".format(text))
    kind, index = task["type"], task["index"]
    if kind not in ("chief", "worker") or not isinstance(index, int) or isinstance(index, bool):
        raise ClusterError(
            'TF_CONFIG task must be {{"type": "chief" or "worker", "index": int}}. Received: {!r}'.format(task)
        )
    of_kind = chiefs if kind == "chief" else workers
    if not 0 <= index < len(of_kind):
        raise ClusterError(
            "TF_CONFIG task {}:{} is not in the cluster, which has {} {}(s).".format(kind, index, len(of_kind), kind)
        )
    rank = index if kind == "chief" else len(chiefs) + index
    host = of_kind[index].rsplit(":", 1)[0]
    local = [m for m in members if m.rsplit(":", 1)[0] == host]
    local_rank = local.index(of_kind[index])
    return Cluster(rank, len(members), local_rank, len(local), members[0], "TF_CONFIG"), members


class TFConfig(Environment):
    """TF_CONFIG set (not blank). Coordinator: the first member's address; workers: every member's."""

    name = "TF_CONFIG"
    launcher = True
    requires = "TF_CONFIG"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        text = env.get(VARIABLE, "").strip()
        return bool(text) and text != env.get(WRITTEN, "").strip()

    def read(self, env: Mapping[str, str]) -> Cluster:
        cluster, members = parse(env[VARIABLE])
        return cluster._replace(workers=tuple(members), variables={VARIABLE: env[VARIABLE]})
