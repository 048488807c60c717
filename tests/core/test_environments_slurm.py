"""Slurm's variables, read into a Cluster: the hostlist expander, the placement of ranks, the coordinator's
port, and the batch script that isn't a task. The environments below are trimmed copies of what Slurm 22.05's
srun really set (``srun ... env | grep SLURM`` on tests/clusters' two-node cluster)."""

import time

import pytest

from distkeras import ClusterError
from distkeras.environments import slurm
from distkeras.environments.slurm import Slurm, coordinator_port, expand_hostlist, expand_tasks_per_node, placement

# srun -N2 -n2: the task of rank 1 (node n1).
N2_N2_RANK1 = {
    "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "dktest", "SLURM_CPUS_ON_NODE": "1", "SLURM_GTIDS": "1",
    "SLURM_JOBID": "1", "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "sh",
    "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_USER": "root", "SLURM_LAUNCH_NODE_IPADDR": "10.47.0.1", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
    "SLURM_NODEID": "1", "SLURM_NODELIST": "n[0-1]", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
    "SLURM_SRUN_COMM_HOST": "10.47.0.1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[0-1]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "1(x2)",
}

# srun -N2 --ntasks-per-node=2: the task of rank 3 (node n1, local rank 1).
N2_PER_NODE2_RANK3 = {
    "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "dktest", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "2,3",
    "SLURM_JOBID": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "2", "SLURM_JOB_NAME": "sh",
    "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_USER": "root", "SLURM_LAUNCH_NODE_IPADDR": "10.47.0.1", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
    "SLURM_NODEID": "1", "SLURM_NODELIST": "n[0-1]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3", "SLURM_SRUN_COMM_HOST": "10.47.0.1", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[0-1]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "2(x2)",
}

# The batch script of `sbatch -N2 --ntasks 2` (no step: SLURM_PROCID is set, SLURM_STEP_ID is not).
BATCH_SCRIPT = {
    "SLURMD_NODENAME": "n0", "SLURM_CLUSTER_NAME": "dktest", "SLURM_CPUS_ON_NODE": "1", "SLURM_GTIDS": "0",
    "SLURM_JOBID": "1", "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "b.sh",
    "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_USER": "root", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "n[0-1]", "SLURM_NODE_ALIASES": "(null)", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0", "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "1(x2)",
}

# The shell of `salloc -N2` (no --ntasks: only the tasks per node tell).
SALLOC_SHELL = {
    "SLURM_CLUSTER_NAME": "dktest", "SLURM_JOBID": "2", "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "2",
    "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug", "SLURM_NNODES": "2", "SLURM_NODELIST": "n[0-1]", "SLURM_NODE_ALIASES": "(null)",
    "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "1(x2)",
}


@pytest.mark.parametrize("text,hosts", [
    ("gpu-a[01-04,07],gpu-b3", ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-a07", "gpu-b3"]),
    ("n[0-1]", ["n0", "n1"]),
    ("node7", ["node7"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),            # the width of the first bound: no padding
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("n[1-03]", ["n1", "n2", "n3"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),  # several groups: every combination, the last fastest
    ("a[1-2]-[5-6],z[1,3]", ["a1-5", "a1-6", "a2-5", "a2-6", "z1", "z3"]),
    ("a[1,2]b[3]c[4-5]", ["a1b3c4", "a1b3c5", "a2b3c4", "a2b3c5"]),
    ("rack1-n[1-2]", ["rack1-n1", "rack1-n2"]),
    ("n1[2-3]", ["n12", "n13"]),
    ("x[9-10],y", ["x9", "x10", "y"]),
    ("n[2,1]", ["n2", "n1"]),                           # Slurm's order, not sorted
    ("n[0-3],n[2-5]", ["n0", "n1", "n2", "n3", "n2", "n3", "n4", "n5"]),  # duplicates kept
    ("n0 n1", ["n0", "n1"]),
    ("n[1-2],,m", ["n1", "n2", "m"]),
    ("[1-2]", ["1", "2"]),
    ("", []),
])
def test_hostlists_expand_as_scontrol_show_hostnames(text, hosts):
    # Each expected list is what `scontrol show hostnames TEXT` of Slurm 22.05 printed; tests/clusters compares
    # them with the real scontrol again where Slurm is installed.
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,why", [
    ("n[1-3", "without its ']'"), ("n[1-2]]", "without its '['"), ("n[3-1]", "runs backwards"),
    ("n[]", "empty bracket group"), ("n[a-b]", "no number"), ("n[[1]]", "don't nest"),
    ("n[0-99999999]", "100000000 hosts, more than the 100000"),
])
def test_malformed_hostlists_are_clear_errors(text, why):
    with pytest.raises(ClusterError, match="Expected a Slurm hostlist") as info:
        expand_hostlist(text)
    assert why in str(info.value) and repr(text) in str(info.value)


@pytest.mark.parametrize("text,count", [
    ("n[0-9999999]", 10000000), ("a[0-999],b[0-9999]", 11000), ("a[0-999]b[0-9999]", 10000000),
    ("n[0-999999,1000000-1999999,2000000-2999999,3000000-3999999]", 4000000),
    ("a[0-99999]b[0-99999]c[0-99999]", 10 ** 15),
])
def test_a_huge_hostlist_is_counted_before_it_is_expanded(text, count):
    # 'a[0-999]b[0-9999]' took 0.8 s and 'n[0-999999,...,3000000-3999999]' (4 M hosts) took 3.6 s and 384 MB before
    # their error: the count comes from the bounds now, and beyond MAX_HOSTS nothing is expanded.
    assert slurm.count_hostlist(text) == count
    if count <= slurm.MAX_HOSTS:
        assert len(expand_hostlist(text)) == count
        return
    started = time.perf_counter()
    with pytest.raises(ClusterError, match="Expected a Slurm hostlist") as info:
        expand_hostlist(text)
    assert time.perf_counter() - started < 0.1
    assert "{} hosts, more than the {}".format(count, slurm.MAX_HOSTS) in str(info.value)
    env = dict(SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_STEP_NODELIST=text, SLURM_STEP_TASKS_PER_NODE="1(x2)")
    started = time.perf_counter()
    with pytest.raises(ClusterError, match="more than the"):
        Slurm().read(env)
    assert time.perf_counter() - started < 0.1


def test_hostlist_counts_agree_with_expansion():
    for text in ("gpu-a[01-04,07],gpu-b3", "a[1-2]-[5-6],z[1,3]", "n[0-3],n[2-5]", "", "n0 n1", "[1-2]", "x[9-10],y"):
        assert slurm.count_hostlist(text) == len(expand_hostlist(text)), text


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("1(x2)") == [1, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ClusterError, match="tasks per node"):
        expand_tasks_per_node("2x3")


def test_placement_follows_the_distribution():
    # As srun placed them on the real cluster: -n3 -N2 puts ranks 0, 1 on n0 (block), 0, 2 on n0 (cyclic).
    assert placement([2, 1]) == [(0, 0), (0, 1), (1, 0)]
    assert placement([2, 1], "cyclic") == [(0, 0), (1, 0), (0, 1)]
    assert placement([2, 1], "block:cyclic") == placement([2, 1])
    assert placement([3, 3], "plane=2") == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    with pytest.raises(ClusterError, match="SLURM_DISTRIBUTION block, cyclic or plane=N"):
        placement([1, 1], "arbitrary")


def test_srun_two_nodes_two_tasks():
    assert Slurm.detect(N2_N2_RANK1) and not Slurm.launcher
    cluster = Slurm().read(N2_N2_RANK1)
    port = coordinator_port(N2_N2_RANK1)
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (1, 2, 0, 1)
    assert cluster.coordinator == "n0:{}".format(port) and cluster.source == "slurm"
    assert cluster.workers == ("n0:{}".format(port + 1), "n1:{}".format(port + 1))
    assert cluster.variables["SLURM_PROCID"] == "1" and cluster.variables["SLURM_STEP_NODELIST"] == "n[0-1]"


def test_srun_two_tasks_per_node():
    cluster = Slurm().read(N2_PER_NODE2_RANK3)
    port = coordinator_port(N2_PER_NODE2_RANK3)
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (3, 4, 1, 2)
    assert cluster.workers == tuple("n{}:{}".format(n, port + 1 + local) for n in (0, 1) for local in (0, 1))


def test_cyclic_steps_place_ranks_round_robin():
    # srun -N2 -n3 -m cyclic: rank 2 is node 0's second task.
    env = dict(N2_N2_RANK1, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_DISTRIBUTION="cyclic",
               SLURM_PROCID="2", SLURM_NODEID="0", SLURM_LOCALID="1")
    cluster = Slurm().read(env)
    port = coordinator_port(env)
    assert cluster.workers == ("n0:{}".format(port + 1), "n1:{}".format(port + 1), "n0:{}".format(port + 2))
    assert (cluster.local_rank, cluster.local_world_size) == (1, 2)


def test_a_step_of_one_task_is_one_worker():
    env = dict(N2_N2_RANK1, SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0", SLURM_STEP_TASKS_PER_NODE="1")
    cluster = Slurm().read(env)
    assert (cluster.world_size, cluster.coordinator) == (1, None) and cluster.source == "slurm"


def test_the_step_node_list_wins_over_the_job_node_list():
    env = dict(N2_N2_RANK1, SLURM_JOB_NODELIST="n[0-3]", SLURM_STEP_NODELIST="n[2-3]")
    assert Slurm().read(env).coordinator.startswith("n2:")
    del env["SLURM_STEP_NODELIST"]
    env["SLURM_JOB_NODELIST"] = "gpu[07-08]"
    assert Slurm().read(env).workers[1].startswith("gpu08:")


@pytest.mark.parametrize("change,problem", [
    ({"SLURM_LOCALID": "1"}, "rank 1 runs on node 1 as local rank 0, but this task is local rank 1 on node 1"),
    ({"SLURM_STEP_NODELIST": "n[0-2]"}, "3 nodes, 2 counts"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "add up to 4, not the step's 2 tasks"),
    ({"SLURM_PROCID": "5"}, "rank 5 is outside 0..1"),
])
def test_variables_that_disagree_are_errors_naming_them(change, problem):
    with pytest.raises(ClusterError, match="disagree") as info:
        Slurm().read(dict(N2_N2_RANK1, **change))
    assert problem in str(info.value) and "SLURM_PROCID=" in str(info.value)


def test_missing_or_malformed_variables():
    env = dict(N2_N2_RANK1)
    del env["SLURM_PROCID"]
    with pytest.raises(ClusterError, match="Expected SLURM_PROCID"):
        Slurm().read(env)
    with pytest.raises(ClusterError, match="Expected an integer in SLURM_LOCALID"):
        Slurm().read(dict(N2_N2_RANK1, SLURM_LOCALID="x"))
    with pytest.raises(ClusterError, match="SLURM_DISTRIBUTION"):
        Slurm().read(dict(N2_N2_RANK1, SLURM_DISTRIBUTION="arbitrary"))


def test_the_coordinator_port():
    base = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0"}
    port = coordinator_port(base)
    assert slurm.FIRST_PORT <= port <= slurm.FIRST_PORT + slurm.SLOT_SIZE * (slurm.SLOTS - 1)
    assert (port - slurm.FIRST_PORT) % slurm.SLOT_SIZE == 0
    # successive steps, a requeue (same job and step ids), the next jobs: all different
    others = [dict(base, SLURM_STEP_ID="1"), dict(base, SLURM_STEP_ID="2"), dict(base, SLURM_RESTART_COUNT="1"),
              dict(base, SLURM_RESTART_COUNT="2"), dict(base, SLURM_JOB_ID="1235"), dict(base, SLURM_JOB_ID="1236")]
    ports = [port] + [coordinator_port(env) for env in others]
    assert len(set(ports)) == len(ports)
    assert coordinator_port(dict(base, DISTKERAS_COORDINATOR_PORT="40000")) == 40000
    with pytest.raises(ClusterError, match="DISTKERAS_COORDINATOR_PORT to be a port"):
        coordinator_port(dict(base, DISTKERAS_COORDINATOR_PORT="70000"))
    with pytest.raises(ClusterError, match="Expected SLURM_JOB_ID"):
        coordinator_port({})
    cluster = Slurm().read(dict(N2_N2_RANK1, DISTKERAS_COORDINATOR_PORT="40000"))
    assert cluster.coordinator == "n0:40000" and cluster.workers == ("n0:40001", "n1:40001")
    assert cluster.variables["DISTKERAS_COORDINATOR_PORT"] == "40000"


def test_too_many_tasks_per_node_for_the_derived_ports():
    env = dict(N2_N2_RANK1, SLURM_STEP_NUM_TASKS="32", SLURM_STEP_TASKS_PER_NODE="16(x2)", SLURM_PROCID="16",
               SLURM_LOCALID="0")
    with pytest.raises(ClusterError, match="at most 15 tasks per node"):
        Slurm().read(env)
    assert Slurm().read(dict(env, DISTKERAS_COORDINATOR_PORT="40000")).workers[-1] == "n1:40016"


@pytest.mark.parametrize("env", [BATCH_SCRIPT, SALLOC_SHELL], ids=["sbatch script", "salloc shell"])
def test_the_batch_script_or_an_allocation_shell_of_several_tasks_is_an_error(env):
    assert Slurm.detect(env)
    with pytest.raises(ClusterError, match="run it with srun") as info:
        Slurm().read(env)
    message = str(info.value)
    assert "no SLURM_STEP_ID" in message and "DISTKERAS_ENVIRONMENT=single" in message
    assert "SLURM_JOB_ID={}".format(env["SLURM_JOB_ID"]) in message and "has 2 tasks" in message


def test_a_batch_script_of_one_task_trains_alone():
    env = dict(BATCH_SCRIPT, SLURM_NTASKS="1", SLURM_NPROCS="1", SLURM_TASKS_PER_NODE="1", SLURM_JOB_NUM_NODES="1")
    cluster = Slurm().read(env)
    assert (cluster.world_size, cluster.source) == (1, "slurm")


def test_no_slurm_job():
    assert not Slurm.detect({}) and not Slurm.detect({"SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert slurm.launch_arguments({}) == {}


def test_launch_arguments_inside_an_allocation():
    # srun -N2 --ntasks-per-node=1 distkeras launch --nproc-per-node 2: the launchers are the step's tasks.
    arguments = slurm.launch_arguments(N2_N2_RANK1)
    assert arguments == {"nnodes": 2, "node_rank": 1, "coordinator": "n0:{}".format(coordinator_port(N2_N2_RANK1))}
    with pytest.raises(ClusterError, match="one `distkeras launch` per node"):
        slurm.launch_arguments(N2_PER_NODE2_RANK3)
    assert slurm.launch_arguments(SALLOC_SHELL) == {}  # outside a step: nothing to take


def test_tasks_sharing_a_node_take_their_gpus_by_local_rank(tmp_path):
    # srun --ntasks-per-node=2 --gres=gpu:4: both tasks see the node's 4 GPUs; TF and JAX would each take all.
    from distkeras.backends.base import pin_local_gpus

    gpus = tmp_path / "gpus"
    for i in range(4):
        (gpus / "0000:0{}:00.0".format(i)).mkdir(parents=True)
    task = Slurm().read(N2_PER_NODE2_RANK3)  # local rank 1 of 2
    env = dict(N2_PER_NODE2_RANK3, CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert pin_local_gpus(task, env, str(gpus)) == "2,3" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    env = dict(N2_PER_NODE2_RANK3)  # unset: the driver's count
    assert pin_local_gpus(task, env, str(gpus)) == "2,3"
    env = dict(N2_PER_NODE2_RANK3, CUDA_VISIBLE_DEVICES="5", SLURM_GPUS_PER_TASK="1")  # srun bound it already
    assert pin_local_gpus(task, env, str(gpus)) is None and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = dict(N2_PER_NODE2_RANK3)  # no NVIDIA driver: nothing to pin
    assert pin_local_gpus(task, env, str(tmp_path / "none")) is None and "CUDA_VISIBLE_DEVICES" not in env


def test_tensorflow_config_from_the_slurm_host_list():
    # What the TensorFlow adapter's prepare() writes before MultiWorkerMirroredStrategy starts (no TF import).
    import json

    from distkeras.backends.tensorflow.adapter import write_tf_config

    task = Slurm().read(N2_N2_RANK1)
    env = {}
    assert write_tf_config(task, env)
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": list(task.workers)},
                                            "task": {"type": "worker", "index": 1}}
    assert not write_tf_config(task, {"TF_CONFIG": "{}"})  # the user's own is kept
    # The TF_CONFIG distkeras wrote is no environment of its own: the job is still Slurm's.
    from distkeras import cluster as cluster_lib

    env.update(N2_N2_RANK1)
    assert cluster_lib.from_env(env).source == "slurm"
    assert cluster_lib.from_env(dict(N2_N2_RANK1, TF_CONFIG=env["TF_CONFIG"])).source == "TF_CONFIG"


def test_distkeras_launch_fills_in_what_wasnt_given_from_slurm():
    from distkeras.launch import command as launch

    port = coordinator_port(N2_N2_RANK1)
    assert launch.from_scheduler(environ=N2_N2_RANK1) == (2, 1, "n0:{}".format(port))
    assert launch.from_scheduler(nnodes=2, node_rank=1, coordinator="10.0.0.1:29500", environ=N2_N2_RANK1) == (
        2, 1, "10.0.0.1:29500")  # given: kept
    assert launch.from_scheduler(environ={}) == (1, 0, None)  # no Slurm: one node
    with pytest.raises(ClusterError, match="one `distkeras launch` per node"):
        launch.from_scheduler(environ=N2_PER_NODE2_RANK3)
    assert launch.from_scheduler(4, 3, "n0:29500", environ=N2_PER_NODE2_RANK3) == (4, 3, "n0:29500")
