"""Kubernetes Indexed Jobs and JobSets: one process per pod, the pod's index its rank.

What Kubernetes sets, and what it doesn't:

- An Indexed Job (``completionMode: Indexed``) gives each pod ``JOB_COMPLETION_INDEX`` (0 .. completions-1)
  and the hostname ``<job-name>-<index>`` (Kubernetes docs, "Indexed Job for Parallel Processing with
  Static Work Assignment" and "Job with Pod-to-Pod Communication"); with ``subdomain: <service>`` and a
  headless service of that name, pod *i* is reachable as ``<job-name>-<i>.<service>``.
- A JobSet runs Indexed Jobs named ``<jobset>-<replicated job>-<job index>``, so its pods are
  ``<jobset>-<replicated job>-<job index>-<pod index>``, under the headless service ``<jobset>`` (or
  ``spec.network.subdomain``). Its facts are pod annotations, which the pod spec exposes through the downward
  API: ``JOBSET_NAME`` (``jobset.sigs.k8s.io/jobset-name``), ``REPLICATED_JOB_NAME``
  (``jobset.sigs.k8s.io/replicatedjob-name``), ``JOB_INDEX`` (``jobset.sigs.k8s.io/job-index``) and
  ``REPLICATED_JOB_REPLICAS`` (``jobset.sigs.k8s.io/replicatedjob-replicas``).
- Nothing in a pod's environment says how many pods the job has, nor the service's name. JAX's
  ``jax/_src/clusters/k8s_cluster.py`` asks the Kubernetes API instead (it needs the ``kubernetes``
  package and a service account allowed to read pods and jobs): process id ``JOB_COMPLETION_INDEX``, process
  count the Job's ``spec.parallelism``, coordinator ``<job-name>-0.<subdomain>:55527`` (for a JobSet's Job,
  subdomain = the JobSet's name). distkeras reads the environment only, so the pod spec sets:

  - ``DISTKERAS_WORLD_SIZE`` -- the number of pods in the job (required; for a JobSet, all its pods);
  - ``DISTKERAS_SERVICE`` -- the headless service (the pods' ``subdomain``); required for an Indexed Job,
    for a JobSet it defaults to ``JOBSET_NAME``;
  - ``DISTKERAS_COORDINATOR`` -- optional ``host`` or ``host:port`` of rank 0, instead of the derived
    ``<job-name>-0.<service>`` (Indexed Job; the job name is the hostname without ``-<index>``) or
    ``<jobset>-<replicated job>-0-0.<service>`` (JobSet);
  - ``DISTKERAS_COORDINATOR_PORT`` -- optional, default 29500 (each pod has its own address).

Rank: ``JOB_COMPLETION_INDEX``, plus, in a JobSet, ``JOB_INDEX`` times the pods per Job
(``DISTKERAS_WORLD_SIZE / REPLICATED_JOB_REPLICAS``): one replicated job of equal Jobs. Worker addresses
(TensorFlow): pod *r* at ``<its hostname>.<service>:<port + 1>``. Several processes per pod: run
``distkeras launch`` (or torchrun) in each pod, and this environment is then only context.
Part of the Python 3.6-compatible core.
"""

from typing import List, Mapping, Optional

from ..cluster.record import Cluster
from ..errors import ClusterError
from .base import Environment, claims_several, integer, picked

INDEX = "JOB_COMPLETION_INDEX"
WORLD_SIZE = "DISTKERAS_WORLD_SIZE"
SERVICE = "DISTKERAS_SERVICE"
COORDINATOR = "DISTKERAS_COORDINATOR"
PORT = "DISTKERAS_COORDINATOR_PORT"
JOBSET = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "REPLICATED_JOB_REPLICAS")
DEFAULT_PORT = 29500


def _port(env: Mapping[str, str]) -> int:
    port = integer(env, PORT, "the pod spec") if env.get(PORT, "") != "" else DEFAULT_PORT
    if not 0 < port < 65535:
        raise ClusterError("Expected {} in 1..65534. Received: {}={!r}".format(PORT, PORT, env[PORT]))
    return port


class KubernetesIndexedJob(Environment):
    """JOB_COMPLETION_INDEX, with DISTKERAS_WORLD_SIZE and DISTKERAS_SERVICE from the pod spec."""

    name = "kubernetes"
    launcher = False
    requires = INDEX

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return INDEX in env

    @staticmethod
    def partial(env: Mapping[str, str]) -> Optional[str]:
        """The pod spec's DISTKERAS_WORLD_SIZE > 1 without JOB_COMPLETION_INDEX: a Job that is not Indexed."""
        if WORLD_SIZE in env and claims_several(env[WORLD_SIZE]):
            return "{}={!r} without {} (is the Job's completionMode Indexed?)".format(WORLD_SIZE, env[WORLD_SIZE], INDEX)
        return None

    def read(self, env: Mapping[str, str]) -> Cluster:
        variables = picked(env, (INDEX, WORLD_SIZE, SERVICE, COORDINATOR, PORT, "HOSTNAME") + JOBSET)
        index = integer(env, INDEX, "Kubernetes")
        if env.get(WORLD_SIZE, "") == "":
            raise ClusterError(
                "This pod is index {} of a Kubernetes Indexed Job, which doesn't tell its pods how many there are. "
                "Set {} (the job's completions; for a JobSet all its pods) in the pod spec, with {} (the headless "
                "service the pods' subdomain names), or {}=single if each pod trains alone. Received: {}".format(
                    index, WORLD_SIZE, SERVICE, "DISTKERAS_ENVIRONMENT", variables))
        world = integer(env, WORLD_SIZE, "the pod spec")
        port = _port(env)
        jobset = env.get("JOBSET_NAME", "")
        if jobset:
            for name in ("REPLICATED_JOB_NAME", "JOB_INDEX", "REPLICATED_JOB_REPLICAS"):
                if env.get(name, "") == "":
                    raise ClusterError(
                        "In a JobSet (JOBSET_NAME={}), distkeras needs {} from the downward API to place this pod. "
                        "Expected JOBSET_NAME, REPLICATED_JOB_NAME, JOB_INDEX and REPLICATED_JOB_REPLICAS (the "
                        "jobset.sigs.k8s.io/ annotations). Received: {}".format(jobset, name, variables))
            jobs = integer(env, "REPLICATED_JOB_REPLICAS", "the pod spec")
            if jobs < 1 or world % jobs:
                raise ClusterError("Expected {} to be a multiple of REPLICATED_JOB_REPLICAS (pods per Job times "
                                   "Jobs). Received: {}".format(WORLD_SIZE, variables))
            per_job = world // jobs
            rank = integer(env, "JOB_INDEX", "JobSet") * per_job + index
            service = env.get(SERVICE) or jobset
            stem = "{}-{}".format(jobset, env["REPLICATED_JOB_NAME"])
            hosts = ["{}-{}-{}.{}".format(stem, r // per_job, r % per_job, service) for r in range(world)]
        else:
            rank = index
            hosts = self._indexed_job_hosts(env, index, world, variables)
        if not 0 <= rank < world:
            raise ClusterError("This pod is rank {} (JOB_COMPLETION_INDEX={}), outside the {}={} pods. Received: "
                               "{}".format(rank, index, WORLD_SIZE, world, variables))
        if env.get(COORDINATOR, "").strip():
            host, sep, given = env[COORDINATOR].strip().rpartition(":")
            coordinator = env[COORDINATOR].strip() if sep and given.isdigit() else "{}:{}".format(
                env[COORDINATOR].strip(), port)
        elif hosts:
            coordinator = "{}:{}".format(hosts[0], port)
        else:
            coordinator = None
        workers = tuple("{}:{}".format(h, port + 1) for h in hosts) if hosts else None
        if world > 1 and coordinator is None:
            raise ClusterError(
                "This pod is rank {} of {} in a Kubernetes Indexed Job, and distkeras can't name rank 0's pod: set {} "
                "to the headless service the pods' subdomain names (pod 0 is then <job-name>-0.<service>), or {} to "
                "rank 0's host. Received: {}".format(rank, world, SERVICE, COORDINATOR, variables))
        return Cluster(rank, world, 0, 1, coordinator if world > 1 else None, self.name, workers=workers,
                       variables=variables)

    @staticmethod
    def _indexed_job_hosts(env: Mapping[str, str], index: int, world: int, variables: dict) -> Optional[List[str]]:
        """Every pod's DNS name, ``<job-name>-<i>.<service>``, or None without a service or hostname."""
        service = env.get(SERVICE, "").strip()
        hostname = env.get("HOSTNAME", "").split(".")[0]
        suffix = "-{}".format(index)
        if not service or not hostname.endswith(suffix):
            return None
        job = hostname[:-len(suffix)]
        return ["{}-{}.{}".format(job, i, service) for i in range(world)]
