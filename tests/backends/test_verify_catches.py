"""The one-device check catches issue 34's defects with their fixes reverted, and stays quiet with them in.

Each test reverts one fix in this process (or in the PyTorch job's workers) and trains the program that showed
the defect with ``verify=True``: the check must raise :class:`distkeras.VerifyError` naming what differs. With the
fix in, the same program trains with the check on and nothing raised.

- 1, trainable flag (TensorFlow): the mirrored storage takes Keras' flag at ``distribute()`` time again.
- 3, ``tf.random`` in a custom ``train_step`` (TensorFlow): every replica draws as asked, for its own rows.
- 4, per-batch logs (PyTorch): each rank's step returns its own running values.
- 5, a forward pass that mixes the rows of a batch: ``test_verify.py::test_catches_a_batch_mixing_forward_pass``.

What the check can't see, by its design (it replays the step that ran, on the batch that ran): 2 (the order a
shuffling pipeline gives: the batch trained on is the check's batch), 6 (a hand-written loop calls no ``fit()``:
``LoopError`` and the one-time warnings are its check), 7 (saves, one-rank ``predict()`` and unseeded JAX
processes are no training step: ``test_multiprocess_basics.py``).
"""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated

import distkeras


def _verified(monkeypatch):
    monkeypatch.setenv("DISTKERAS_VERIFY", "1")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the trainable-flag defect was TensorFlow's")
@pytest.mark.parametrize("reverted", [False, True], ids=["fixed", "reverted"])
def test_defect_1_trainable_flag(monkeypatch, reverted):
    from distkeras.backends.tensorflow import mirror
    from tests.backends.test_tensorflow_round2 import _fine_tune

    _verified(monkeypatch)
    if reverted:
        monkeypatch.setattr(mirror, "_storage_trainable", lambda storage, flag: flag)
        with pytest.raises(distkeras.VerifyError, match=r"weight base/dense.*/kernel"):
            _fine_tune(2)
    else:
        _fine_tune(2)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the trainable-flag defect was TensorFlow's")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_defect_1_reverted_is_caught_under_mixed_precision(monkeypatch, policy):
    """The check's tolerance follows the compute dtype (verify.tolerance_for) and still catches a real defect."""
    from distkeras.backends.tensorflow import mirror
    from tests.backends.test_tensorflow_round2 import _fine_tune

    _verified(monkeypatch)
    keras.config.set_dtype_policy(policy)
    try:
        _fine_tune(2)  # fixed: quiet
        monkeypatch.setattr(mirror, "_storage_trainable", lambda storage, flag: flag)
        with pytest.raises(distkeras.VerifyError, match=r"weight base/dense"):
            _fine_tune(2)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's own random ops")
@pytest.mark.parametrize("reverted", [False, True], ids=["fixed", "reverted"])
def test_defect_3_tf_random_in_a_custom_step(monkeypatch, reverted):
    from distkeras.backends.tensorflow import steps
    from tests.backends.test_tensorflow_round2 import _train_wgan

    _verified(monkeypatch)
    if reverted:  # the patched tf.random functions draw as asked: each replica its own rows' shape
        monkeypatch.setattr(steps, "_plan", lambda tf, rows, shape: None)
        with pytest.raises(distkeras.VerifyError, match="differ beyond"):
            _train_wgan(2, "stateless")
    else:
        _train_wgan(2, "stateless")


def _classifier():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def logs_with_local_values(devices, reverted):
    """On every rank of a PyTorch job: fit() with the check on, each rank's own step logs where ``reverted``;
    the check's error, or None."""
    from distkeras.backends.torch import trainer

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.integers(0, 3, size=(24,))
    real = trainer._global_logs
    if reverted:
        trainer._global_logs = lambda model, local_logs, replica: (lambda logs: logs)
    try:
        model = distkeras.distribute(_classifier(), devices, verify=True)
        model.fit(x, y, batch_size=12, epochs=1, verbose=0, shuffle=False)
    except distkeras.VerifyError as error:
        return str(error)
    finally:
        trainer._global_logs = real
    return None


@pytest.mark.skipif(BACKEND != "torch", reason="the per-batch logs defect was PyTorch's")
def test_defect_4_per_batch_logs():
    assert replicated(2, logs_with_local_values, 2, False) is None
    error = replicated(2, logs_with_local_values, 2, True)
    assert error is not None and "log loss" in error, error
