"""The model and data of the MXNet multi-worker tests, shared by the test process and the workers."""

import numpy as np

import keras


def build(seed=0, compile=True):
    """5 -> 8 tanh -> 3, SGD with momentum (the optimizer's state must follow the global gradient too)."""
    model = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_shape=(5,)), keras.layers.Dense(3)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    if compile:
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


#: The split evaluate()/predict() case: 10 rows in batches of 4 (the last one of 2 rows: smaller than 3 workers).
EVAL_SAMPLES, EVAL_BATCH = 10, 4


def evaluate_all(distribute, seed=0):
    """What the ``eval`` case computes, by name: evaluate() and predict() on arrays (with and without sample
    weights, a model never compiled too), and the History of fit() with validation_split and with validation_data.
    ``distribute`` makes a model distributed (the identity in one process)."""
    x, y = data(EVAL_SAMPLES)
    weights = sample_weights(EVAL_SAMPLES)
    model = distribute(build(seed))
    results = {"evaluate": model.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0),
               "evaluate_weighted": model.evaluate(x, y, batch_size=EVAL_BATCH, sample_weight=weights, verbose=0),
               "predict": model.predict(x, batch_size=EVAL_BATCH),
               "predict_uncompiled": distribute(build(seed, compile=False)).predict(x, batch_size=EVAL_BATCH)}
    x24, y24 = data(24)
    history = distribute(build(seed)).fit(x24, y24, batch_size=8, epochs=2, shuffle=False, validation_split=0.25,
                                          verbose=0).history
    results.update(("split_" + k, v) for k, v in history.items())
    history = distribute(build(seed)).fit(x24, y24, batch_size=6, epochs=1, shuffle=False,
                                          validation_data=(x, y, weights), verbose=0).history
    results.update(("data_" + k, v) for k, v in history.items())
    # Two outputs, a loss and metrics each (the loss weighs samples, the metrics rows), sample weights per output
    # (zero in the same rows: see tests/mxnet/test_distribute.py for zeros in other rows).
    model = distribute(two_outputs(seed))
    targets = [y, y[:, :2]]
    results["two_outputs_evaluate"] = model.evaluate(x, targets, batch_size=EVAL_BATCH, verbose=0,
                                                     sample_weight=[weights, np.where(weights > 0, 2.5 - weights, 0)])
    results["two_outputs_predict"] = np.concatenate(model.predict(x, batch_size=EVAL_BATCH), axis=1)
    return {k: np.asarray(v, "float64") for k, v in results.items()}


def two_outputs(seed=0):
    """5 -> 8 tanh -> (3, 2): two outputs with a loss and a metric each."""
    inputs = keras.layers.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.models.Model(inputs, [keras.layers.Dense(3, name="a")(hidden), keras.layers.Dense(2, name="b")(hidden)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(lr=0.1), loss=["mse", "mae"], loss_weights=[1.0, 0.5],
                  metrics=["mae"])
    return model


def dropout_model():
    """1 -> 64 (kernel of ones) -> Dropout(0.5), loss the mean output, SGD(1): one step on rows of ones moves each
    kernel weight by 2/64 times the mean over the batch's rows of that unit's dropout mask (0 or 1)."""
    from keras import backend

    inputs = keras.layers.Input((1,))
    outputs = keras.layers.Dropout(0.5)(keras.layers.Dense(64, use_bias=False, kernel_initializer="ones")(inputs))
    model = keras.models.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(lr=1.0), lambda y, p: backend.mean(p + 0 * y, axis=-1))
    return model


def dropout_kept(model, rows):
    """Per unit, how many of the ``rows`` rows of one step kept it (what the kernel moved)."""
    return np.round((1.0 - model.get_weights()[0][0]) * 32 * rows).astype(int)
