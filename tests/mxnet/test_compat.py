"""The compatibility suite on keras-mxnet (Keras 2.2.4.3): the Keras 2 usage patterns that apply there,
through ``distribute(devices=2)`` and ``3``, train what one context trains at the same global batch.

Each case asserts the weights and History equal one context's, that the weights moved, that the model
returned is the user's own, and that N contexts really ran (read from keras-mxnet's MXNet module: its
``_context`` list and the executors MXNet bound, one per context).
"""

import numpy as np
import pytest

from tests.mxnet.harness import keras  # noqa: F401 (skips without keras-mxnet)

import distkeras

SAMPLES, BATCH = 60, 12


def _data(features=6, outputs=3, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(SAMPLES, features)).astype("float32"), rng.normal(size=(SAMPLES, outputs)).astype("float32")


def _mlp(optimizer, **layer_kwargs):
    model = keras.models.Sequential([keras.layers.Dense(16, activation="tanh", input_shape=(6,), **layer_kwargs),
                                     keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    x, y = _data()
    return model, x, y, {}


def functional_multi_io():
    a, b = keras.layers.Input((6,), name="a"), keras.layers.Input((4,), name="b")
    h = keras.layers.concatenate([keras.layers.Dense(8, activation="relu")(a), b])
    reg = keras.layers.Dense(3, name="reg")(h)
    cls = keras.layers.Dense(2, activation="softmax", name="cls")(h)
    model = keras.models.Model([a, b], [reg, cls])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
                  loss_weights={"reg": 1.0, "cls": 0.5}, metrics={"cls": ["accuracy"]})
    x, y = _data()
    rng = np.random.default_rng(2)
    return model, [x, rng.normal(size=(SAMPLES, 4)).astype("float32")], [y, rng.integers(0, 2, size=(SAMPLES, 1))], {}


def nested_models():
    inner = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_shape=(6,))], name="inner")
    inputs = keras.layers.Input((6,))
    model = keras.models.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    return model, x, y, {}


def regularizers():
    # Weight regularizers only: Keras 2.2's activity regularizers sum over the batch instead of averaging,
    # so on N contexts each context's term is weighed by its share like a mean loss (the README says so).
    return _mlp(keras.optimizers.SGD(0.1), kernel_regularizer=keras.regularizers.l2(0.01),
                bias_regularizer=keras.regularizers.l1(0.01))


def sample_and_class_weights():
    model = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_shape=(6,)),
                                     keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, _ = _data()
    y = np.random.default_rng(4).integers(0, 3, size=(SAMPLES, 1))
    return model, x, y, {"sample_weight": np.linspace(0.2, 2.0, SAMPLES).astype("float32")}


def class_weights():
    model, x, y, _ = sample_and_class_weights()
    return model, x, y, {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}


def callbacks_lr_and_early_stop():
    model, x, y, _ = _mlp(keras.optimizers.SGD(0.1))
    callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch: 0.1 * 0.5 ** epoch),
                 keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)]
    return model, x, y, {"callbacks": callbacks, "epochs": 6}


def scalar_loss():
    # A loss function that returns one number for the batch (it ends in a mean over everything, not per sample):
    # Keras 2 multiplies it by the sample weights' mean over their nonzero count (1 without sample weights), so
    # each context's value is its rows' mean, which the adapter weighs by its share of the batch like a mean loss.
    from keras import backend

    model = keras.models.Sequential([keras.layers.Dense(16, activation="tanh", input_shape=(6,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=lambda y, p: backend.mean(backend.square(y - p)))
    x, y = _data()
    return model, x, y, {}


def embedding_adam():
    # Embedding rows looked up on several contexts in one step (the same ids in every context's rows): MXNet's
    # gradient of the lookup is a dense array per context (tests/mxnet/test_internals.py), added densely, so Adam's
    # moments see the global gradient; a sum of per-context sparse rows would give Adam sum(g^2), not (sum g)^2.
    model = keras.models.Sequential([keras.layers.Embedding(10, 4, input_length=5), keras.layers.Flatten(),
                                     keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    _, y = _data()
    return model, np.random.default_rng(5).integers(0, 10, size=(SAMPLES, 5)).astype("float32"), y, {}


#: name -> (build, weight tolerance). keras-mxnet has no clipvalue; its optimizers take clipnorm only.
PATTERNS = {
    "sequential_sgd_momentum": (lambda: _mlp(keras.optimizers.SGD(0.1, momentum=0.9)), 1e-5),
    "sgd_decay": (lambda: _mlp(keras.optimizers.SGD(0.2, decay=0.05)), 1e-5),
    "adam": (lambda: _mlp(keras.optimizers.Adam(0.01)), 1e-5),
    "rmsprop": (lambda: _mlp(keras.optimizers.RMSprop(0.01)), 1e-5),
    "clipnorm": (lambda: _mlp(keras.optimizers.SGD(0.5, clipnorm=0.05)), 1e-5),
    "functional_multi_io": (functional_multi_io, 1e-5),
    "nested_models": (nested_models, 1e-5),
    "regularizers": (regularizers, 1e-5),
    "sample_weights": (sample_and_class_weights, 1e-5),
    "class_weights": (class_weights, 1e-5),
    "callbacks_lr_and_early_stop": (callbacks_lr_and_early_stop, 1e-5),
    "scalar_loss": (scalar_loss, 1e-5),
    "embedding_adam": (embedding_adam, 1e-5),
}


def run(name, devices):
    build, _ = PATTERNS[name]
    np.random.seed(0)
    model, x, y, kwargs = build()
    model.set_weights([np.random.default_rng(i).normal(scale=0.3, size=w.shape).astype("float32")
                       for i, w in enumerate(model.get_weights())])
    initial = model.get_weights()
    contexts = 1
    if devices > 1:
        assert distkeras.distribute(model, devices=devices) is model
    kwargs = dict(kwargs)
    epochs = kwargs.pop("epochs", 2)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)
    if devices > 1:  # what MXNet bound: one executor per context
        module = model._module
        executors = module._curr_module._exec_group.execs if hasattr(module, "_curr_module") else module._exec_group.execs
        contexts = len({str(c) for c in model._context}), len(executors)
    return initial, model.get_weights(), {k: list(map(float, v)) for k, v in history.history.items()}, contexts


_single = {}


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_trains_as_on_one_context(name, devices):
    _, atol = PATTERNS[name]
    if name not in _single:
        _single[name] = run(name, 1)
    _, expected, expected_history, _ = _single[name]
    initial, weights, history, contexts = run(name, devices)
    for e, w in zip(expected, weights):
        np.testing.assert_allclose(w, e, rtol=atol, atol=atol)
    assert set(history) == set(expected_history)
    for key in expected_history:
        np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert max(float(np.abs(a - b).max()) for a, b in zip(initial, weights)) > 10 * atol
    assert contexts == (devices, devices)
