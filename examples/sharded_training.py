"""Sharded training state (ZeRO-3 / FSDP): each replica keeps 1/N of the weights, gradients and optimizer state.
Lines marked `# distkeras:` are the only changes from the single-device script. Runs on JAX and PyTorch.

    KERAS_BACKEND=jax DISTKERAS_CPU_DEVICES=2 python examples/sharded_training.py
    KERAS_BACKEND=torch DISTKERAS_CPU_DEVICES=2 python examples/sharded_training.py   # one process per device

`shard="all"` trains what the unsharded model trains, and what one device trains at the same global batch, with
less memory per device: `shard="optimizer"` (ZeRO-1) and `"gradients"` (ZeRO-2) keep the weights whole
(docs/guide/sharding.md). The saved model is the plain single-device one, optimizer state included. The data is
scikit-learn's digits (shipped with it: nothing to download).
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--shard", default="all", choices=["optimizer", "gradients", "all"])
parser.add_argument("--out", default="sharded_training.keras")
args = parser.parse_args()

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                    stratify=digits.target)

model = keras.Sequential([
    keras.Input(shape=(64,)),
    keras.layers.Dense(1024, activation="relu"),  # wide layers: most of the state is theirs, split over the devices
    keras.layers.Dense(1024, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

model = distkeras.distribute(model, shard=args.shard)  # distkeras: every device, each holding 1/N of the state
batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 samples per replica

model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
model.save(args.out)  # distkeras: with shard=, every process calls save() (it gathers the state); rank 0 writes
if distkeras.is_main_process():
    print(distkeras.describe(model))
    print("test accuracy: {:.4f}".format(accuracy))
