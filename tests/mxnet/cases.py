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


def fit_kwargs(case, seed=0):
    """fit()'s arguments for a case ``SAMPLES:BATCH:EPOCHS[:FLAGS]`` (``w`` sample weights, ``s`` shuffle=True,
    ``b`` shuffle='batch'), after seeding NumPy's global generator, which Keras 2 shuffles with, by ``seed``."""
    samples, batch, epochs = (int(v) for v in case.split(":")[:3])
    flags = case.split(":")[3] if case.count(":") > 2 else ""
    np.random.seed(100 + seed)
    return dict(batch_size=batch, epochs=epochs, sample_weight=sample_weights(samples) if "w" in flags else None,
                shuffle="batch" if "b" in flags else "s" in flags)
