"""Real torchrun on every Keras 3 backend: two workers train what one process trains, and a SIGKILLed worker
under ``--max-restarts 1`` is restarted by torchrun and the job resumes to the weights of an uninterrupted run.

TensorFlow and JAX have no rendezvous of their own under torchrun: they exchange TF_CONFIG's worker addresses
and jax.distributed's coordinator through the store torchrun's agent serves (distkeras.launch.exchange); PyTorch
joins that store directly. Every job runs ``python -m torch.distributed.run --standalone --nproc-per-node 2``
with this interpreter, and each test's processes are stopped by PID when it ends, also on failure. This
process imports no framework: the jobs and the one-process references set KERAS_BACKEND themselves.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests import full

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "clusters", "torchrun_job.py")
JOB_TIMEOUT = 300
#: DISTKERAS_TORCHRUN_TESTS=all (or the full run, DISTKERAS_FULL_TESTS=1): every backend in both tests (about
#: twice the time). By default each backend forms a torchrun job once: JAX in the plain test, PyTorch and TensorFlow
#: in the restart test, whose jobs also train as one process and count their replicas (its first attempt forms the
#: job, and so does the restarted one).
ALL = os.environ.get("DISTKERAS_TORCHRUN_TESTS", "") == "all" or full.FULL
PLAIN = ["tensorflow", "jax", "torch"] if ALL else ["jax"]
RESTART = ["torch", "tensorflow", "jax"] if ALL else ["torch", "tensorflow"]
#: The framework each backend needs besides torch (torchrun itself).
FRAMEWORK = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
#: Variables of an enclosing launcher or of this test process that must not reach the jobs.
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "TF_CONFIG", "XLA_FLAGS")


def needs(backend):
    # Top-level names only: find_spec("torch.distributed.run") would import torch into this process.
    missing = sorted(m for m in {"torch", FRAMEWORK[backend]} if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip("torchrun on {} needs {} installed".format(backend, " and ".join(missing)))


def job_env(backend):
    env = {k: v for k, v in os.environ.items()
           if k not in _DROP and not k.startswith(("DISTKERAS_", "TORCHELASTIC_", "JAX_", "KERAS_DISTRIBUTION_",
                                                    "SLURM_", "OMPI_", "PMI_"))}
    env.update(KERAS_BACKEND=backend, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    return env


def _stat(pid):
    """(parent PID, start time in clock ticks) of a living process, or None (also for a zombie)."""
    try:
        with open("/proc/{}/stat".format(pid)) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _descendants(pid):
    """Every living process below ``pid`` as (PID, start time): torchrun starts each worker in a session of its
    own, so a process group doesn't hold them."""
    children = {}
    for entry in os.listdir("/proc"):
        stat = _stat(entry) if entry.isdigit() else None
        if stat:
            children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, todo = [], [pid]
    while todo:
        for child, started in children.get(todo.pop(), []):
            found.append((child, started))
            todo.append(child)
    return found


class Run(object):
    """One process tree (torchrun and its workers, or a one-process reference), output in a file, stopped by PID."""

    def __init__(self, command, backend, out_dir, name):
        self.log_path = os.path.join(str(out_dir), name + ".log")
        self.log = open(self.log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(command, cwd=ROOT, env=job_env(backend), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.seen = set()
        self._watch = threading.Thread(target=self._remember_workers, daemon=True)
        self._watch.start()

    def _remember_workers(self):
        # Workers live in sessions of their own: note their PIDs while the job runs, to stop them if it hangs.
        while self.proc.poll() is None:
            self.seen.update(_descendants(self.proc.pid))
            time.sleep(0.5)

    def wait(self, timeout=JOB_TIMEOUT):
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        self.elapsed = time.time() - self.started
        with open(self.log_path) as f:
            self.output = f.read()
        return self.proc.returncode

    def stop(self):
        below = set(_descendants(self.proc.pid)) | self.seen  # before the agent dies and its workers lose their parent
        if self.proc.poll() is None:
            self.proc.kill()
        for pid, started in below:
            stat = _stat(pid)
            if stat and stat[1] == started:  # still the process seen then, not a PID used again since
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()
        self.log.close()


def torchrun(backend, out_dir, mode, *flags):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += list(flags) + [JOB, str(out_dir), mode]
    return Run(command, backend, out_dir, "torchrun-" + mode)


def weights(path):
    saved = np.load(path)
    return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


_references = {}


def reference(backend, tmp_path_factory):
    """The weights one plain process trains (same seed, data, global batch), once per backend (the tests
    start their job first, so the two run side by side)."""
    if backend not in _references:
        out_dir = tmp_path_factory.mktemp("single-" + backend)
        single = Run([sys.executable, JOB, str(out_dir), "single"], backend, out_dir, "single")
        code = single.wait()
        assert code == 0, single.output[-3000:]
        _references[backend] = weights(os.path.join(str(out_dir), "single.npz"))
    return _references[backend]


def check_job(backend, out_dir, expected):
    r0 = weights(os.path.join(str(out_dir), "rank0.npz"))
    r1 = weights(os.path.join(str(out_dir), "rank1.npz"))
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)  # every rank holds the same weights, not just close ones
    for e, a in zip(expected, r0):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    with open(os.path.join(str(out_dir), "result.json")) as f:
        result = json.load(f)
    assert result["backend"] == backend
    # The job's size as the framework counts it: two processes, one CPU device each.
    expected_replicas = {
        "tensorflow": {"num_replicas_in_sync": 2},
        "jax": {"process_count": 2, "device_count": 2},
        "torch": {"world_size": 2},
    }[backend]
    assert result["replicas"] == expected_replicas
    return result


@pytest.mark.parametrize("backend", PLAIN)
def test_two_torchrun_workers_train_as_one_process(backend, tmp_path, tmp_path_factory):
    needs(backend)
    job = torchrun(backend, tmp_path, "train")
    expected = reference(backend, tmp_path_factory)
    code = job.wait()
    assert code == 0, job.output[-4000:]
    result = check_job(backend, tmp_path, expected)
    assert result["restart_count"] == 0
    assert result["data_checks"] == 4  # the data check (on by default in a job) compared each epoch's first batch
    print("torchrun {}: {:.1f} s".format(backend, job.elapsed))


@pytest.mark.parametrize("backend", RESTART)
def test_a_sigkilled_worker_is_restarted_by_torchrun_and_the_job_resumes(backend, tmp_path, tmp_path_factory):
    """Rank 1 SIGKILLs itself mid-epoch 3 of torchrun's first attempt; torchrun stops rank 0 and starts both
    again (TORCHELASTIC_RESTART_COUNT=1), and BackupAndRestore resumes from the end of epoch 2. The restarted
    job exchanges fresh addresses (the agent's store still holds the dead attempt's) and ends on the weights
    of an uninterrupted run."""
    needs(backend)
    job = torchrun(backend, tmp_path, "kill", "--max-restarts", "1")
    expected = reference(backend, tmp_path_factory)
    code = job.wait()
    assert code == 0, job.output[-4000:]
    assert "exitcode: -9" in job.output, job.output[-4000:]  # torchrun saw the SIGKILL and restarted the job
    result = check_job(backend, tmp_path, expected)
    assert result["restart_count"] == 1
    assert result["initial_epoch"] == 2  # resumed from the checkpoint of epoch 2, not from the start
    print("torchrun --max-restarts 1 {}: {:.1f} s".format(backend, job.elapsed))


def test_the_exchange_through_a_real_store_is_per_attempt_and_bounded(tmp_path):
    """distkeras.launch.exchange on a real TCPStore served as torchrun's agent serves it (ranks as threads)."""
    needs("torch")
    run = Run([sys.executable, os.path.join(ROOT, "tests", "clusters", "torchrun_exchange.py")], "torch", tmp_path,
              "exchange")
    assert run.wait(timeout=120) == 0, run.output[-3000:]
    out = json.loads(run.output.split("RESULT ", 1)[1].splitlines()[0])
    assert out["applies"] is True
    workers = out["tf"]["0"]
    assert out["tf"]["1"] == workers and len(workers) == 2 and len(set(workers)) == 2
    assert all(w.startswith("127.0.0.1:") for w in workers)  # the address that reaches MASTER_ADDR
    assert out["jax"]["0"] == out["jax"]["1"] and out["jax"]["0"].startswith("127.0.0.1:")
    assert out["jax"]["0"] != "127.0.0.1:{}".format(out["port"])  # not MASTER_PORT: the agent's store is there
    # The restarted attempt exchanges afresh: the same store still holds the first attempt's addresses.
    assert out["tf_restart"]["0"] == out["tf_restart"]["1"] and out["tf_restart"]["0"] != workers
    assert out["keys"] == ["distkeras/run-1/0/exchange/tf/worker/0", "distkeras/run-1/1/exchange/tf/worker/0"]
    # A rank that never comes: a ClusterError after the timeout, naming what is missing.
    assert out["missing"]["0"].startswith("ClusterError: Waited 2 s in torchrun's store")
    assert "still missing: tf/worker/1" in out["missing"]["0"] and out["missing"]["seconds0"] < 10
    assert out["no_store"]["1"].startswith("ClusterError: Expected torchrun's store at MASTER_ADDR:MASTER_PORT")
    assert out["no_store"]["seconds1"] < 30
    # The agent's store not shared: rank 0 serves the exchange; JAX's coordinator takes MASTER_PORT itself.
    assert out["served"]["0"] == out["served"]["1"] and len(set(out["served"]["0"])) == 2
    assert out["jax_unshared"]["0"].startswith("127.0.0.1:")


@pytest.mark.skipif(not ALL, reason="two namespace hosts under torchrun: DISTKERAS_TORCHRUN_TESTS=all or DISTKERAS_FULL_TESTS=1")
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_two_hosts_under_torchrun_c10d_train_as_one_process(backend, tmp_path, tmp_path_factory):
    """One worker on each of two network-namespace hosts, torchrun's c10d rendezvous on host 0: the workers'
    addresses (TensorFlow) and rank 0's coordinator (JAX) cross hosts through the agent's store."""
    from tests import netns

    needs(backend)
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", netns.SUBNET + ".1:29400", "--rdzv-id", "two-hosts"]
    with netns.Hosts(2) as hosts:
        logs = [open(os.path.join(str(tmp_path), "host{}.log".format(i)), "w") for i in range(2)]
        try:
            jobs = [hosts.popen(i, command + ["--local-addr", "{}.{}".format(netns.SUBNET, i + 1), "--rdzv-conf",
                                              "is_host={}".format(int(i == 0)), JOB, str(tmp_path), "train"],
                                env=job_env(backend), cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT)
                    for i in range(2)]
            expected = reference(backend, tmp_path_factory)
            codes = [job.wait(timeout=JOB_TIMEOUT) for job in jobs]
        finally:
            for log in logs:
                log.close()  # Hosts.close() kills whatever still runs in the namespaces
        output = "".join(open(log.name).read()[-3000:] for log in logs)
    assert codes == [0, 0], output
    check_job(backend, tmp_path, expected)
