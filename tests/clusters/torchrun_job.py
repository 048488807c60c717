"""One worker of a torchrun test job on the Keras backend KERAS_BACKEND names (see test_torchrun.py).

    torchrun --standalone --nproc-per-node 2 tests/clusters/torchrun_job.py OUT_DIR MODE
    python tests/clusters/torchrun_job.py OUT_DIR single

MODE: "train" (100 samples at global batch 12, 4 epochs, every worker given the whole data set),
"kill" (the same with distkeras.callbacks.BackupAndRestore in OUT_DIR/ckpt; on torchrun's first attempt,
TORCHELASTIC_RESTART_COUNT=0, rank 1 SIGKILLs itself mid-epoch 3, and the attempt torchrun restarts resumes),
"single" (one plain process, no distkeras: the reference). Every rank writes its final weights to
OUT_DIR/rank{R}.npz; rank 0 also writes OUT_DIR/result.json: the replica count the framework itself reports,
the attempt (restart count) and the epoch training started from.
"""

import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # torchrun runs this file as a script

import distkeras  # noqa: E402  first: a multi-worker engine starts before the backend's first op
import keras  # noqa: E402
import numpy as np  # noqa: E402

from distkeras.callbacks import BackupAndRestore  # noqa: E402
from tests.backends import scenarios  # noqa: E402
from tests.backends.multiworker_job import data_checks  # noqa: E402

EPOCHS = 4
BATCH = 12
SAMPLES = 100


class KillOnFirstAttempt(keras.callbacks.Callback):
    """Rank 1 SIGKILLs itself mid-epoch 3 (index 2), on torchrun's first attempt only."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first_attempt and self.epoch == 2 and batch == 3 and distkeras.cluster.from_env().rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def framework_replicas(model):
    """The job's size as the framework itself counts it, not distkeras."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return {"num_replicas_in_sync": int(model.distribute_strategy.num_replicas_in_sync)}
    if backend == "jax":
        import jax

        return {"process_count": jax.process_count(), "device_count": jax.device_count()}
    import torch.distributed

    return {"world_size": torch.distributed.get_world_size()}


def main(out_dir, mode):
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    rank = 0
    if mode != "single":
        model = distkeras.distribute(model)
        rank = distkeras.cluster.from_env().rank
    x, y = scenarios.data(SAMPLES)
    callbacks = []
    if mode == "kill":
        restore = BackupAndRestore(os.path.join(out_dir, "ckpt"))
        callbacks = [restore, KillOnFirstAttempt()]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(os.path.join(out_dir, "{}.npz".format("single" if mode == "single" else "rank{}".format(rank))),
             *model.get_weights())
    if mode != "single" and rank == 0:
        result = {
            "backend": keras.backend.backend(),
            "replicas": framework_replicas(model),
            "data_checks": data_checks(model),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
            "initial_epoch": restore.restored_epoch if mode == "kill" else 0,
        }
        with open(os.path.join(out_dir, ".result.json"), "w") as f:
            json.dump(result, f)
        os.replace(os.path.join(out_dir, ".result.json"), os.path.join(out_dir, "result.json"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
