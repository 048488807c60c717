"""The real-code suite: official Keras examples and guides (``realcode.py``), run with the one added line
``distribute(model, devices)`` at N=2 and N=3, train, evaluate and predict what they do on one device.

Each case compares with the one-device run at the same global batch, from the same initial weights, on
the same data: every weight (``test_compat.assert_same_training``, History included), every variable of
every optimizer the model holds, evaluate()'s results and predict()'s output, to float tolerance; and N
replicas really ran, as the framework reports it (``patterns.replicas_seen``). On PyTorch each program
runs on every rank of a worker job (``harness.replicated``), rank 0's result compared.

The default run takes each program at one of N=2 and N=3, in turn; the full run (DISTKERAS_FULL_TESTS=1) at both.

``test_suite_catches_a_perturbed_run`` shows the comparison can fail: one training sample altered on the
distributed run only must make it raise.
"""

import re

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)
from tests.backends import realcode
from tests.backends.test_compat import assert_same_training
from tests.full import FULL, alternating

_single = {}


def single_device(name):
    if name not in _single:
        _single[name] = realcode.run(name, 1)
    return _single[name]


def assert_same_results(expected, got, atol):
    """Distributed ``got`` equals one-device ``expected``: weights, History, optimizer state, evaluate, predict."""
    assert_same_training(expected, got, atol)
    def plain(path):  # auto-names are numbered per process: "adam_3/dense_2_kernel_momentum" is "adam/dense_kernel_momentum"
        return re.sub(r"_\d+(?=[/_]|$)", "", path)

    assert [plain(p) for p in got["optimizer_paths"]] == [plain(p) for p in expected["optimizer_paths"]]
    for path, e, g in zip(expected["optimizer_paths"], expected["optimizer"], got["optimizer"]):
        np.testing.assert_allclose(g, e, rtol=atol, atol=atol, err_msg=path)
    for key in ("evaluate", "predict"):
        assert (got[key] is None) == (expected[key] is None), key
    if expected["evaluate"] is not None:
        assert set(got["evaluate"]) == set(expected["evaluate"])
        for key, value in expected["evaluate"].items():
            np.testing.assert_allclose(got["evaluate"][key], value, rtol=max(atol, 1e-5), atol=max(atol, 1e-6),
                                       err_msg="evaluate " + key)
    if expected["predict"] is not None:
        assert got["predict"].shape == expected["predict"].shape
        np.testing.assert_allclose(got["predict"], expected["predict"], rtol=atol, atol=atol, err_msg="predict")
    for key in ("saved_weights", "best_weights"):  # the callbacks program's checkpoints
        if key in expected:
            assert key in got, "the distributed run wrote no checkpoint to read back"
            assert len(got[key]) == len(expected[key]), key
            for e, g in zip(expected[key], got[key]):
                np.testing.assert_allclose(g, e, rtol=atol, atol=atol, err_msg=key)
    if "saved_class" in expected:
        assert got["saved_class"] == expected["saved_class"]


@pytest.mark.parametrize("name, devices", alternating(realcode.PROGRAMS))
def test_program_runs_as_on_one_device(name, devices):
    if name == "gan" and BACKEND == "jax" and not FULL:
        pytest.skip("full run only on JAX (DISTKERAS_FULL_TESTS=1): its convolutions cost 30 s to compile there; "
                    "test_jax's test_a_gan_with_optimizers_of_its_own_equals_one_device[3-True] trains a GAN of two "
                    "optimizers on JAX by default")
    _, atol = realcode.PROGRAMS[name]
    expected = single_device(name)
    got = replicated(devices, realcode.run, name, devices)
    assert got["replicas"] == (devices, devices)
    assert_same_results(expected, got, atol)


@pytest.mark.skipif(not FULL and BACKEND != "tensorflow", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): it checks the comparison (the same code on every backend); the default "
    "run checks it on TensorFlow"))
def test_suite_catches_a_perturbed_run():
    """One training sample altered on the distributed run only: the comparison must raise."""
    name = "callbacks"
    _, atol = realcode.PROGRAMS[name]
    expected = single_device(name)
    got = replicated(2, realcode.run, name, 2, perturb=True)
    assert got["replicas"] == (2, 2)
    with pytest.raises(AssertionError):
        assert_same_results(expected, got, atol)
    unperturbed = realcode.run(name, 1, perturb=True)  # the hook leaves one-device runs alone
    assert_same_results(expected, unperturbed, atol)
