"""The one-device check (``distribute(..., verify=True)``, ``DISTKERAS_VERIFY``) on every Keras 3 backend.

It must raise nothing where the distributed step is one device's (BatchNormalization, Dropout, Adam: the state it
compares is restored, so training is bit-for-bit what it is without the check), and it must catch a step that is
not: a forward pass that mixes the rows of a batch, which TensorFlow and PyTorch compute per replica (JAX runs one
program over the global batch, where it is exact and the check stays quiet).
"""

import os

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(24, 4)).astype("float32"), rng.integers(0, 3, size=(24,))


def _model(mixing=False, activation="relu"):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, activation=activation)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.3)(x)
    if mixing:  # each row minus the batch's mean row: one device's batch is every replica's
        x = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def train(devices, verify, mixing=False, epochs=2, activation="relu"):
    """Plain data: the weights after fit(), History, the checks made and what they found (or the error)."""
    import distkeras

    x, y = _data()
    model = distkeras.distribute(_model(mixing, activation), devices, verify=verify)
    try:
        history = model.fit(x, y, batch_size=12, epochs=epochs, verbose=0, shuffle=False)
    except distkeras.VerifyError as error:
        return {"error": str(error)}
    check = model.__dict__.get("_distkeras_check")
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "history": history.history,
        "checked": check.checked if check else None,
        "found": [d.name for d in check.found] if check else None,
        "explained": [d.name for d in check.explained] if check else None,
        "replicas": distkeras.describe(model)["replicas"],
    }


def test_no_false_alarm_and_training_unchanged():
    checked = replicated(2, train, 2, True)
    assert "error" not in checked, checked.get("error")
    assert checked["replicas"] == 2 and checked["checked"] == 1 and checked["found"] == []
    plain = replicated(2, train, 2, False)
    for got, want in zip(checked["weights"], plain["weights"]):
        np.testing.assert_array_equal(got, want)  # the check put the distributed state back, exactly
    assert checked["history"] == plain["history"]


def test_no_false_alarm_on_a_zero_gradient_that_adam_normalises():
    """A linear Dense into BatchNormalization: the Dense bias' gradient is 0 on paper (BN subtracts the batch mean),
    rounding noise in fact, and Adam turns noise of either sign into a step of about the learning rate. Its weights
    differ; its slots, linear in the gradient, agree: explained, not reported."""
    got = replicated(2, train, 2, True, False, 1, None)
    assert "error" not in got, got.get("error")
    assert got["checked"] == 1 and got["found"] == []


def test_catches_a_batch_mixing_forward_pass():
    got = replicated(2, train, 2, True, True, 1)
    if BACKEND == "jax":  # one program over the global batch: one device's, so nothing to catch
        assert "error" not in got and got["found"] == []
        return
    assert "error" in got
    assert "differ beyond" in got["error"] and "dense" in got["error"] and "rows of a batch" in got["error"]


def test_warn_mode_trains_on(caplog):
    if BACKEND == "jax":
        pytest.skip("JAX computes the mixing pass exactly: nothing to warn about")
    got = replicated(2, train, 2, "warn", True, 1)
    assert "error" not in got and got["found"], got


def test_environment_switch(monkeypatch):
    import distkeras

    assert replicated(2, _distributed_has_check, "1")  # in the job's processes (PyTorch's are workers)
    monkeypatch.setenv("DISTKERAS_VERIFY", "nonsense")
    with pytest.raises(distkeras.OptionError, match="DISTKERAS_VERIFY"):
        distkeras.distribute(_model(), 2)


def _distributed_has_check(switch):
    import distkeras

    os.environ["DISTKERAS_VERIFY"] = switch
    try:
        return "_distkeras_check" in distkeras.distribute(_model(), 2).__dict__
    finally:
        del os.environ["DISTKERAS_VERIFY"]


def test_global_seed_generator_is_where_the_check_reads_it():
    """Pins the private Keras global state name the check snapshots (keras.random without a seed)."""
    from keras.src.backend.common import global_state

    from distkeras.backends import verifying

    keras.random.normal((2,))
    generator = global_state.get_global_attribute(verifying._GLOBAL_SEED)
    assert generator is not None and generator.state in verifying._global_seed_variables()


def _mixed(policy, mixing):
    """An MLP under a mixed-precision policy (its LossScaleOptimizer from compile() under mixed_float16), checked;
    ``mixing``: a forward pass that mixes the rows of a batch (a real difference TensorFlow and PyTorch make)."""
    import distkeras

    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(96, 16)).astype("float32"), rng.integers(0, 4, size=(96,))
        layers = [keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64, activation="relu")]
        if mixing:
            layers.append(keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True)))
        layers += [keras.layers.Dense(4), keras.layers.Activation("softmax", dtype="float32")]
        model = keras.Sequential(layers)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model = distkeras.distribute(model, 2, verify=True)
        try:
            model.fit(x, y, batch_size=48, epochs=1, verbose=0)
        except distkeras.VerifyError as error:
            return {"error": str(error)}
        check = model.__dict__["_distkeras_check"]
        return {"checked": check.checked, "found": [d.name for d in check.found], "tolerance": tuple(check.tolerance),
                "optimizer": type(model.optimizer).__name__}
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_raises_nothing_on_a_correct_run_and_still_catches_a_mixing_pass(policy):
    """Two replicas sum their rows in another order than one device, which in float16 moves gradients by ~5e-4
    relative (the float32 tolerance raised on TensorFlow, JAX and PyTorch); the tolerance follows the compute dtype
    (distkeras.verify.check.tolerance_for) and a forward pass that mixes rows is still caught."""
    got = replicated(2, _mixed, policy, False)
    assert "error" not in got, got.get("error")
    assert got["checked"] == 1 and got["found"] == []
    assert got["tolerance"][2] > 0  # the half-precision bound, read from the model's layers' compute dtype
    if policy == "mixed_float16":
        assert got["optimizer"] == "LossScaleOptimizer"
    if BACKEND == "jax":  # one program over the global batch: the mixing pass is one device's
        return
    caught = replicated(2, _mixed, policy, True)
    assert "error" in caught and "differ beyond" in caught["error"], caught
    assert "of each variable's largest value ({}".format(policy.split("_")[1]) in caught["error"]
