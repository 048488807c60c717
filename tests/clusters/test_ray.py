"""Ray Train on a real two-node Ray cluster (``ray start --head`` and ``ray start --address``, each in a
network-namespace host): TorchTrainer, TensorflowTrainer and a JAX DataParallelTrainer, whose train loops call
distkeras.distribute(), with one worker per node. Each trains what one process trains at the same global batch;
with FailureConfig(max_failures=1), a worker that SIGKILLs itself mid-training is restarted by Ray and the job
resumes (distkeras.callbacks.BackupAndRestore in a shared folder) to the same weights.

This pytest process imports no framework: the driver (tests/clusters/ray_job.py) is a subprocess in the head's
namespace, and it also trains the one-process reference."""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.clusters import ray_cluster

REASON = ray_cluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
JOB_TIMEOUT = 420


@pytest.fixture(scope="session")
def cluster():
    with ray_cluster.RayCluster() as made:
        yield made


def run(cluster, out_dir, framework, mode="train"):
    """Run the driver; return every rank's facts and weights, and the one-process weights."""
    try:
        done = cluster.driver(["-m", "tests.clusters.ray_job", cluster.address, str(out_dir), framework, mode],
                              timeout=JOB_TIMEOUT, capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail("the Ray job did not finish in {} s:\n{}".format(JOB_TIMEOUT, (exc.stdout or b"")[-4000:]))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    facts, weights = [], []
    for rank in (0, 1):
        with open(os.path.join(str(out_dir), "rank{}.json".format(rank))) as f:
            facts.append(json.load(f))
        weights.append(load(out_dir, "rank{}".format(rank)))
    return facts, weights, load(out_dir, "single")


def load(out_dir, name):
    saved = np.load(os.path.join(str(out_dir), name + ".npz"))
    return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


def check_one_job(facts, weights, single):
    for rank, fact in enumerate(facts):
        assert fact["replicas"] == 2, fact  # the framework's own count
        assert fact["rank"] == rank, fact
    assert {fact["node"] for fact in facts} == set(ray_cluster.RayCluster.ADDRESSES)  # one worker per node
    for a, b in zip(weights[0], weights[1]):
        np.testing.assert_array_equal(a, b)
    for expected, actual in zip(single, weights[0]):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def check_ray_environment(facts, coordinator_is_rank0_worker):
    """distkeras' RayTrain environment, on the variables Ray set in the worker, says what the framework says."""
    for rank, fact in enumerate(facts):
        found = fact.get("ray_environment")
        assert found, fact
        assert (found["source"], found["rank"], found["world_size"]) == ("ray", rank, 2)
        assert (found["local_rank"], found["local_world_size"]) == (0, 1)
        if coordinator_is_rank0_worker:
            assert found["workers"][0] == found["coordinator"]
            assert found["workers"][rank].split(":")[0] == fact["node"]


def test_tensorflow_trainer(cluster, tmp_path):
    facts, weights, single = run(cluster, tmp_path, "tensorflow")
    check_one_job(facts, weights, single)
    check_ray_environment(facts, coordinator_is_rank0_worker=True)


def test_jax_data_parallel_trainer(cluster, tmp_path):
    facts, weights, single = run(cluster, tmp_path, "jax")
    check_one_job(facts, weights, single)
    assert [fact["source"] for fact in facts] == ["jax", "jax"]  # prepare_jax() gave distkeras JAX_*
    assert not any(fact["tensorflow_imported"] for fact in facts)


def test_torch_trainer_resumes_a_killed_worker_under_failure_config(cluster, tmp_path):
    """One run for both TorchTrainer claims (a Ray run costs a minute or more here): Ray restarts the worker
    group after rank 1's SIGKILL, and the resumed job ends where one process at the same global batch does,
    which is where the uninterrupted two-worker run ends (tests/backends/test_multiworker.py)."""
    facts, weights, single = run(cluster, tmp_path, "torch", "kill")
    assert all(fact["killed"] for fact in facts)  # the second attempt finished, after rank 1's SIGKILL
    check_one_job(facts, weights, single)
    check_ray_environment(facts, coordinator_is_rank0_worker=False)
    assert facts[0]["ray_environment"]["coordinator"].split(":")[0] in ray_cluster.RayCluster.ADDRESSES
    assert not any(fact["tensorflow_imported"] for fact in facts)
