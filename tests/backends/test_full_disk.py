"""A disk that fills up during training: BackupAndRestore's next checkpoint doesn't fit on a real small tmpfs.
The run ends with distkeras' CheckpointError saying so and exit status 1, never HDF5's segfault at exit, and the
previous checkpoint stays whole (its checksum holds and it resumes). Needs root and a permitted tmpfs mount;
skips saying why elsewhere."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.backends.harness import BACKEND
from tests.full import FULL
from tests.backends.test_multiworker import ROOT
from tests.tmpfs import small_tmpfs

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import keras
    import distkeras
    from distkeras.callbacks import BackupAndRestore

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(300), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model = distkeras.distribute(model, 1)
    x, y = np.random.rand(32, 300).astype("float32"), np.random.rand(32, 1).astype("float32")

    class FillTheDisk(keras.callbacks.Callback):  # other files of the job eat the space left after epoch 1
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                with open(sys.argv[2], "wb") as f:
                    f.write(b"x" * int(sys.argv[3]))

    model.fit(x, y, batch_size=8, epochs=3, verbose=0,
              callbacks=[BackupAndRestore(sys.argv[1], delete_checkpoint=False), FillTheDisk()])
""")


@pytest.mark.skipif(not FULL and BACKEND != "jax", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): the checkpoint is written by Keras' own .weights.h5 writer and "
    "distkeras' atomic rename, the same on every backend; the default run keeps this one on JAX"))
def test_a_full_disk_ends_the_run_with_a_clear_error_and_the_previous_checkpoint_whole(tmp_path):
    with small_tmpfs(tmp_path / "small") as small:
        backup, filler = small / "backup", small / "filler"
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), KERAS_BACKEND=BACKEND, KERAS_HOME=str(tmp_path))
        # 1 MiB in all, one checkpoint ~362 KB: after epoch 1 the filler leaves ~200 KB, too little for epoch 2's.
        run = subprocess.run([sys.executable, str(script), str(backup), str(filler), str(450 * 1024)],
                             capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
        assert "CheckpointError: The disk is full: writing epoch-00002.weights.h5 failed in {}".format(backup) in run.stderr
        assert "The previous checkpoint (or file) there is intact" in run.stderr
        manifest = json.loads((backup / "checkpoint.json").read_text())
        assert manifest["epoch"] == 1
        assert sorted(p.name for p in backup.iterdir()) == ["checkpoint.json", manifest["weights"]]
        from distkeras import checkpoints
        checkpoints.check_weights(str(backup), manifest)  # its checksum holds
