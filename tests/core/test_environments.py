"""The cluster environments (distkeras.environments): each one's variables, and the rules between them.

Every test passes the exact environment the launcher or scheduler sets, as a dict; the source of each
variable list is cited where it is used.
"""

import json
import sys
import types

import pytest

from distkeras import ClusterError, environments, launch
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
    env = launch.worker_env("tensorflow", 3, 4, 1, 2, "10.0.0.1:29400",
                            ["10.0.0.1:29401", "10.0.0.1:29402", "10.0.0.2:29401", "10.0.0.2:29402"])
    env[launch.LAUNCHER_ENV] = "4242"
    found = environments.find(env)
    c = found.cluster
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.source) == (3, 4, 1, 2, "distkeras")
    assert c.coordinator == "10.0.0.1:29400"
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
    role_env = launch.ps_roles("127.0.0.1:5000", 1, 0, 2, environ=dict(env))[0][1]
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
