"""Preemption: a SIGTERM mid-epoch stops every worker after the same step, rank 0 checkpoints that step, the job
exits with status 75 (``distkeras.launch.EXIT_PREEMPTED``), and the rerun resumes from that step, not from the
epoch, to the weights of an uninterrupted run."""

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

import distkeras
from distkeras.callbacks import MANIFEST, BackupAndRestore
from distkeras.launch import EXIT_PREEMPTED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STOP_TIMEOUT = 20
EPOCHS = 4


def build():
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")  # state to restore
    return model


def uninterrupted(samples, shuffle=False):
    model = build()
    x, y = scenarios.data(samples)
    np.random.seed(7)
    model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=shuffle, verbose=0)
    return model.get_weights()


def assert_close(expected, actual):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


class SignalSelf(keras.callbacks.Callback):
    """Sends this process a real SIGTERM after batch 3 of epoch 2 (the handler runs before the next step)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 3:
            os.kill(os.getpid(), signal.SIGTERM)


def test_one_process_sigterm_saves_the_step_and_resumes_from_it(tmp_path):
    """In this process: SIGTERM -> checkpoint of epoch 3's first 4 steps -> SystemExit(75); the next fit()
    passes over those 4 batches and ends with the uninterrupted weights. With shuffle=True (JAX, PyTorch:
    NumPy's / torch's global generators) the resumed epoch draws the same order from the saved states."""
    # shuffle=False is what the job test below covers; TensorFlow's array shuffle (tf.random) isn't reproduced.
    shuffle = BACKEND != "tensorflow"
    devices = 1 if BACKEND == "torch" else 2  # torch runs several devices as processes: see the job test
    x, y = scenarios.data(96)
    backup = BackupAndRestore(tmp_path / "ckpt")
    model = distkeras.distribute(build(), devices=devices)
    np.random.seed(7)  # as uninterrupted(): build() seeded every generator, then NumPy's is reseeded
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=[SignalSelf(), backup])
    assert stopped.value.code == EXIT_PREEMPTED
    assert signal.getsignal(signal.SIGTERM) is previous  # handed back
    with open(tmp_path / "ckpt" / MANIFEST) as f:
        manifest = json.load(f)
    assert (manifest["epoch"], manifest["step"]) == (2, 4), manifest
    resumed = distkeras.distribute(build(), devices=devices)
    keras.utils.set_random_seed(99)  # whatever the restart's generators hold, the saved states decide the order
    backup = BackupAndRestore(tmp_path / "ckpt")
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)))  # JAX: synced state

    resumed.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=[backup, Count()])
    assert (backup.restored_epoch, backup.restored_step) == (2, 4)
    # 8 steps per epoch: epoch 3 starts at iteration 16; its 4 trained steps were passed over, not trained.
    assert seen[4] == 16 + 4 and seen[-1] == 8 * EPOCHS - 1, seen
    assert_close(uninterrupted(96, shuffle), resumed.get_weights())
    assert not os.path.exists(tmp_path / "ckpt")


def launch(out_dir, mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=BACKEND)
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "--backend", BACKEND,
               "--stop-timeout", str(STOP_TIMEOUT), "-m", "tests.backends.multiworker_job", str(out_dir), mode]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)


def finish(job, timeout=300):
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
    return job.returncode, out, err


def test_a_worker_sigtermed_mid_epoch_stops_the_job_at_that_step_and_the_rerun_resumes_from_it(tmp_path):
    job = launch(tmp_path, "preempt")
    try:
        ready = tmp_path / "ready"
        deadline = time.time() + 240
        while not ready.exists() and job.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert ready.exists(), finish(job, 5)
        os.kill(int(ready.read_text()), signal.SIGTERM)  # rank 1 only: rank 0 learns of it from the collective
        (tmp_path / "sent").touch()
        code, out, err = finish(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert code == EXIT_PREEMPTED, out[-3000:] + err[-3000:]
    # Whichever rank exits first is reported; none of them died.
    assert re.search(r"rank [01] was preempted \(exit code 75\)", err) and "died" not in err, err[-3000:]
    assert "[rank 0] distkeras: preempted (SIGTERM): saved epoch 3 step 4 of 9" in out  # a worker's stderr: on stdout
    assert "job preempted: exiting with status 75" in err
    with open(tmp_path / "ckpt" / MANIFEST) as f:
        manifest = json.load(f)
    assert (manifest["epoch"], manifest["step"]) == (2, 4), manifest
    assert not os.path.exists(tmp_path / "rank0.npz")  # nobody finished training

    again = launch(tmp_path, "resume")
    code, out, err = finish(again)
    assert code == 0, out[-3000:] + err[-3000:]
    assert "[rank 0] Epoch 3/4" in out and "[rank 0] Epoch 2/4" not in out
    w0 = np.load(tmp_path / "rank0.npz")
    w1 = np.load(tmp_path / "rank1.npz")
    weights = [w0["arr_{}".format(i)] for i in range(len(w0.files))]
    for i, w in enumerate(weights):
        np.testing.assert_array_equal(w, w1["arr_{}".format(i)])
    assert_close(uninterrupted(100), weights)


def test_a_fit_that_raised_leaves_sigterm_as_it_was(tmp_path):
    """A fit() that raises never reaches on_train_end; a SIGTERM afterwards still does what it did before."""
    x, y = scenarios.data(24)

    class Fail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("fails mid-epoch")

    got = []

    def mine(signum, frame):
        got.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        model = build()
        with pytest.raises(RuntimeError):
            model.fit(x, y, batch_size=12, epochs=1, verbose=0, callbacks=[BackupAndRestore(tmp_path / "c"), Fail()])
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            time.sleep(0.01)
        assert got == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is mine  # handed back
    finally:
        signal.signal(signal.SIGTERM, previous)
