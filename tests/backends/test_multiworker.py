"""Two workers under `distkeras launch`, on the backend's own multi-worker engine, over 127.0.0.1:
the same weights on every rank, equal to one process at the same global batch; one voice; a killed
worker ends the job in bounded time, naming its rank, and leaves its last checkpoint."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.backends import scenarios
from tests.full import FULL, only_in_full

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STOP_TIMEOUT = 10
#: The bound the kill and raise tests check and wait out: the survivor sits in a collective with the dead rank and
#: ignores the SIGTERM, so the launcher SIGKILLs it after this many seconds (a normal job's workers keep
#: STOP_TIMEOUT: a rank that finishes first waits that long for the others).
FAILED_STOP_TIMEOUT = 5


def launch(out_dir, mode, timeout=600, stop_timeout=STOP_TIMEOUT):
    # Each worker gets one CPU device: nothing of this test process' virtual-device set-up is passed on.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=BACKEND)
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "--backend", BACKEND,
               "--stop-timeout", str(stop_timeout), "-m", "tests.backends.multiworker_job", str(out_dir), mode]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    return done, time.time() - started


#: Modes that share one job of 2 worker processes (tests.backends.multiworker_job runs them in turn, each on a fresh
#: model): starting a job (processes, framework imports, the engine's set-up) costs more than its training here.
SHARED = ("tf.data", "PyDataset", "bf16") + (("uneven",) if BACKEND in ("tensorflow", "jax") else ())


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("shared")
    done, _ = launch(out, ",".join(SHARED))
    return out, done


def mode_output(stdout, mode):
    """The lines each rank wrote while ``mode`` ran, in a job of several modes (``multiworker_job.run_modes``),
    the launcher's ``[rank R] `` prefix kept."""
    lines, current = [], {}
    for line in stdout.splitlines():
        found = re.match(r"\[rank (\d+)\] (?:== (\S+)$)?", line)
        if found and found.group(2):
            current[found.group(1)] = found.group(2)
        elif found and current.get(found.group(1)) == mode:
            lines.append(line)
    return "\n".join(lines)


def part(shared_job, mode):
    """``(out_dir, output)`` of ``mode`` in the shared job: its folder and its lines (:func:`mode_output`)."""
    out, done = shared_job
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return os.path.join(str(out), mode), mode_output(done.stdout, mode)


def single_process_weights(batch_size=12):
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    x, y = scenarios.data(100)
    model.fit(x, y, batch_size=batch_size, epochs=4, shuffle=False, verbose=0)
    return model.get_weights()


def rank_weights(out_dir, rank):
    saved = np.load(os.path.join(str(out_dir), "rank{}.npz".format(rank)))
    return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


def assert_close(expected, actual):
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("data", [
    pytest.param("train", marks=only_in_full("arrays across processes train as one process in test_multihost's 2 hosts "
                                             "x 2 (the same job); tf.data and PyDataset here check one voice and describe")),
    "tf.data", "PyDataset"])
def test_two_workers_train_as_one_process(tmp_path, data, request):
    if data in SHARED:
        tmp_path, out = part(request.getfixturevalue("shared_job"), data)
    else:
        done, _ = launch(tmp_path, data)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = done.stdout + done.stderr
    # Every worker is given the whole data set; each batch (arrays' batch_size, a tf.data batch, a
    # PyDataset item) is a global batch, split over the workers.
    expected = single_process_weights()
    r0, r1 = rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)  # identical on every rank, not just close
    assert_close(expected, r0)
    # One voice: rank 0 shows Keras' progress, rank 1 shows none.
    assert "[rank 0] Epoch 4/4" in out and "[rank 1] Epoch" not in out
    assert "[rank 1] describe {'backend': '" + BACKEND in out
    # Two worker processes, one device each: two replicas in all, on every backend; this is rank 1.
    assert "'replicas': 2, 'model_shards': 1, 'rank': 1, 'workers': 2, 'distributed': True" in out


def test_two_workers_with_bf16_gradients_stay_equal_and_close_to_one_process(shared_job):
    """compression='bf16' across processes, on the backend's own engine: the 16-bit all-reduce gives every
    rank the same sum, so the ranks stay bit-equal; 32 SGD steps land near exact training, not on it. (In the
    shared job it follows two uncompressed fits in the same processes: a later distribute() takes its options.)"""
    tmp_path, out = part(shared_job, "bf16")
    r0, r1 = rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    expected = single_process_weights()
    for e, a in zip(expected, r0):
        np.testing.assert_allclose(a, e, rtol=2e-2, atol=2e-2)
    assert max(float(np.abs(e - a).max()) for e, a in zip(expected, r0)) > 1e-7, "not compressed"
    assert "framework replicas 2" in out


@pytest.mark.skipif(BACKEND not in ("tensorflow", "jax"), reason="TensorFlow's exact loss scaling across workers, "
                    "JAX's padding of a batch the workers don't divide")
def test_two_workers_weigh_an_uneven_split_by_batch_share(shared_job):
    # Global batch 11: 6+5 over the workers, then 1+0. Each worker's replicas only see their own batches,
    # so the global batch comes from an all-reduce there. On JAX every process pads the global batch alike
    # (to 12, and 1 to 2) and it is split, not run whole on every process.
    tmp_path, out = part(shared_job, "uneven")
    assert "doesn't split evenly" not in out + shared_job[1].stderr
    assert_close(single_process_weights(batch_size=11), rank_weights(tmp_path, 0))
    assert_close(rank_weights(tmp_path, 0), rank_weights(tmp_path, 1))


def test_a_worker_killed_mid_epoch_ends_the_job_in_bounded_time_leaving_its_last_checkpoint(tmp_path):
    # The rerun that resumes from a checkpoint is test_preemption.py's (mid-epoch, after a SIGTERM); from the last
    # epoch after a kill: test_resume.py (one process), and tests/clusters (Slurm requeue, torchrun, Ray).
    done, elapsed = launch(tmp_path, "kill", stop_timeout=FAILED_STOP_TIMEOUT)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    assert "rank 1 died (killed by SIGKILL); stopping the other workers" in done.stderr
    stopped = float(done.stderr.split("all workers stopped ")[1].split(" s after")[0])
    assert stopped <= FAILED_STOP_TIMEOUT + 1
    print("job killed: launcher exited {:.1f} s after start, other workers stopped {:.1f} s after the death".format(
        elapsed, stopped))
    with open(os.path.join(str(tmp_path), "ckpt", "checkpoint.json")) as f:
        assert json.load(f)["epoch"] == 2  # rank 1 was killed in epoch 3: epoch 2's checkpoint is there


@pytest.mark.skipif(not FULL and BACKEND != "jax", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): the exit grace is distkeras' own, the same code on every backend, and "
    "each engine's ending on a dead worker is test_a_worker_killed_mid_epoch's; the default run keeps this one on "
    "JAX, whose shutdown barrier hung the job"))
def test_a_worker_that_raises_exits_promptly_and_ends_the_job(tmp_path):
    """An exception, not a signal: the worker's engine may wait on its peers at exit (jax.distributed's
    shutdown barrier waited for a rank stuck in a collective: the job hung); distkeras ends it within
    worker.EXIT_GRACE seconds, so the launcher sees the failure and stops the job."""
    done, elapsed = launch(tmp_path, "raise", timeout=300, stop_timeout=FAILED_STOP_TIMEOUT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: rank 1 fails mid-epoch" in done.stdout  # the worker's traceback, through its one pipe
    assert "rank 1 died (exit code 1); stopping the other workers" in done.stderr
    stopped = float(done.stderr.split("all workers stopped ")[1].split(" s after")[0])
    assert stopped <= FAILED_STOP_TIMEOUT + 1
    print("rank 1 raised: launcher exited {:.1f} s after start".format(elapsed))
