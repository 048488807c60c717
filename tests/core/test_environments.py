"""The cluster environments (distkeras.environments): each one's variables, and the rules between them.

Every test passes the exact environment the launcher or scheduler sets, as a dict; the source of each
variable list is cited where it is used.
"""

import json
import sys
import types

import pytest

from distkeras import ClusterError, backends, environments
from distkeras.launch import command as launch
from distkeras.backends.base import LaunchJob
from distkeras.cluster import SINGLE, Cluster, from_env
from distkeras.environments import base, mpi, tf_config


# --- the registry ----------------------------------------------------------------------------------------

def test_registry_order_is_the_documented_one():
    names = [entry.partition(":")[0] for entry in environments.REGISTRY]
    assert names == ["distkeras", "torchrun", "ray", "mpi", "kubeflow", "tf_config", "jax", "keras", "kubernetes",
                     "slurm"]
    for cls in environments.available():
        assert issubclass(cls, base.Environment) and cls.name
        assert cls.launcher == (cls.__module__.rpartition(".")[2] not in ("kubernetes", "slurm")), cls


def test_get_finds_an_environment_by_name():
    assert environments.get("TF_CONFIG") is environments.get("tf_config") is tf_config.TFConfig
    assert environments.get("MPI") is mpi.MPI and environments.get("pbs") is None


def test_a_module_missing_from_the_install_is_skipped(monkeypatch):
    monkeypatch.setattr(environments, "REGISTRY", ["no_such_module:Nothing"] + environments.REGISTRY)
    assert environments.missing()[0] == "no_such_module:Nothing"
    assert [c.name for c in environments.available()][0] == "distkeras"
    assert from_env({"RANK": "1", "WORLD_SIZE": "2"}).source == "torchrun"
    assert from_env({}) == SINGLE


def test_a_broken_module_is_an_error_not_skipped(monkeypatch):
    # A module that is there but imports something missing is a bug to see, not an absent environment.
    module = "distkeras.environments.broken_for_test"
    def boom(name, *args, **kwargs):
        if name == module:
            raise ModuleNotFoundError("No module named 'somedependency'", name="somedependency")
        return real(name, *args, **kwargs)
    real = environments.importlib.import_module
    monkeypatch.setattr(environments.importlib, "import_module", boom)
    monkeypatch.setattr(environments, "REGISTRY", ["broken_for_test:Broken"])
    with pytest.raises(ModuleNotFoundError, match="somedependency"):
        from_env({})


class _FakeScheduler(base.Environment):
    """A scheduler for the rule tests: FAKE_TASK / FAKE_TASKS, coordinator FAKE_HEAD:1234."""
    name = "fakesched"
    launcher = False
    requires = "FAKE_TASK and FAKE_TASKS"

    @staticmethod
    def detect(env):
        return "FAKE_TASK" in env and "FAKE_TASKS" in env

    def read(self, env):
        rank, world = base.integer(env, "FAKE_TASK", self.name), base.integer(env, "FAKE_TASKS", self.name)
        return Cluster(rank, world, 0, 1, base.address(env.get("FAKE_HEAD"), 1234), self.name,
                       variables=base.picked(env, prefixes=("FAKE_",)))


class _OtherScheduler(_FakeScheduler):
    name = "othersched"

    @staticmethod
    def detect(env):
        return "OTHER_TASK" in env

    def read(self, env):
        return Cluster(base.integer(env, "OTHER_TASK", self.name), base.integer(env, "OTHER_TASKS", self.name),
                       0, 1, None, self.name, variables=base.picked(env, prefixes=("OTHER_",)))


@pytest.fixture
def schedulers(monkeypatch):
    module = types.ModuleType("distkeras.environments.fake_for_test")
    module.FakeScheduler, module.OtherScheduler = _FakeScheduler, _OtherScheduler
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(environments, "REGISTRY", environments.REGISTRY + [
        "fake_for_test:FakeScheduler", "fake_for_test:OtherScheduler"])


# --- the rules -------------------------------------------------------------------------------------------

def test_a_scheduler_alone_describes_the_workers(schedulers):
    c = from_env({"FAKE_TASK": "1", "FAKE_TASKS": "2", "FAKE_HEAD": "node1"})
    assert (c.rank, c.world_size, c.coordinator, c.source) == (1, 2, "node1:1234", "fakesched")
    assert c.variables == {"FAKE_HEAD": "node1", "FAKE_TASK": "1", "FAKE_TASKS": "2"}


def test_a_scheduler_under_a_launcher_is_context(schedulers):
    # srun --ntasks-per-node=1 ... torchrun --nproc-per-node 2: the Slurm task is rank 1 of 2 nodes; torchrun's
    # worker is rank 3 of 4. torchrun's describes the worker, the scheduler's is context and lends nothing.
    env = {"FAKE_TASK": "1", "FAKE_TASKS": "2", "FAKE_HEAD": "node1", "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
    found = environments.find(env)
    assert (found.cluster.rank, found.cluster.world_size, found.cluster.source) == (3, 4, "torchrun")
    assert found.cluster.coordinator is None  # no MASTER_ADDR; nothing borrowed from the scheduler
    assert [(name, why.split(",")[0]) for name, _, why in found.context] == [("fakesched", "context under torchrun")]
    assert found.context[0][1] == {"FAKE_HEAD": "node1", "FAKE_TASK": "1", "FAKE_TASKS": "2"}


def test_a_scheduler_that_cant_be_read_under_a_launcher_is_no_error(schedulers):
    found = environments.find({"FAKE_TASK": "x", "FAKE_TASKS": "2", "RANK": "0", "WORLD_SIZE": "1"})
    assert found.cluster.source == "torchrun"
    assert "Expected an integer in FAKE_TASK" in found.context[0][2]
    with pytest.raises(ClusterError, match="Expected an integer in FAKE_TASK"):
        from_env({"FAKE_TASK": "x", "FAKE_TASKS": "2"})  # alone, it describes the job: an error


def test_two_schedulers_that_disagree_are_an_error(schedulers):
    env = {"FAKE_TASK": "0", "FAKE_TASKS": "2", "OTHER_TASK": "1", "OTHER_TASKS": "2"}
    with pytest.raises(ClusterError, match="fakesched says rank 0 of 2, othersched says rank 1 of 2.*scheduler"):
        from_env(env)
    env["OTHER_TASK"] = "0"
    assert from_env(env).source == "fakesched"


def test_two_launchers_that_disagree_are_an_error():
    env = {"RANK": "0", "WORLD_SIZE": "2", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    with pytest.raises(ClusterError, match="torchrun says rank 0 of 2, jax says rank 1 of 2.*launcher"):
        from_env(env)


def test_a_launcher_that_names_itself_wins_over_plain_rank_variables():
    # A wrapper that copies Open MPI's ranks into RANK / WORLD_SIZE / MASTER_ADDR (a common mpirun recipe):
    # MPI describes the worker (with its local ranks), the coordinator comes from the torch variables.
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h1", "MASTER_PORT": "7"}
    found = environments.find(env)
    assert (found.cluster.source, found.cluster.local_rank, found.cluster.coordinator) == ("mpi", 1, "h1:7")
    assert [c.source for c in found.agreeing] == ["mpi", "torchrun"]
    # torchrun's own (TORCHELASTIC_RUN_ID) comes first, in the registry's order.
    env["TORCHELASTIC_RUN_ID"] = "job"
    assert environments.find(env).cluster.source == "torchrun"


def test_worker_addresses_come_from_an_agreeing_launcher():
    env = dict(tf_env(["a:1", "b:1"], 1), RANK="1", WORLD_SIZE="2", MASTER_ADDR="a", MASTER_PORT="9",
               TORCHELASTIC_RUN_ID="x")
    c = from_env(env)
    assert (c.source, c.coordinator, c.workers) == ("torchrun", "a:9", ("a:1", "b:1"))


def test_distkeras_environment_forces_one(schedulers):
    env = {"RANK": "1", "WORLD_SIZE": "2", "FAKE_TASK": "0", "FAKE_TASKS": "4",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}  # disagreeing: only the forced one is read
    c = from_env(dict(env, DISTKERAS_ENVIRONMENT="fakesched"))
    assert (c.rank, c.world_size, c.source) == (0, 4, "fakesched")
    assert c.variables["DISTKERAS_ENVIRONMENT"] == "fakesched"
    assert from_env(dict(env, DISTKERAS_ENVIRONMENT="torchrun")).rank == 1
    c = from_env(dict(env, DISTKERAS_ENVIRONMENT="single"))
    assert (c.rank, c.world_size, c.source, c.coordinator) == (0, 1, "single", None)
    assert from_env(dict(tf_env(["a:1", "b:1"], 1), DISTKERAS_ENVIRONMENT="tf_config")).source == "TF_CONFIG"


def test_a_forced_environment_must_be_present_and_known():
    with pytest.raises(ClusterError, match=r"DISTKERAS_ENVIRONMENT=mpi asks for the mpi environment, but its "
                                           r"variables are absent: expected OMPI_COMM_WORLD_RANK"):
        from_env({"RANK": "0", "WORLD_SIZE": "2", "DISTKERAS_ENVIRONMENT": "mpi"})
    with pytest.raises(ClusterError, match=r"Expected DISTKERAS_ENVIRONMENT to name a cluster environment: "
                                           r"distkeras, torchrun, .* or single.*Received: DISTKERAS_ENVIRONMENT='pbs'"):
        from_env({"DISTKERAS_ENVIRONMENT": "pbs"})


def test_impossible_ranks_are_errors_for_every_environment():
    for env, match in [
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "Rank 2 from mpi is outside 0..1"),
        ({"JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"}, "world size >= 1 from jax"),
        ({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, "Local rank 2 from mpi"),
        ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "two", "KERAS_DISTRIBUTION_PROCESS_ID": "0"},
         "Expected an integer in KERAS_DISTRIBUTION_NUM_PROCESSES"),
    ]:
        with pytest.raises(ClusterError, match=match):
            from_env(env)


# --- each environment ------------------------------------------------------------------------------------

def tf_env(workers, index, kind="worker", chief=None):
    cluster = {"worker": workers}
    if chief:
        cluster["chief"] = chief
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})}


def test_distkeras_launch_with_tf_config_gives_every_worker():
    # Exactly what `distkeras launch --backend tensorflow --nnodes 2 --nproc-per-node 2` gives rank 3.
    env = launch.worker_env("tensorflow", 3, 4, 1, 2, "10.0.0.1:29401")
    job = LaunchJob(2, 2, 1, "10.0.0.1:29401", ["10.0.0.1", "10.0.0.2"])
    env.update(backends.adapter_class("tensorflow").workers_env(job, {})[1])
    env[launch.LAUNCHER_ENV] = "4242"
    found = environments.find(env)
    c = found.cluster
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.source) == (3, 4, 1, 2, "distkeras")
    assert c.coordinator == "10.0.0.1:29401"
    assert c.workers == ("10.0.0.1:29401", "10.0.0.1:29402", "10.0.0.2:29401", "10.0.0.2:29402")
    assert c.variables["DISTKERAS_LAUNCHER_PID"] == "4242" and "TF_CONFIG" in c.variables
    assert c.variables["JAX_PROCESS_ID"] == "3" and "KERAS_BACKEND" not in c.variables
    assert [a.source for a in found.agreeing] == ["distkeras", "torchrun", "TF_CONFIG", "jax"]


def test_distkeras_launch_without_tf_config_and_its_parameter_servers():
    env = launch.worker_env("jax", 0, 2, 0, 2, "127.0.0.1:5000")
    env[launch.LAUNCHER_ENV] = "1"
    c = from_env(env)
    assert (c.source, c.coordinator, c.workers) == ("distkeras", "127.0.0.1:5000", None)
    # MXNet's scheduler and servers carry the launcher's PID but no rank: they are no workers.
    job = LaunchJob(2, 1, 0, "127.0.0.1:5000", None)
    role_env = backends.adapter_class("mxnet").launch_roles(job, dict(env))[0][1]
    assert from_env(role_env) == SINGLE


def test_distkeras_launch_tf_config_must_agree():
    env = dict(tf_env(["a:1", "b:1"], 0), DISTKERAS_LAUNCHER_PID="1", RANK="1", WORLD_SIZE="2")
    with pytest.raises(ClusterError, match="RANK=1 WORLD_SIZE=2, but TF_CONFIG says rank 0 of 2"):
        from_env(env)


def test_torchrun_sets():
    # torchrun --nnodes 2 --nproc-per-node 2, worker 3 (PyTorch docs, torchrun "Environment Variables").
    env = {"LOCAL_RANK": "1", "RANK": "3", "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "default",
           "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "PYTHON_EXEC": "/usr/bin/python3", "OMP_NUM_THREADS": "1"}
    c = from_env(env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.coordinator, c.source, c.workers) == (
        3, 4, 1, 2, "node0:29500", "torchrun", None)
    assert c.variables["TORCHELASTIC_RUN_ID"] == "job7" and "OMP_NUM_THREADS" not in c.variables
    # Plain variables count too; MASTER_PORT defaults to torch's 29500, local ranks to one host.
    c = from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    assert (c.local_rank, c.local_world_size, c.coordinator) == (1, 2, "h:29500")


def test_tf_config_gives_workers():
    c = from_env(tf_env(["h2:1", "h3:1"], 1, chief=["h1:1"]))
    assert (c.rank, c.world_size, c.source, c.workers) == (2, 3, "TF_CONFIG", ("h1:1", "h2:1", "h3:1"))
    assert c.variables == tf_env(["h2:1", "h3:1"], 1, chief=["h1:1"])
    assert tf_config.parse('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}')[1] == ["a:1"]


@pytest.mark.parametrize("env,expected", [
    # Open MPI: mpirun -n 4 --npernode 2, rank 3 (Open MPI docs, "Environment variables set for MPI applications").
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "4"}, (3, 4, 1, 2)),
    # MPICH / Intel MPI Hydra: mpiexec -n 4 -ppn 2 (Hydra's proxy sets MPI_LOCALRANKID / MPI_LOCALNRANKS).
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (2, 4, 0, 2)),
    # Cray MPICH / PALS: PMI_LOCAL_RANK / PMI_LOCAL_SIZE.
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4"}, (5, 8, 1, 4)),
    # MVAPICH2.
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
      "MV2_COMM_WORLD_LOCAL_SIZE": "1"}, (1, 2, 0, 1)),
    # No local variables: one host, as before.
    ({"PMI_RANK": "1", "PMI_SIZE": "3"}, (1, 3, 1, 3)),
])
def test_mpi_flavours(env, expected):
    c = from_env(env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == expected
    assert (c.source, c.coordinator) == ("mpi", None)
    assert set(c.variables) == set(env)


def test_srun_pmi_variables_are_slurms_tasks_not_an_mpi_launcher():
    # srun --mpi=pmi2 gives each task PMI_RANK / PMI_SIZE equal to SLURM_PROCID / SLURM_NTASKS.
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5", "PMI_JOBID": "7.0", "SLURM_PROCID": "1",
           "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    assert not mpi.MPI.detect(env) and mpi.srun_pmi(env)
    # Hydra inside an allocation (its proxies started by srun) is an MPI launcher.
    assert mpi.MPI.detect(dict(env, MPI_LOCALRANKID="0", MPI_LOCALNRANKS="1"))
    assert mpi.MPI.detect(dict(env, PMI_SIZE="4"))


def test_jax_and_keras_variables():
    c = from_env({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                  "JAX_PLATFORMS": "cpu"})
    assert (c.rank, c.world_size, c.coordinator, c.source) == (1, 2, "h:1234", "jax")
    assert sorted(c.variables) == ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]
    c = from_env({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1, b:1", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                  "KERAS_DISTRIBUTION_PROCESS_ID": "0"})
    assert (c.rank, c.world_size, c.coordinator, c.source) == (0, 2, "a:1", "keras")


def test_the_launcher_variable_is_the_launchers():
    from distkeras.environments import distkeras as ours
    assert ours.LAUNCHER_ENV == launch.LAUNCHER_ENV


def test_cluster_from_env_reads_os_environ(monkeypatch):
    for name in list(__import__("os").environ):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert from_env().source == "mpi"


# --- Kubeflow ---------------------------------------------------------------------------------------------

#: training-operator v1 (pkg/controller.v1/pytorch/envvar.go, master.go): a PyTorchJob "mnist" with a Master
#: and 2 Workers, nprocPerNode unset ("auto"), the default port 23456; this is worker 1's pod.
KUBEFLOW_V1 = {"PYTHONUNBUFFERED": "0", "MASTER_PORT": "23456", "MASTER_ADDR": "mnist-master-0", "WORLD_SIZE": "3",
               "RANK": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "2", "PET_NNODES": "3"}
#: Kubeflow Trainer v2 torch plugin: a TrainJob "mnist" of 2 nodes; this is node 1 (a JobSet pod).
KUBEFLOW_V2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
               "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29400", "JOB_COMPLETION_INDEX": "1"}
#: training-operator v1 elastic.go: a PyTorchJob with elasticPolicy (no Master: no RANK / WORLD_SIZE).
KUBEFLOW_ELASTIC = {"PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": "mnist-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
                    "PET_NNODES": "1:3", "PET_MAX_RESTARTS": "3", "PET_NPROC_PER_NODE": "1"}


def test_kubeflow_pytorchjob_plain_process_per_pod():
    found = environments.find(KUBEFLOW_V1)
    c = found.cluster
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (2, 3, 0, 1)
    assert (c.source, c.coordinator) == ("kubeflow", "mnist-master-0:23456")
    assert c.variables == KUBEFLOW_V1
    assert [a.source for a in found.agreeing] == ["kubeflow", "torchrun"]  # the plain RANK variables agree
    # Before nprocPerNode (training-operator < 1.7): only the torch variables; read as torchrun's.
    old = {k: v for k, v in KUBEFLOW_V1.items() if not k.startswith("PET_")}
    assert from_env(old)[:6] == (2, 3, 2, 3, "mnist-master-0:23456", "torchrun")


def test_kubeflow_pytorchjob_with_several_processes_per_pod_needs_torchrun():
    # nprocPerNode: "2": WORLD_SIZE counts 6 processes, RANK is the pod's.
    env = dict(KUBEFLOW_V1, WORLD_SIZE="6", PET_NPROC_PER_NODE="2")
    with pytest.raises(ClusterError, match=r"runs 2 processes per pod .*WORLD_SIZE=6.*RANK=2.*Run torchrun"):
        from_env(env)
    # torchrun in the pod read PET_* and set its own ranks: torchrun describes the workers.
    inner = dict(env, RANK="5", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="mnist",
                 MASTER_ADDR="mnist-master-0", MASTER_PORT="23456")
    c = from_env(inner)
    assert (c.rank, c.world_size, c.local_rank, c.source) == (5, 6, 1, "torchrun")


def test_kubeflow_trainer_v2():
    found = environments.find(KUBEFLOW_V2)
    c = found.cluster
    assert (c.rank, c.world_size, c.coordinator, c.source) == (1, 2, "mnist-node-0-0.mnist:29400", "kubeflow")
    assert [name for name, _, _ in found.context] == ["kubernetes"]  # the JobSet pod's index: context
    with pytest.raises(ClusterError, match=r"PET_NPROC_PER_NODE='auto'.*Run torchrun"):
        from_env(dict(KUBEFLOW_V2, PET_NPROC_PER_NODE="auto"))


def test_kubeflow_elastic_job_needs_torchrun():
    with pytest.raises(ClusterError, match=r"only torchrun can join its rendezvous at "
                                           r"PET_RDZV_ENDPOINT=mnist-worker-0:23456"):
        from_env(KUBEFLOW_ELASTIC)
    # Under `distkeras launch` in the pod, the PET_* variables are no longer the workers'.
    env = dict(KUBEFLOW_ELASTIC, DISTKERAS_LAUNCHER_PID="7", RANK="1", WORLD_SIZE="2")
    assert from_env(env).source == "distkeras"


# --- Kubernetes Indexed Job / JobSet ----------------------------------------------------------------------

#: An Indexed Job "train" (completions: 3, subdomain: workers); pod 2. Kubernetes sets JOB_COMPLETION_INDEX
#: and the hostname train-2; the pod spec sets DISTKERAS_WORLD_SIZE and DISTKERAS_SERVICE.
INDEXED = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "train-2", "DISTKERAS_WORLD_SIZE": "3",
           "DISTKERAS_SERVICE": "workers", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
#: A JobSet "js" with one replicated job "w" of 2 Jobs x 2 pods; pod 1 of Job 1. The JobSet annotations are
#: exposed by the downward API (fieldPath: metadata.annotations['jobset.sigs.k8s.io/...']).
JOBSET = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "js-w-1-1", "JOBSET_NAME": "js", "REPLICATED_JOB_NAME": "w",
          "JOB_INDEX": "1", "REPLICATED_JOB_REPLICAS": "2", "DISTKERAS_WORLD_SIZE": "4"}


def test_kubernetes_indexed_job():
    c = from_env(INDEXED)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.source) == (2, 3, 0, 1, "kubernetes")
    assert c.coordinator == "train-0.workers:29500"
    assert c.workers == ("train-0.workers:29501", "train-1.workers:29501", "train-2.workers:29501")
    assert "KUBERNETES_SERVICE_HOST" not in c.variables and c.variables["JOB_COMPLETION_INDEX"] == "2"
    c = from_env(dict(INDEXED, DISTKERAS_COORDINATOR_PORT="4000"))
    assert (c.coordinator, c.workers[1]) == ("train-0.workers:4000", "train-1.workers:4001")
    c = from_env(dict(INDEXED, DISTKERAS_COORDINATOR="10.0.0.5"))
    assert c.coordinator == "10.0.0.5:29500"


def test_kubernetes_jobset():
    c = from_env(JOBSET)
    assert (c.rank, c.world_size, c.source, c.coordinator) == (3, 4, "kubernetes", "js-w-0-0.js:29500")
    assert c.workers == ("js-w-0-0.js:29501", "js-w-0-1.js:29501", "js-w-1-0.js:29501", "js-w-1-1.js:29501")
    assert from_env(dict(JOBSET, DISTKERAS_SERVICE="net")).coordinator == "js-w-0-0.net:29500"


@pytest.mark.parametrize("change,match", [
    ({"DISTKERAS_WORLD_SIZE": None}, r"index 2 of a Kubernetes Indexed Job, which doesn't tell its pods how many"),
    ({"DISTKERAS_SERVICE": None}, r"can't name rank 0's pod: set DISTKERAS_SERVICE"),
    ({"DISTKERAS_WORLD_SIZE": "2"}, r"rank 2 \(JOB_COMPLETION_INDEX=2\), outside the DISTKERAS_WORLD_SIZE=2 pods"),
    ({"JOBSET_NAME": "js"}, r"needs REPLICATED_JOB_NAME from the downward API"),
])
def test_kubernetes_without_what_it_needs(change, match):
    env = dict(INDEXED)
    for name, value in change.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    with pytest.raises(ClusterError, match=match):
        from_env(env)


def test_kubernetes_pods_that_train_alone_say_so():
    assert from_env(dict(INDEXED, DISTKERAS_ENVIRONMENT="single")).world_size == 1
    c = from_env({"JOB_COMPLETION_INDEX": "0", "DISTKERAS_WORLD_SIZE": "1"})
    assert (c.world_size, c.coordinator, c.source) == (1, None, "kubernetes")


def test_kubernetes_under_a_launcher_is_context():
    # distkeras launch --nproc-per-node 2 in pod 2 of the Indexed Job (the launch gets nnodes from the user).
    env = dict(INDEXED, DISTKERAS_LAUNCHER_PID="9", RANK="5", WORLD_SIZE="6", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="train-0.workers", MASTER_PORT="29500")
    found = environments.find(env)
    assert (found.cluster.rank, found.cluster.world_size, found.cluster.source) == (5, 6, "distkeras")
    assert [(name, vars_["JOB_COMPLETION_INDEX"]) for name, vars_, _ in found.context] == [("kubernetes", "2")]
    # ... also when the pod spec gives no world size: context, not an error.
    del env["DISTKERAS_WORLD_SIZE"]
    assert "doesn't tell its pods how many" in environments.find(env).context[0][2]


# --- distkeras info ---------------------------------------------------------------------------------------

def test_info_names_the_environment_and_its_variables():
    from distkeras.cli import environment_report
    env = dict(INDEXED, DISTKERAS_LAUNCHER_PID="9", RANK="5", WORLD_SIZE="6", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="train-0.workers", MASTER_PORT="29500", JAX_NUM_PROCESSES="6", JAX_PROCESS_ID="5",
               JAX_COORDINATOR_ADDRESS="train-0.workers:29500")
    report = environment_report(env)
    assert report["environment"] == "distkeras" and (report["rank"], report["workers"]) == (5, 6)
    assert report["variables"]["DISTKERAS_LAUNCHER_PID"] == "9" and report["coordinator"] == "train-0.workers:29500"
    assert report["worker_addresses"] is None
    assert sorted(report["also_read"]) == ["jax", "torchrun"]
    [ignored] = report["ignored"]
    assert ignored["environment"] == "kubernetes" and ignored["variables"]["JOB_COMPLETION_INDEX"] == "2"
    assert ignored["why"].startswith("context under distkeras")
    json.dumps(report)  # printable as JSON
    assert environment_report({})["environment"] == "single"
    error = environment_report({"RANK": "3", "WORLD_SIZE": "2"})["error"]
    assert error.startswith("ClusterError: Rank 3 from torchrun")
    assert environment_report(INDEXED)["worker_addresses"][0] == "train-0.workers:29501"


# --- MXNet and CNTK under environments they can't join -------------------------------------------------------

def _cluster(source, **variables):
    return Cluster(1, 2, 1, 2, None, source, variables=variables or {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize("source,instead", [
    ("slurm", "srun --ntasks-per-node=1 distkeras launch --backend mxnet --nproc-per-node N script.py"),
    ("torchrun", "start the job with `distkeras launch --backend mxnet --nproc-per-node N script.py`"),
    ("ray", "start the job with `distkeras launch --backend mxnet"),
    ("kubernetes", "--node-rank $JOB_COMPLETION_INDEX"),
    ("kubeflow", "--node-rank $RANK --coordinator $MASTER_ADDR:PORT"),
])
def test_mxnet_refuses_an_environment_it_cant_join(source, instead):
    from distkeras.backends.mxnet import adapter as mxnet  # the adapter module imports no MXNet
    with pytest.raises(ClusterError) as info:
        mxnet.check_joinable(_cluster(source), {})
    message = str(info.value)
    assert message.startswith("This process is rank 1 of 2 ({}: SLURM_NTASKS=2, SLURM_PROCID=1), but not a worker of "
                              "an MXNet parameter-server job: DMLC_ROLE=None.".format(source))
    assert instead in message
    mxnet.check_joinable(_cluster(source), {"DMLC_ROLE": "worker"})  # distkeras launch --backend mxnet's worker
    mxnet.check_joinable(SINGLE, {})


@pytest.mark.parametrize("source", ["slurm", "torchrun", "ray", "kubernetes", "kubeflow", "TF_CONFIG", "jax"])
def test_cntk_refuses_an_environment_mpi_doesnt_know(source):
    from distkeras.backends.cntk import adapter as cntk  # the adapter module imports no CNTK
    with pytest.raises(ClusterError, match=r"rank 1 of 2 \({}: .*\), but CNTK's workers must be MPI ranks.*"
                                           r"Instead .*mpiexec".format(source)) as info:
        cntk.check_joinable(_cluster(source), {})
    if source == "slurm":
        assert "inside the allocation, run `mpiexec -n N python script.py`" in str(info.value)
    else:
        assert "distkeras launch --backend cntk --nproc-per-node N script.py" in str(info.value)
    cntk.check_joinable(_cluster("mpi"), {})  # mpiexec's ranks: CNTK's MPI compares them itself
    cntk.check_joinable(_cluster("slurm"), {"PMI_RANK": "1"})  # srun --mpi=pmi2: MPI may know Slurm's tasks
    cntk.check_joinable(SINGLE, {})


# --- the GPUs of a task -----------------------------------------------------------------------------------

def _task(local_rank, local_tasks):
    return Cluster(local_rank, local_tasks, local_rank, local_tasks, "node0:29500", "slurm")


@pytest.mark.parametrize("env,task,count,expected", [
    # srun --ntasks-per-node=4 --gres=gpu:4: every task sees the node's 4 GPUs; each takes its own.
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, (2, 4), None, "2"),
    # ... in the order listed, UUIDs too (a MIG or a shared node's allocation).
    ({"CUDA_VISIBLE_DEVICES": "4,6"}, (1, 2), None, "6"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, (0, 2), None, "GPU-aa"),
    # 8 GPUs, 2 tasks: 4 consecutive GPUs each.
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, (1, 2), None, "4,5,6,7"),
    # 5 GPUs, 2 tasks: 2 each, the fifth unused.
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}, (1, 2), None, "2,3"),
    # srun --gpus-per-task=1 (or --gpu-bind): each task already sees its own GPU: unchanged.
    ({"CUDA_VISIBLE_DEVICES": "3"}, (3, 4), None, "3"),
    ({"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_PER_TASK": "2"}, (1, 2), None, "2,3"),
    # Alone on the node: unchanged, whatever it sees.
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, (0, 1), None, "0,1"),
    ({}, (0, 1), 8, None),
    # No GPUs.
    ({"CUDA_VISIBLE_DEVICES": ""}, (1, 2), None, ""),
    ({}, (1, 2), 0, None),
    ({}, (1, 2), None, None),
    # Unset, and the node has 4 GPUs: every task would see all 4.
    ({}, (3, 4), 4, "3"),
])
def test_local_gpus(env, task, count, expected):
    assert environments.local_gpus(env, _task(*task), count) == expected


def test_local_gpus_of_every_task_on_a_node_are_disjoint():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}
    picked = [environments.local_gpus(env, _task(r, 3)).split(",") for r in range(3)]
    assert picked == [["0", "1"], ["2", "3"], ["4", "5"]]


# --- partial variables: never a silent job of one ----------------------------------------------------------

@pytest.mark.parametrize("env,named", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' without RANK (torchrun's)"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "WORLD_SIZE='2' without RANK"),
    ({"RANK": "1"}, "RANK='1' without WORLD_SIZE (torchrun's)"),
    ({"RANK": "0", "MASTER_ADDR": "h"}, "RANK='0' without WORLD_SIZE"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK='1' without RANK and WORLD_SIZE"),
    ({"JAX_NUM_PROCESSES": "4", "JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_NUM_PROCESSES='4' without JAX_PROCESS_ID (jax's)"),
    ({"JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID='2' without JAX_NUM_PROCESSES"),
    ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}, "KERAS_DISTRIBUTION_NUM_PROCESSES='2' without KERAS_DISTRIBUTION_PROCESS_ID"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE='4' without OMPI_COMM_WORLD_RANK (mpi's)"),
    ({"MV2_COMM_WORLD_RANK": "3"}, "MV2_COMM_WORLD_RANK='3' without MV2_COMM_WORLD_SIZE"),
    ({"PMI_SIZE": "8"}, "PMI_SIZE='8' without PMI_RANK"),
    ({"DISTKERAS_WORLD_SIZE": "3"}, "DISTKERAS_WORLD_SIZE='3' without JOB_COMPLETION_INDEX (is the Job's completionMode"),
    ({"WORLD_SIZE": "4", "DISTKERAS_LAUNCHER_PID": "7"}, "WORLD_SIZE='4' without RANK"),
    # Under a scheduler that says one task (an allocation's shell), the same.
    ({"WORLD_SIZE": "2", "SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"}, "WORLD_SIZE='2' without RANK"),
])
def test_partial_launcher_variables_are_an_error_not_a_job_of_one(env, named):
    # WORLD_SIZE=2 without RANK was a job of one, silently: every process of the job trained as rank 0.
    with pytest.raises(ClusterError, match="The launch variables are partly set") as info:
        from_env(env)
    message = str(info.value)
    assert named in message, message
    assert "every process of the job as rank 0" in message and "DISTKERAS_ENVIRONMENT=single" in message
    # Training alone on purpose stays possible.
    assert from_env(dict(env, DISTKERAS_ENVIRONMENT="single")).world_size == 1


@pytest.mark.parametrize("env", [
    {"WORLD_SIZE": "1"}, {"LOCAL_RANK": "0"}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
    {"JAX_COORDINATOR_ADDRESS": "h:1234"}, {"JAX_NUM_PROCESSES": "1"}, {"DISTKERAS_LAUNCHER_PID": "7"},
    {"DISTKERAS_WORLD_SIZE": "1"}, {"OMPI_COMM_WORLD_SIZE": "1"}, {"TF_CONFIG": "  "},
])
def test_variables_that_place_no_other_process_are_no_error(env):
    assert from_env(env) == SINGLE


def test_partial_variables_beside_a_complete_launcher_are_its_business():
    # A job of several, described by a launcher that names itself: a stray JAX_NUM_PROCESSES is not read at all.
    c = from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "JAX_NUM_PROCESSES": "2"})
    assert (c.source, c.rank, c.world_size) == ("mpi", 1, 2)
    # Slurm's many variables are read by Slurm alone: a task of a step of two is no partial anything.
    slurm_task = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0",
                  "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert from_env(slurm_task).source == "slurm"


def test_a_malformed_tf_config_is_an_error_not_a_job_of_one():
    for text in ("{}", "not json", '{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}'):
        with pytest.raises(ClusterError, match="TF_CONFIG"):
            from_env({"TF_CONFIG": text})
