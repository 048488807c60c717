"""The compatibility suite: common Keras usage patterns through ``distribute(devices=2)`` and ``3`` train
what one device trains at the same global batch, on whichever backend KERAS_BACKEND selects.

Each case asserts: the weights (every one, optimizer-free) equal single-device training; the History
equals it; the weights moved; the model distkeras returned is the user's own object (checked in
``patterns.run``); and N replicas really ran, as the framework itself reports it (not ``describe()``).
Patterns live in ``patterns.py``; on PyTorch they run on every rank of a worker job (rank 0's result).
The default run takes each pattern at one of N=2 and N=3, in turn (both counts run, on different patterns); the
full run (DISTKERAS_FULL_TESTS=1, ``tests/full.py``) takes every pattern at both.
"""

import re

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)
from tests.backends import patterns
from tests.full import alternating

_single = {}


def single_device(name):
    if name not in _single:
        _single[name] = patterns.run(name, 1)
    return _single[name]


def assert_same_training(expected, got, atol):
    def plain(path):  # Keras numbers auto-named layers per process: "dense_3" in one run is "dense" in another
        return re.sub(r"_\d+(?=/|$)", "", path)

    assert [plain(p) for p in got["paths"]] == [plain(p) for p in expected["paths"]]
    for path, e, g in zip(expected["paths"], expected["weights"], got["weights"]):
        np.testing.assert_allclose(g, e, rtol=atol, atol=atol, err_msg=path)
    assert set(got["history"]) == set(expected["history"])
    for key, values in expected["history"].items():
        np.testing.assert_allclose(got["history"][key], values, rtol=max(atol, 1e-5), atol=max(atol, 1e-6), err_msg=key)


@pytest.mark.parametrize("name, devices", alternating(patterns.names(BACKEND)))
def test_pattern_trains_as_on_one_device(name, devices):
    _, atol = patterns.PATTERNS[name]
    expected = single_device(name)
    got = replicated(devices, patterns.run, name, devices)
    assert_same_training(expected, got, atol)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(expected["initial"], got["weights"]))
    assert moved > 10 * atol, "the weights did not move: the test could not tell training from none"
    assert got["replicas"] == (devices, devices)


def _refusal(name, devices):
    """distribute()'s ModelError for pattern ``name``, as text; None where it trains."""
    import distkeras

    build, _ = patterns.PATTERNS[name]
    keras.utils.set_random_seed(0)
    model = build(keras)[0]
    try:
        distkeras.distribute(model, devices=devices)
    except distkeras.ModelError as error:
        return str(error)
    return None


@pytest.mark.skipif(BACKEND not in patterns.NOT_ON["stateful_lstm"], reason="{} trains a stateful RNN as one device "
                    "(test_pattern_trains_as_on_one_device[stateful_lstm-N])".format(BACKEND))
def test_a_stateful_rnn_is_refused_where_replicas_cut_the_batch():
    """Keras itself would fail inside fit() with "Expected batch size: 12 - Received batch size: 6", a batch size
    the user never gave: distribute() says which layer, why, and what to do instead."""
    message = replicated(2, _refusal, "stateful_lstm", 2)
    assert message is not None, "a stateful LSTM was distributed over 2 replicas that each run half of its batch"
    assert "LSTM 'stateful_lstm' is stateful" in message and "each of the 2" in message, message
    assert "stateful=False" in message and "KERAS_BACKEND=jax" in message, message
