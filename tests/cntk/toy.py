"""Imported by the worker scripts of the CNTK suite (Keras 2.3.1 on CNTK 2.7, under CPython 3.6): the data,
the toy model, and the report each rank writes for the test to read."""

import io
import json
import os
import sys

import numpy as np


def rank():
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def data(n=37, seed=7):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-1, 1, (n, 3)).astype("float32")
    y = np.stack([x[:, 0] * x[:, 1], x[:, 2] - x[:, 0]], axis=1).astype("float32") + 0.1 * rng.normal(size=(n, 2)).astype("float32")
    return x, y


OPTIMIZERS = {
    "rmsprop": lambda keras: keras.optimizers.RMSprop(learning_rate=0.01),
    "sgd": lambda keras: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    "adam": lambda keras: keras.optimizers.Adam(learning_rate=0.01),
}


def model(seed, optimizer="rmsprop", l2=0.01, metrics=("mae",)):
    """A 3-8-2 MLP whose initial weights come from numpy's global generator seeded with ``seed``."""
    import keras

    np.random.seed(seed)
    regularizer = keras.regularizers.l2(l2) if l2 else None
    net = keras.models.Sequential([keras.layers.Dense(8, activation="relu", kernel_regularizer=regularizer, input_dim=3),
                                   keras.layers.Dense(2)])
    net.compile(OPTIMIZERS[optimizer](keras), loss="mse", metrics=list(metrics))
    return net


def optimizer_state(net):
    from keras import backend as K

    return K.batch_get_value(net.optimizer.weights)


def workers_from_cntk():
    """The number of workers as CNTK's MPI communicator counts them (not distkeras' view of the job)."""
    from cntk.train.distributed import Communicator

    return Communicator.num_workers()


class Capture(io.StringIO):
    """Keeps what this rank prints (``sys.stdout``), to report it."""

    def __enter__(self):
        self.saved, sys.stdout = sys.stdout, self
        return self

    def __exit__(self, *exc):
        sys.stdout = self.saved


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def report(**values):
    with open(os.path.join(os.environ["RESULTS_DIR"], "result.{}.json".format(rank())), "w") as handle:
        json.dump(_plain(values), handle)
