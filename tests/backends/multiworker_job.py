"""One worker of a multi-worker test job, started by `distkeras launch` (see test_multiworker.py).

    python -m tests.backends.multiworker_job OUT_DIR MODE

MODE: "train" (numpy arrays, 100 samples at global batch 12, verbose=1), "tf.data" and "PyDataset"
(the same batches from a tf.data.Dataset / keras.utils.PyDataset), "uneven" (arrays at global batch 11:
6+5 over two workers, and a last batch of 1 that leaves a worker empty), "kill" (rank 1 SIGKILLs itself
mid-epoch 2), "raise" (rank 1 raises mid-epoch 2), "resume" (like train, with
distkeras.callbacks.BackupAndRestore in OUT_DIR/ckpt), "stall"
(like resume, but mid-epoch 2 every rank other than 0 writes OUT_DIR/stalled-rank{R} and sleeps, so rank 0
waits in a collective: the test then takes a host away), "preempt" (like resume, but after batch 3 of epoch 2
rank 1 writes its pid to OUT_DIR/ready and waits for OUT_DIR/sent: the test SIGTERMs it in between), "shuffle"
(like train, with fit's default shuffle=True after every rank seeds Python, NumPy and the backend with
keras.utils.set_random_seed(SHUFFLE_SEED + rank): each rank's own random state). Every
worker is given the whole data set; every rank writes its final weights to OUT_DIR/rank{R}.npz and prints how
many replicas the framework itself counts ("framework replicas N"). "shard" (like train, with shard="all"; every
rank saves OUT_DIR/model.keras, which rank 0 writes). MODE may name several modes, comma-separated: the same
worker processes then run each in turn on a fresh model, into OUT_DIR/MODE, each preceded by a line "== MODE"
(tests share one job instead of starting a job of processes per mode).
"""

import os
import random
import signal
import sys
import time

import distkeras  # first: a multi-worker engine starts before the backend's first op
import keras
import numpy as np

from distkeras.callbacks import BackupAndRestore
from tests.backends import scenarios

EPOCHS = 4
#: Rank R seeds its random generators with SHUFFLE_SEED + R in mode "shuffle".
SHUFFLE_SEED = 100


class KillRankOne(keras.callbacks.Callback):
    def __init__(self, how="kill"):
        super().__init__()
        self.how = how

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 3 and distkeras.cluster.from_env().rank == 1:
            if self.how == "raise":  # rank 0 is left waiting in the next step's collective
                raise RuntimeError("rank 1 fails mid-epoch")
            os.kill(os.getpid(), signal.SIGKILL)


class StallOthers(keras.callbacks.Callback):
    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        rank = distkeras.cluster.from_env().rank
        if self.epoch == 2 and batch == 3 and rank != 0:
            open(os.path.join(self.out_dir, "stalled-rank{}".format(rank)), "w").close()
            time.sleep(600)


class AwaitSignal(keras.callbacks.Callback):
    """After batch 3 of epoch 2, one rank tells the test its pid and waits until the test has signalled it."""

    def __init__(self, out_dir, rank=1):
        super().__init__()
        self.out_dir, self.rank = out_dir, rank

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 3 and distkeras.cluster.from_env().rank == self.rank:
            with open(os.path.join(self.out_dir, "ready.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(self.out_dir, "ready.tmp"), os.path.join(self.out_dir, "ready"))
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(self.out_dir, "sent")) and time.time() < deadline:
                time.sleep(0.05)  # the SIGTERM's Python handler runs here


def data_checks(model):
    """How many passes over the data the data check compared across the workers in ``model``'s calls so far (None:
    the check is off in this job)."""
    from distkeras.backends import datawatch

    watch = model.__dict__.get(datawatch.WATCH_OF_MODEL)
    return None if watch is None else watch.checks


def framework_replicas(model):
    """The replica count as the framework itself reports it, not distkeras."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return model.distribute_strategy.num_replicas_in_sync
    if backend == "jax":
        import jax

        return jax.device_count()
    import torch.distributed

    return torch.distributed.get_world_size()


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, index):
        part = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[part], self.y[part]


def main(out_dir, mode):
    rank = distkeras.cluster.from_env().rank
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    # JAX's test_jax_shard.py: "all" (XLA's partitioning), "gradients" (distkeras' step, its rings across processes)
    options = {"shard": "all"} if mode == "shard" else {"shard": "gradients"} if mode == "shard-gradients" else {}
    model = distkeras.distribute(model, compression="bf16" if mode == "bf16" else None, **options)
    x, y = scenarios.data(100)
    callbacks = []
    if mode == "preempt":  # first: the SIGTERM comes during this step's end, which then stops the job
        callbacks.append(AwaitSignal(out_dir))
    if mode in ("kill", "resume", "stall", "preempt"):
        callbacks.append(BackupAndRestore(os.path.join(out_dir, "ckpt")))
    if mode == "stall":
        callbacks.append(StallOthers(out_dir))
    if mode in ("kill", "raise"):
        callbacks.append(KillRankOne(mode))
    if mode == "tf.data":
        import tensorflow as tf

        data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(12)}
    elif mode == "PyDataset":
        data = {"x": Batches(x, y, 12)}
    else:
        data = {"x": x, "y": y, "batch_size": 11 if mode == "uneven" else 12}
    if mode == "shuffle":
        keras.utils.set_random_seed(SHUFFLE_SEED + rank)  # a different random state on every rank
    model.fit(epochs=EPOCHS, verbose=1, shuffle=mode == "shuffle", callbacks=callbacks, **data)
    np.savez(os.path.join(out_dir, "rank{}.npz".format(rank)), *model.get_weights())
    if mode == "shard":  # every rank saves (the arrays are gathered); rank 0 writes
        kernel = model.trainable_variables[0].value
        print("sharded spec", tuple(kernel.sharding.spec), "local", kernel.addressable_shards[0].data.shape)
        model.save(os.path.join(out_dir, "model.keras"))
    if mode == "shuffle":  # the states every rank took from rank 0 at the last epoch's start, drawn alike since
        print("drawn after fit", np.random.randint(1 << 30), random.getrandbits(30))
    print("describe", distkeras.describe(model))
    print("framework replicas", framework_replicas(model))
    print("data checks", data_checks(model))


def run_modes(out_dir, modes, run):
    """``run(folder, mode)`` for each of the comma-separated ``modes``: one mode into ``out_dir`` itself; several in
    turn, each into ``out_dir/MODE`` after a line "== MODE" (which ``test_multiworker.mode_output`` reads)."""
    modes = modes.split(",")
    for mode in modes:
        folder = out_dir if len(modes) == 1 else os.path.join(out_dir, mode)
        if len(modes) > 1:
            print("==", mode, flush=True)
            os.makedirs(folder, exist_ok=True)
        run(folder, mode)


if __name__ == "__main__":
    run_modes(sys.argv[1], sys.argv[2], main)
