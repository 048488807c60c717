"""Distributing a distributed model again: on the same devices a no-op, on others a clear error.

``distribute(distribute(model, 2), 1)`` returned the model unchanged, still training on 2 devices, while
``describe()`` said 1 device and not distributed. distkeras moves no distributed model (its variables live on
the first devices: mirrored on TensorFlow, laid out on a mesh on JAX, in other processes on PyTorch)."""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)

import distkeras


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def redistribute(first, second):
    """rank 0's view: describe() after the first distribute(), then the second's error (or describe() after it
    and whether fit() still runs)."""
    model = _model()
    distkeras.distribute(model, devices=first)
    before = distkeras.describe(model)
    try:
        again = distkeras.distribute(model, devices=second)
    except distkeras.DistKerasError as exc:
        return before, exc, distkeras.describe(model)
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    return before, again is model, distkeras.describe(again), len(history["loss"])


def test_the_same_devices_again_are_a_no_op():
    before, same, after, epochs = replicated(2, redistribute, 2, 2)
    assert same and after == before and before["distributed"] and before["replicas"] == 2 and epochs == 1


@pytest.mark.parametrize("second", [1, 3], ids=["fewer", "more"])
def test_other_devices_are_refused_and_describe_stays_true(second):
    if BACKEND == "jax" and second > 1:  # JAX lays the model out again (test_jax.py: ...moved_to_other_devices...)
        before, same, after, epochs = redistribute(2, second)
        assert same and after["replicas"] == second and after["distributed"] and epochs == 1
        return
    before, error, after = replicated(2, redistribute, 2, second)
    assert isinstance(error, distkeras.ModelError), error
    message = str(error)
    assert "is distributed already, on {} ({} backend), and distkeras can't move a distributed model".format(
        ", ".join(before["devices"]), BACKEND) in message, message
    assert "Build the model again" in message and "with the same devices as before" in message
    # describe() still tells the truth: the model is distributed where it was.
    assert after == before and after["distributed"] and after["replicas"] == 2


def grow(second):
    model = _model()
    distkeras.distribute(model, devices=1)
    first = distkeras.describe(model)
    distkeras.distribute(model, devices=second)
    return first, distkeras.describe(model)


def test_a_model_left_on_one_device_can_be_distributed_later():
    if BACKEND == "torch":
        pytest.skip("PyTorch's replicas are processes: a job of 2 processes has no one-device model to grow")
    first, after = grow(2)
    assert not first["distributed"] and after["distributed"] and after["replicas"] == 2
