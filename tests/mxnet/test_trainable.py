"""keras-mxnet (Keras 2.2.4.3): a layer's trainability follows its flag after ``distribute()``, as on one context.

The transfer-learning guide's two phases: a base frozen under a new head, trained; then unfrozen, the model
compiled again and fine-tuned. Keras 2 reads the trainable weights when ``compile()`` runs, so a layer frozen
when ``distribute()`` ran fine-tunes once unfrozen and recompiled, and one frozen after it stops moving: the
weights equal one context's at the same global batch, and N contexts really ran.
"""

import numpy as np

from tests.mxnet.harness import keras  # noqa: F401 (skips without keras-mxnet)

import distkeras


def _data(samples=24, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(samples, 4)).astype("float32"), rng.normal(size=(samples, 1)).astype("float32")


def _contexts(model):
    module = model._module
    executors = module._curr_module._exec_group.execs if hasattr(module, "_curr_module") else module._exec_group.execs
    return len({str(c) for c in model._context}), len(executors)


def _fine_tune(devices):
    np.random.seed(0)
    base = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_shape=(4,)), keras.layers.Dense(6)],
                                   name="base")
    base.set_weights([np.random.default_rng(i).normal(scale=0.3, size=w.shape).astype("float32")
                      for i, w in enumerate(base.get_weights())])
    base.trainable = False
    inputs = keras.layers.Input((4,))
    model = keras.models.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(base(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if devices > 1:
        assert distkeras.distribute(model, devices=devices) is model
    x, y = _data()
    initial = base.get_weights()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    frozen = base.get_weights()
    base.trainable = True
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    tuned = base.get_weights()
    base.trainable = False  # and back: frozen after distribute() and a compile(), it stops moving
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    contexts = _contexts(model) if devices > 1 else (1, 1)
    return initial, frozen, tuned, base.get_weights(), model.get_weights(), contexts


def test_a_layer_frozen_at_distribute_fine_tunes_once_unfrozen_and_stops_once_frozen_again():
    expected = _fine_tune(1)
    initial, frozen, tuned, refrozen, weights, contexts = _fine_tune(2)
    assert contexts == (2, 2)
    for a, b in zip(initial, frozen):
        np.testing.assert_array_equal(a, b)  # frozen: didn't move
    assert max(float(np.abs(a - b).max()) for a, b in zip(frozen, tuned)) > 1e-3  # unfrozen: fine-tuned
    for a, b in zip(tuned, refrozen):
        np.testing.assert_array_equal(a, b)  # frozen again: didn't move
    for e, g in zip(expected[4], weights):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
