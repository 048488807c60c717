"""A plain Keras 3 script that Slurm runs data-parallel: `srun python train.py`, one task per GPU.

Lines marked `# distkeras:` are the only changes from the single-device script. Every task reads its place
in the job from Slurm's variables (rank SLURM_PROCID, SLURM_STEP_NODELIST's first node as the coordinator);
TensorFlow, JAX and PyTorch all form one job (KERAS_BACKEND picks). The data is synthetic (nothing is
downloaded); every task is given all of it, and fit()'s batch_size is the global batch.

    sbatch train.sbatch                                   # see train.sbatch: srun python train.py
    srun -N2 --ntasks-per-node=4 --gpus-per-task=1 python train.py --epochs 10

A requeued or preempted job resumes from its last completed epoch (BackupAndRestore in a folder every node
sees, --backup); rank 0 alone prints and saves the model, a plain Keras model.
"""

import argparse
import os

import distkeras  # distkeras: import before keras, so the job forms before the backend starts
import keras
import numpy as np
from distkeras.callbacks import BackupAndRestore  # distkeras: atomic checkpoints, written by rank 0

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=256, help="the global batch, split over the tasks")
parser.add_argument("--samples", type=int, default=20000)
parser.add_argument("--backup", default="backup", help="checkpoints for a requeued job; on a shared file system")
parser.add_argument("--out", default="model.keras")
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.normal(size=(args.samples, 32)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32")  # a class any model can learn

keras.utils.set_random_seed(0)  # the same initial weights everywhere (distkeras also broadcasts rank 0's)
model = keras.Sequential([
    keras.Input((32,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(2, activation="softmax"),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model = distkeras.distribute(model)  # distkeras: every GPU of every task of the step
print(distkeras.describe(model))

model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=2,
          callbacks=[BackupAndRestore(args.backup)])  # distkeras: resume after a requeue
if distkeras.cluster.from_env().is_chief:  # distkeras: one writer
    model.save(args.out)
    print("saved", os.path.abspath(args.out))
