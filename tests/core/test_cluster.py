import json

import pytest

from distkeras import ClusterError
from distkeras.cluster import SINGLE, from_env


def tf_config(workers, kind="worker", index=0, chief=None):
    cluster = {"worker": workers}
    if chief:
        cluster["chief"] = chief
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})}


def test_no_launcher_is_a_single_process():
    assert from_env({}) == SINGLE
    assert not SINGLE.is_multi_worker and SINGLE.is_chief


def test_tf_config_workers():
    c = from_env(tf_config(["h1:1000", "h2:1000", "h2:1001"], index=2))
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (2, 3, 1, 2)
    assert c.coordinator == "h1:1000" and c.source == "TF_CONFIG"


def test_tf_config_chief_is_rank_zero():
    env = tf_config(["h2:1"], kind="chief", index=0, chief=["h1:1"])
    assert from_env(env).rank == 0
    env = tf_config(["h2:1"], kind="worker", index=0, chief=["h1:1"])
    assert from_env(env).rank == 1 and from_env(env).world_size == 2


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ('{"task": {"type": "worker", "index": 0}}', 'needs a "cluster" object'),
    ('{"cluster": {"worker": ["a:1"]}}', 'needs "task"'),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', "not in the cluster"),
    ('{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "worker", "index": 0}}', "parameter-server"),
    ('{"cluster": {"workers": ["a:1"]}, "task": {"type": "worker", "index": 0}}', "unknown job types"),
    ('{"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}', "must be a list"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}', "chief\" or \"worker"),
])
def test_malformed_tf_config(text, match):
    with pytest.raises(ClusterError, match=match):
        from_env({"TF_CONFIG": text})


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    c = from_env(env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.coordinator, c.source) == (
        3, 4, 1, 2, "10.0.0.1:29400", "torchrun")


def test_jax_and_keras_variables():
    c = from_env({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert (c.rank, c.world_size, c.coordinator, c.source) == (1, 2, "h:1234", "jax")
    c = from_env({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1,b:1", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                  "KERAS_DISTRIBUTION_PROCESS_ID": "0"})
    assert (c.rank, c.world_size, c.coordinator, c.source) == (0, 2, "a:1", "keras")


def test_mpi_variables():
    c = from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (c.rank, c.world_size, c.local_rank, c.source) == (1, 2, 1, "mpi")
    assert from_env({"PMI_RANK": "0", "PMI_SIZE": "3"}).world_size == 3


def test_agreeing_sources_are_fine_and_share_the_coordinator():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    assert from_env(env).coordinator == "h:5"


def test_disagreeing_sources_are_an_error():
    env = {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(ClusterError, match="disagrees with itself: torchrun says rank 0 of 2, mpi says rank 1 of 2"):
        from_env(env)


@pytest.mark.parametrize("env,match", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "Expected an integer in RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "outside 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "Local rank 3"),
])
def test_inconsistent_variables(env, match):
    with pytest.raises(ClusterError, match=match):
        from_env(env)
