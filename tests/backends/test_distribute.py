"""The central contract, on whichever backend KERAS_BACKEND selects: data-parallel training on N devices
is single-device training at the same global batch, and a saved model is the plain single-device model.

Multi-device bodies live in ``scenarios`` and run through ``harness.replicated(devices, ...)``: in this
process for TensorFlow and JAX, on every rank of a ``devices``-process job for PyTorch (rank 0's result).
The assertions stay here and are the same on every backend."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, CPU_DEVICES, PROCESS_BACKENDS, keras, replicated  # noqa: F401 (skips if missing)
from tests.backends import scenarios
from tests.full import FULL

import distkeras

#: float32 SGD over a few steps: the replicas' partial sums are added in another order than one
#: device adds them, so weights agree to rounding, not bit for bit.
ATOL = 1e-5
RTOL = 1e-5


def assert_weights_close(expected, actual):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def single_device_runs():
    return {case: scenarios.train(case, 1) for case in scenarios.CASES}


@pytest.mark.parametrize("case", sorted(scenarios.CASES))
@pytest.mark.parametrize("devices", [2, 3])
def test_data_parallel_equals_single_device(single_device_runs, case, devices):
    expected_weights, expected_history = single_device_runs[case]
    weights, history = replicated(devices, scenarios.train, case, devices)
    assert_weights_close(expected_weights, weights)
    # The reported epoch loss is the global one, not one replica's.
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=1e-5)


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_gradients_train_close_to_uncompressed(single_device_runs, compression):
    """compression=: the gradients travel in 16 bits. bf16 keeps 8 significant bits (relative rounding up to
    2**-8 per gradient element), fp16 11: 18 SGD steps land close to exact training, not on it."""
    expected, expected_history = single_device_runs["uneven_tail"]
    weights, history = replicated(2, scenarios.train, "uneven_tail", 2, compression=compression)
    tolerance = {"bf16": 2e-2, "fp16": 3e-3}[compression]
    for e, a in zip(expected, weights):
        np.testing.assert_allclose(a, e, rtol=tolerance, atol=tolerance)
    difference = max(float(np.abs(e - a).max()) for e, a in zip(expected, weights))
    assert difference > 1e-7, "weights bit-equal to exact training: the gradients were not compressed"
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=tolerance)


def test_unknown_compression_is_refused_naming_the_valid_ones():
    with pytest.raises(distkeras.OptionError, match=r"Expected compression to be None, 'bf16' or 'fp16'\. "
                                                     r"Received: compression='int8'"):
        distkeras.distribute(scenarios.build(keras), devices=2, compression="int8")


def test_training_actually_moves_the_weights(single_device_runs):
    initial = scenarios.build(keras).get_weights()
    trained, _ = single_device_runs["even"]
    assert max(float(np.abs(a - b).max()) for a, b in zip(initial, trained)) > 1e-2


def test_no_sample_is_dropped_when_sizes_divide_by_nothing():
    # 101 samples, global batch 10, 3 replicas: 101 divides by neither 10 nor 3.
    fitted, evaluated, predicted_shape = replicated(3, scenarios.count_samples, 3)
    assert fitted == [101.0, 101.0]
    assert evaluated == 101.0
    assert predicted_shape == (101, 3)


def test_distributed_model_keeps_weights_and_compile_config():
    got = replicated(2, scenarios.compile_config, 2)
    assert got["dist_class"] is got["class"]
    assert_weights_close(got["weights"], got["dist_weights"])
    # The user's exact optimizer class (on the torch backend Keras' Adam() is a torch-specific subclass).
    assert got["dist_optimizer_class"] is got["optimizer_class"]
    assert issubclass(got["dist_optimizer_class"], keras.optimizers.Adam)
    assert got["learning_rate"] == pytest.approx(0.0123)
    assert got["beta_1"] == 0.8
    logs, expected = got["logs"], got["expected"]
    assert set(logs) == {"loss", "mae", "rmse"}
    for name in logs:  # same loss (Huber with delta 0.5, not the default 1.0) and same metrics
        assert logs[name] == pytest.approx(expected[name], rel=1e-5)


def test_uncompiled_model_can_be_compiled_after_distribute():
    kernel = replicated(2, scenarios.compile_after_distribute, 2)
    assert not np.allclose(kernel, 1.0)


def test_optimizer_state_carries_over():
    # Train 1 epoch on one device with momentum, then continue: distributed continuation == single.
    single, iterations, dist = replicated(2, scenarios.continue_training, 2)
    assert iterations == 8
    assert_weights_close(single, dist)


def test_one_device_returns_the_model_unchanged(capfd):
    model = scenarios.build(keras)
    assert distkeras.distribute(model, devices=1) is model
    assert "one device (cpu:0): the model is returned unchanged" in capfd.readouterr().err
    assert distkeras.describe(model)["distributed"] is False


def test_describe():
    assert replicated(2, scenarios.describe, ["cpu:0", "/device:CPU:2"]) == {
        "backend": BACKEND,
        "devices": ["cpu:0", "cpu:2"],
        "replicas": 2,
        "model_shards": 1,
        "rank": 0,
        "workers": 2 if BACKEND in PROCESS_BACKENDS else 1,  # the job's processes: on torch one per device
        "distributed": True,
        "shard": None,
    }


def test_global_batch_size():
    of_model, of_two, of_all = replicated(3, scenarios.global_batch_sizes, 3)
    assert of_model == 96
    assert of_two == 64
    assert of_all == 16 * CPU_DEVICES


_RELOAD = """
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
plain.load_weights(sys.argv[2])
x = np.load(sys.argv[3])
np.save(sys.argv[4], model.predict(x, verbose=0))
np.save(sys.argv[5], plain.predict(x, verbose=0))
print(json.dumps({"distkeras": "distkeras" in sys.modules, "class": type(model).__name__,
                  "layers": [type(l).__name__ for l in model.layers]}))
"""


#: The backend each backend's saved model is loaded in by default: a cycle, so every backend loads another's model
#: and has its own loaded by another. The full run (DISTKERAS_FULL_TESTS=1) loads each in every backend.
RELOAD_IN = {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}


@pytest.mark.parametrize("reload_backend", ["same", "tensorflow", "jax", "torch"])
def test_saved_model_loads_in_plain_keras_without_distkeras(tmp_path, reload_backend):
    target = BACKEND if reload_backend == "same" else reload_backend
    if reload_backend == BACKEND:
        pytest.skip("the same test as 'same'")
    if target not in (BACKEND, RELOAD_IN.get(BACKEND)) and not FULL:
        pytest.skip("full run only (DISTKERAS_FULL_TESTS=1): by default a {} model is reloaded in {} and {}'s own "
                    "suite reloads a model saved elsewhere".format(BACKEND, RELOAD_IN.get(BACKEND), target))
    from distkeras import backends

    if not backends.is_installed({"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[target]):
        pytest.skip("{} is not installed".format(target))
    expected = replicated(2, scenarios.fit_and_save, 2, str(tmp_path))
    x, _ = scenarios.data(36)
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND=target, PYTHONPATH="")
    done = subprocess.run(
        [sys.executable, "-c", _RELOAD, str(tmp_path / "m.keras"), str(tmp_path / "m.weights.h5"),
         str(tmp_path / "x.npy"), str(tmp_path / "p1.npy"), str(tmp_path / "p2.npy")],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"distkeras": False, "class": "Sequential", "layers": ["Dense", "Dense"]}
    np.testing.assert_allclose(np.load(tmp_path / "p1.npy"), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "p2.npy"), expected, rtol=1e-5, atol=1e-6)


def test_save_load_distribute_rounds_never_nest(tmp_path):
    for layers, weights in replicated(2, scenarios.save_load_rounds, 2, str(tmp_path)):
        assert layers == ["Dense", "Dense"]
        assert weights == 4
    assert os.path.getsize(tmp_path / "round2.keras") <= os.path.getsize(tmp_path / "round0.keras") * 1.05


def test_a_save_that_fails_half_way_leaves_the_previous_file_and_nothing_else(tmp_path):
    # Plain Keras opens the target first: its save() failing half-way leaves a truncated file. A distributed model's
    # rank 0 writes a temporary file and renames it; on PyTorch, rank 1's throwaway copy meets the same error.
    errors, kept, files = replicated(2, scenarios.interrupted_saves, 2, str(tmp_path))
    assert errors == ["failed half-way", "failed half-way"]
    assert kept == [True, True]
    assert files == ["m.keras", "m.weights.h5"]  # no temporary file; the other ranks wrote nothing here


# ---- bad input: a clear error that names what was asked, what exists and what to do


def test_device_that_is_not_there():
    with pytest.raises(distkeras.DeviceSpecError, match=r"You requested cpu:7; this machine has: cpu:0, cpu:1, cpu:2"):
        distkeras.distribute(scenarios.build(keras), devices=["cpu:7"])


def test_more_devices_than_exist():
    with pytest.raises(distkeras.DeviceSpecError, match="You requested 9 devices; this machine has 3"):
        distkeras.distribute(scenarios.build(keras), devices=9)


@pytest.mark.parametrize("devices", [0, -2, []])
def test_no_devices(devices):
    with pytest.raises(distkeras.DeviceSpecError, match="Received: devices="):
        distkeras.distribute(scenarios.build(keras), devices=devices)


def test_duplicate_devices():
    with pytest.raises(distkeras.DeviceSpecError, match="duplicates: cpu:1"):
        distkeras.distribute(scenarios.build(keras), devices=["cpu:1", "CPU:1"])


def test_unknown_option_names_the_known_ones():
    with pytest.raises(distkeras.OptionError, match=r"Unknown option\(s\) num_quantisation_bits for the {}".format(BACKEND)):
        distkeras.distribute(scenarios.build(keras), devices=2, num_quantisation_bits=8)


def test_a_misspelt_option_says_did_you_mean():
    with pytest.raises(distkeras.OptionError) as info:
        distkeras.distribute(scenarios.build(keras), devices=2, compresion="bf16")
    message = str(info.value)
    assert message.startswith("compresion: did you mean 'compression'? The {} backend's options: ".format(BACKEND))
    assert len(message) < 700, message


@pytest.mark.parametrize("wrapped", [False, True], ids=["unbuilt", "wrapper"])
def test_unbuilt_model_is_distributed_when_it_builds(wrapped):
    expected_weights, expected_history, _ = scenarios.train_unbuilt(1, wrapped)
    weights, history, replicas = replicated(2, scenarios.train_unbuilt, 2, wrapped)
    assert replicas == (2, 2)
    assert_weights_close(expected_weights, weights)
    for key, values in expected_history.items():
        np.testing.assert_allclose(history[key], values, rtol=RTOL, atol=ATOL, err_msg=key)


def test_not_a_model():
    with pytest.raises(distkeras.ModelError, match="Expected a Keras model"):
        distkeras.distribute(object(), devices=2)


def test_a_layer_is_refused_at_distribute():
    # It used to fail later, in fit(), with "AttributeError: 'Dense' object has no attribute 'compute_loss'".
    import keras

    for devices in (2, 1):
        with pytest.raises(distkeras.ModelTypeError, match=r"Received: .* of type Dense, a Keras layer, not a model") as info:
            distkeras.distribute(keras.layers.Dense(2), devices=devices)
        assert isinstance(info.value, TypeError) and "keras.Sequential([keras.Input(shape=...), layer])" in str(info.value)


def test_use_cpu_devices_after_start_is_too_late():
    error = replicated(2, scenarios.cpu_devices_after_start, 2, CPU_DEVICES + 2)
    assert isinstance(error, distkeras.TooLateError)
    assert re.search("before building any model", str(error))
