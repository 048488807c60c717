"""One task of a Slurm test job (see test_slurm.py), started by srun with no launcher, or by distkeras launch.

    python -m tests.clusters.slurm_job OUT_DIR MODE

MODE: "single" (one process, no distkeras: the reference weights, OUT_DIR/single.npz), "train" (100 samples at
global batch 12, 4 epochs), "kill" (rank 1 SIGKILLs itself in epoch 1, after writing the time to
OUT_DIR/killed-at), "requeue" (like train, with distkeras.callbacks.BackupAndRestore in OUT_DIR/ckpt; from batch 3 of
epoch 2 the job's first run, rank 0 writing OUT_DIR/paused, trains a step a second until it is requeued). Rank 0 writes the
initial weights to OUT_DIR/init.npz; every rank writes its final weights to OUT_DIR/rank{R}.npz and to
OUT_DIR/rank{R}.json the replica count the framework itself reports and the epochs this run trained.
"""

import json
import os
import signal
import sys
import time

MODE = sys.argv[2] if len(sys.argv) > 2 else "train"
if MODE != "single":
    import distkeras  # first: a multi-worker engine starts before the backend's first op
import keras  # noqa: E402 (after distkeras, on purpose)
import numpy as np  # noqa: E402

from tests.backends import scenarios  # noqa: E402
from tests.backends.multiworker_job import data_checks, framework_replicas  # noqa: E402 (the replica count as the framework reports it)

EPOCHS = 4


class Events(keras.callbacks.Callback):
    """Records the epochs trained; kills rank 1 ("kill") or pauses the first run after epoch 2 ("requeue")."""

    def __init__(self, out_dir, rank):
        super().__init__()
        self.out_dir, self.rank, self.epochs = out_dir, rank, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epochs.append(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if MODE == "kill" and self.rank == 1 and self.epoch == 0 and batch == 2:
            with open(os.path.join(self.out_dir, "killed-at"), "w") as sink:
                sink.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        first_run = os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")
        if MODE == "requeue" and first_run and (self.epoch, batch) >= (1, 2):
            if self.rank == 0 and (self.epoch, batch) == (1, 2):
                open(os.path.join(self.out_dir, "paused"), "w").close()
            time.sleep(1)  # slowly, until `scontrol requeue`'s SIGTERM stops the job after a step of this epoch


def main(out_dir, mode):
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    x, y = scenarios.data(100)
    if mode == "single" or distkeras.cluster.from_env().rank == 0:
        np.savez(os.path.join(out_dir, "init.npz"), *model.get_weights())  # the reference starts from these
    if mode == "single":
        model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=False, verbose=0)
        np.savez(os.path.join(out_dir, "single.npz"), *model.get_weights())
        return
    rank = distkeras.cluster.from_env().rank
    model = distkeras.distribute(model)
    events = Events(out_dir, rank)
    callbacks = [events]
    if mode == "requeue":
        from distkeras.callbacks import BackupAndRestore

        callbacks.append(BackupAndRestore(os.path.join(out_dir, "ckpt")))
    model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=False, verbose=2 if rank == 0 else 0, callbacks=callbacks)
    np.savez(os.path.join(out_dir, "rank{}.npz".format(rank)), *model.get_weights())
    cluster = distkeras.cluster.from_env()
    with open(os.path.join(out_dir, "rank{}.json".format(rank)), "w") as sink:
        json.dump({"replicas": framework_replicas(model), "epochs": events.epochs, "source": cluster.source,
                   "data_checks": data_checks(model),
                   "world_size": cluster.world_size, "local_rank": cluster.local_rank,
                   "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}, sink)


if __name__ == "__main__":
    main(sys.argv[1], MODE)
