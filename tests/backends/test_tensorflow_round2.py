"""TensorFlow: transfer learning, shuffled datasets and TensorFlow's own random ops train what one device trains.

- A layer frozen when ``distribute()`` runs and unfrozen later (the transfer-learning guide's fine-tuning step)
  moves as on one device; a layer frozen after ``distribute()`` stops moving.
- A shuffling pipeline (``tf.data`` ``.shuffle()``, a ``PyDataset`` under fit's ``shuffle=True``) gives the
  distributed fit the order it gives one device: nothing draws a batch training doesn't use. An empty validation
  dataset warns, as on one device.
- ``tf.random.*`` in a custom ``train_step`` (keras-io's WGAN-GP draws its latent vectors and its interpolation
  weights so) draws one device's values for each replica's rows: stateless ops, and stateful ops with an op seed.
"""


import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow adapter tests (KERAS_BACKEND=tensorflow)")
TOLERANCE = 1e-5


def _data(samples=24, features=4, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(samples, features)).astype("float32"), rng.normal(size=(samples, 1)).astype("float32")


def _weights(model):
    return [np.array(w) for w in model.weights]


def _assert_same(expected, got, tolerance=TOLERANCE):
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        np.testing.assert_allclose(g, e, rtol=tolerance, atol=tolerance, err_msg="weight {}".format(i))


def _distributed(model, devices):
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
        assert model.distribute_strategy.num_replicas_in_sync == devices
    return model


# 1. Trainability follows the layer's flag after distribute() ----------------------------------------------------

def _fine_tune(devices):
    """The transfer-learning guide's two phases: a frozen base under a new head, then the whole model fine-tuned."""
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)],
                            name="base")
    base.trainable = False
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(base(inputs, training=False))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = _distributed(model, devices)
    x, y = _data()
    initial = _weights(base)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    frozen = _weights(base)
    base.trainable = True
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return initial, frozen, _weights(model), _weights(base)


def test_a_layer_frozen_at_distribute_fine_tunes_once_unfrozen():
    expected = _fine_tune(1)
    got = _fine_tune(2)
    _assert_same(got[0], got[1], 0)  # frozen: the base didn't move in the first phase
    assert max(float(np.abs(a - b).max()) for a, b in zip(expected[1], expected[3])) > 1e-3  # one device fine-tunes
    _assert_same(expected[2], got[2])


def _freeze_after(devices):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model = _distributed(model, devices)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    frozen = _weights(model.layers[0])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return frozen, _weights(model.layers[0]), _weights(model)


def test_a_layer_frozen_after_distribute_stops_moving():
    expected = _freeze_after(1)
    got = _freeze_after(2)
    _assert_same(got[0], got[1], 0)
    _assert_same(expected[2], got[2])
