"""The model and data of the MXNet multi-worker tests, shared by the test process and the workers."""

import numpy as np

import keras


def build(seed=0):
    """5 -> 8 tanh -> 3, SGD with momentum (the optimizer's state must follow the global gradient too)."""
    model = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_shape=(5,)), keras.layers.Dense(3)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(lr=0.1, momentum=0.5), loss="mse", metrics=["mae"])
    return model


def data(samples):
    rng = np.random.RandomState(1)
    x = rng.normal(size=(samples, 5)).astype("float32")
    return x, np.tanh(x[:, :3] * 2.0 + 0.3).astype("float32")


def sample_weights(samples):
    return np.where(np.arange(samples) % 4 == 1, 0.0, np.linspace(0.5, 2.0, samples)).astype("float32")
