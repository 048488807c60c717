"""Ray Train on a real two-node Ray cluster (``ray start --head`` and ``ray start --address``, each in a
network-namespace host): TorchTrainer, TensorflowTrainer and a JAX DataParallelTrainer, whose train loops call
distkeras.distribute(), with one worker per node. Each trains what one process trains at the same global batch;
with FailureConfig(max_failures=1), a worker that SIGKILLs itself mid-training is restarted by Ray and the job
resumes (distkeras.callbacks.BackupAndRestore in a shared folder) to the same weights. Ray's JaxTrainer, which
sets nothing distkeras can read, gets a ClusterError instead of workers that each train alone.

This pytest process imports no framework: the drivers (tests/clusters/ray_job.py) are subprocesses in the head's
namespace, and they also train the one-process references. A Ray run costs a minute or more here (worker
processes, framework imports), so the session fixture starts the three jobs at once on one cluster, and each
test waits for its own."""

import json
import os
import subprocess
import time

import numpy as np
import pytest

from tests.clusters import ray_cluster

REASON = ray_cluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
JOB_TIMEOUT = 480
#: name -> (framework, ray_job mode)
JOBS = {"tensorflow": ("tensorflow", "train"), "jax": ("jax", "train"), "torch-kill": ("torch", "kill"),
        "jaxtrainer": ("jaxtrainer", "train")}


@pytest.fixture(scope="session")
def jobs(tmp_path_factory):
    """Every job of :data:`JOBS`, started at once: ``{name: (driver Popen, out dir, log path, start time)}``."""
    with ray_cluster.RayCluster(cpus=len(JOBS)) as cluster:
        started = {}
        try:
            for name, (framework, mode) in JOBS.items():
                out = tmp_path_factory.mktemp(name)
                log_path = os.path.join(str(out), "driver.log")
                with open(log_path, "w") as log:
                    driver = cluster.start_driver(
                        ["-m", "tests.clusters.ray_job", cluster.address, str(out), framework, mode],
                        stdout=log, stderr=subprocess.STDOUT)
                started[name] = (driver, out, log_path, time.time())
            yield started
        finally:
            for driver, _, _, _ in started.values():
                if driver.poll() is None:
                    driver.kill()
                driver.wait()


def finished(jobs, name):
    """Wait for job ``name`` (killed after JOB_TIMEOUT); return its exit status and log."""
    driver, _, log_path, started = jobs[name]
    try:
        driver.wait(timeout=max(1, started + JOB_TIMEOUT - time.time()))
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.wait()
    with open(log_path) as f:
        return driver.returncode, f.read()


def result(jobs, name):
    """Wait for job ``name``; return every rank's facts and weights, and the one-process weights."""
    _, out_dir, _, _ = jobs[name]
    returncode, log = finished(jobs, name)
    assert returncode == 0, "driver exit {} (killed after {} s if -9):\n{}".format(
        returncode, JOB_TIMEOUT, log[-8000:])
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
        assert fact["data_checks"] >= 1, fact  # the data check compared the workers' batches, on by default
        assert fact["rank"] == rank, fact
    assert {fact["node"] for fact in facts} == set(ray_cluster.RayCluster.ADDRESSES)  # one worker per node
    for a, b in zip(weights[0], weights[1]):
        np.testing.assert_array_equal(a, b)
    for expected, actual in zip(single, weights[0]):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def check_ray_environment(facts, tensorflow):
    """distkeras' RayTrain environment, on the variables Ray set in the worker, says what the framework says."""
    for rank, fact in enumerate(facts):
        found = fact.get("ray_environment")
        assert found, fact
        assert (found["source"], found["rank"], found["world_size"]) == ("ray", rank, 2)
        assert (found["local_rank"], found["local_world_size"]) == (0, 1)
        assert found["coordinator"].split(":")[0] in ray_cluster.RayCluster.ADDRESSES
        if tensorflow:
            assert found["workers"][0] == found["coordinator"]
            assert found["workers"][rank].split(":")[0] == fact["node"]
        else:
            assert found["workers"] is None and found["variables"]["RANK"] == str(rank)


def test_tensorflow_trainer(jobs):
    facts, weights, single = result(jobs, "tensorflow")
    check_one_job(facts, weights, single)
    check_ray_environment(facts, tensorflow=True)


def test_jax_data_parallel_trainer(jobs):
    facts, weights, single = result(jobs, "jax")
    check_one_job(facts, weights, single)
    assert [fact["source"] for fact in facts] == ["jax", "jax"]  # prepare_jax() gave distkeras JAX_*
    assert not any(fact["tensorflow_imported"] for fact in facts)


def test_torch_trainer_resumes_a_killed_worker_under_failure_config(jobs):
    """One run for both TorchTrainer claims: Ray restarts the worker group after rank 1's SIGKILL, and the
    resumed job ends where one process at the same global batch does, which is where the uninterrupted
    two-worker run ends (tests/backends/test_multiworker.py)."""
    facts, weights, single = result(jobs, "torch-kill")
    assert all(fact["killed"] for fact in facts)  # the second attempt finished, after rank 1's SIGKILL
    check_one_job(facts, weights, single)
    check_ray_environment(facts, tensorflow=False)
    assert not any(fact["tensorflow_imported"] for fact in facts)


def test_jax_trainer_is_a_cluster_error(jobs):
    """Ray's JaxTrainer on CPUs starts no jax.distributed and sets no variable: each worker would train alone.
    distribute() raises instead, naming prepare_jax()."""
    returncode, log = finished(jobs, "jaxtrainer")
    assert returncode == 1, log[-8000:]
    assert "Expected variables distkeras reads in this Ray Train worker, which is worker" in log, log[-8000:]
    assert "prepare_jax()" in log
    _, out_dir, _, _ = jobs["jaxtrainer"]
    assert not os.path.exists(os.path.join(str(out_dir), "rank0.npz"))
