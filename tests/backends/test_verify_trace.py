"""The one-device check leaves no trace: a run with it on (and quiet) is bit for bit the run with it off.

The program is rebuilt from a user's report (a YOLO-style detector from a Keras 3 book): a KerasHub ResNet
backbone, a dict output ``{"box": ..., "class": ...}``, a hand-written box loss summed over the grid per sample,
Adam, ``fit(tf.data, validation_data=...)``. Before the fix, the check's step on TensorFlow was traced for the
concrete batch (Keras' per-output loss trackers then weigh it by its rows, every other step by 1), and the first
epoch's ``box_loss`` with the check on was 74.7 against 73.2 without it. The corpus runs the same comparison over
every program (``tests/backends/test_corpus.py``, :func:`~tests.backends.test_corpus.traces`).
"""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)
from tests.backends import corpus
from tests.backends.corpus.common import BN_ADAM, distribute, evaluate, predict, result
from tests.backends.test_corpus import differences, traces, without_noise_steps
from tests.full import FULL, only_in_full

pytest.importorskip("keras_hub")
tf = pytest.importorskip("tensorflow")

SIDE, GRID, CLASSES, BATCH = 16, 2, 3, 12


def _data():
    r = np.random.default_rng(1)
    x = r.uniform(size=(44, SIDE, SIDE, 3)).astype("float32")
    box = r.normal(size=(44, GRID, GRID, 4)).astype("float32")
    cls = keras.utils.to_categorical(r.integers(0, CLASSES, size=(44, GRID, GRID)), CLASSES).astype("float32")
    return x, {"box": box, "class": cls}


def _dataset(x, y, start, stop):
    # 32 training rows at batch 12: 12, 12, 8 (an uneven last batch, which Keras' trackers weigh by rows)
    return tf.data.Dataset.from_tensor_slices((x[start:stop], {k: v[start:stop] for k, v in y.items()})).batch(BATCH)


def detector(devices):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        use_pre_activation=False, image_shape=(SIDE, SIDE, 3))
    images = keras.Input((SIDE, SIDE, 3))
    features = backbone(images)
    outputs = {"box": keras.layers.Conv2D(4, 1, name="box")(features),
               "class": keras.layers.Conv2D(CLASSES, 1, activation="softmax", name="class")(features)}
    model = keras.Model(images, outputs)

    def box_loss(y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_true - y_pred), axis=(1, 2, 3))  # summed over the grid, per sample

    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss={"box": box_loss, "class": "categorical_crossentropy"})
    model = distribute(model, devices)
    x, y = _data()
    history = model.fit(_dataset(x, y, 0, 32), validation_data=_dataset(x, y, 32, 44), epochs=2, verbose=0)
    return result(model, history, evaluate(model, _dataset(x, y, 32, 44)), predict(model, x[32:44])["box"])


@pytest.mark.skipif(not FULL and BACKEND == "jax", reason=(
    "full run only on JAX (DISTKERAS_FULL_TESTS=1): the detector's conv backbone costs a minute to compile there; "
    "TensorFlow and PyTorch run it by default, and on JAX the check's replay is held by test_add_loss_a_custom_"
    "tracker_and_dropout_train_the_same_with_the_check_on_and_off and the corpus' check-off runs"))
def test_the_detector_trains_the_same_with_the_check_on_and_off():
    on = replicated(2, corpus.recorded, detector, 2, "raise")
    off = replicated(2, corpus.recorded, detector, 2, "0")
    assert on["replicas"] == (2, 2)
    assert len(on["batches"]["train"]) == 6 and len(on["batches"]["test"]) == 3, on["batches"]
    left = traces(off, on)
    assert not left, "the check left a trace: " + "; ".join(left[:12])
    if not FULL:  # the third run (one device) in the full run only: the corpus compares every program with it
        return
    expected = corpus.recorded(detector, 1)
    got = without_noise_steps(expected, off, BN_ADAM)
    differ = differences(expected, got, BN_ADAM)
    assert not differ, "differs from one device: " + "; ".join(differ)


class Tracked(keras.Model):
    """Keras' own step around a subclassed model: unseeded Dropout (Keras' global seed generator), an ``add_loss``
    term, and a custom tracker a ``compute_loss`` override updates (the "customizing fit()" guides' pattern)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.drop = keras.layers.Dropout(0.25)
        self.out = keras.layers.Dense(1)
        self.penalty = keras.metrics.Mean(name="penalty")

    def call(self, x, training=False):
        h = self.hidden(x)
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.square(h)))
        return self.out(self.drop(h, training=training))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        self.penalty.update_state(loss)
        return loss


def tracked(devices, run_eagerly=False):
    keras.utils.set_random_seed(3)
    r = np.random.default_rng(4)
    x = r.normal(size=(40, 6)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    model = Tracked()
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"], run_eagerly=run_eagerly)
    model = distribute(model, devices)
    # shuffle=True: each epoch's order is drawn from the global RNGs, which the check must leave as it found them
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=True, validation_split=0.25, verbose=0)
    return result(model, history, evaluate(model, x, y), predict(model, x))


def tracked_eagerly(devices):
    return tracked(devices, run_eagerly=True)


@pytest.mark.parametrize("program", [tracked, pytest.param(tracked_eagerly, marks=only_in_full(
    "the eager step takes the checked path the compiled one takes; the compiled case runs by default"))],
    ids=["compiled", "eager"])
def test_add_loss_a_custom_tracker_and_dropout_train_the_same_with_the_check_on_and_off(program):
    on = replicated(2, corpus.recorded, program, 2, "raise")
    off = replicated(2, corpus.recorded, program, 2, "0")
    assert on["replicas"] == (2, 2)
    assert "penalty" in on["history"] and len(on["batches"]["train"]) == 9, on["history"]
    left = traces(off, on)
    assert not left, "the check left a trace: " + "; ".join(left[:12])
