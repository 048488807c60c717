"""Fault tolerance: a run killed mid-training resumes from its last completed epoch and ends with the
weights of an uninterrupted run; a crash while a checkpoint is written never blocks the restart."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.backends import scenarios

import distkeras
from distkeras.callbacks import MANIFEST, BackupAndRestore

pytestmark = pytest.mark.skipif(BACKEND == "torch", reason="torch runs replicas as processes: see test_torch.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPOCHS = 4

SCRIPT = """
import os, signal, sys
sys.path[:0] = [{root!r}, {src!r}]
import distkeras
distkeras.use_cpu_devices(2)
import keras, numpy as np
from distkeras.callbacks import BackupAndRestore
from tests.backends import scenarios

class KillMidEpoch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 3:   # epochs 0 and 1 are checkpointed; die inside epoch 2
            os.kill(os.getpid(), signal.SIGKILL)
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

model = scenarios.build(keras)
model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")  # state to restore
model = distkeras.distribute(model, devices=2)
x, y = scenarios.data(96)
backup = BackupAndRestore(sys.argv[1])
callbacks = [backup] + ([KillMidEpoch()] if sys.argv[3] == "kill" else [])
model.fit(x, y, batch_size=12, epochs={epochs}, shuffle=False, verbose=0, callbacks=callbacks)
print("resumed from epoch", backup.restored_epoch)
np.savez(sys.argv[2], *model.get_weights())
"""


def run(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=ROOT, src=os.path.join(ROOT, "src"), epochs=EPOCHS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env["KERAS_BACKEND"] = BACKEND
    return subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "w.npz"), mode],
                          capture_output=True, text=True, env=env, timeout=600)


def build():
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def uninterrupted():
    model = build()
    x, y = scenarios.data(96)
    model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def test_killed_run_resumes_from_the_last_epoch_and_matches_an_uninterrupted_run(tmp_path):
    killed = run(tmp_path, "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == [MANIFEST, "epoch-00002.weights.h5"]
    again = run(tmp_path, "finish")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from epoch 2" in again.stdout
    final = np.load(tmp_path / "w.npz")
    for i, expected in enumerate(uninterrupted()):
        np.testing.assert_allclose(final["arr_{}".format(i)], expected, rtol=1e-5, atol=1e-5)
    assert not os.path.exists(tmp_path / "ckpt")  # removed after a normal end


def test_a_crash_while_writing_leaves_the_previous_checkpoint_usable(tmp_path):
    backup_dir = tmp_path / "ckpt"
    x, y = scenarios.data(96)

    class TornWrite(BackupAndRestore):
        def _save_weights(self, path):
            if self.model.optimizer.iterations.numpy() > 8:  # second epoch: die halfway through the file
                with open(path, "wb") as f:
                    f.write(b"\x89HDF\r\n half a checkpoint")
                raise KeyboardInterrupt("killed while writing")
            super()._save_weights(path)

    model = distkeras.distribute(build(), devices=2)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[TornWrite(backup_dir)])
    assert sorted(os.listdir(backup_dir)) == [MANIFEST, "epoch-00001.weights.h5"]  # no torn file left behind

    resumed = distkeras.distribute(build(), devices=2)
    backup = BackupAndRestore(backup_dir)
    resumed.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[backup])
    assert backup.restored_epoch == 1
    for got, expected in zip(resumed.get_weights(), uninterrupted()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
