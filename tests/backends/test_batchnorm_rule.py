"""One BatchNormalization rule on every backend (distkeras.backends.batchnorm): which layers are synchronized,
what happens to subclasses, and the warning for the ones left alone. The same expectations, run once per
live Keras backend; the bodies run where the backend keeps its replicas (``harness.replicated``)."""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if missing)
from tests.backends import batchnorm_cases as cases

import distkeras
from distkeras.backends import batchnorm

#: The options under which the rule is in force: JAX's uncompressed step is one program over the global batch,
#: so only its compressed step (per-shard gradients inside shard_map) selects layers.
RULED = {"tensorflow": {}, "torch": {}, "jax": {"compression": "bf16"}}[BACKEND]
#: Where the option exists.
HAS_OPTION = BACKEND in ("tensorflow", "torch")


def close(expected, actual, tol=1e-5):
    return len(expected) == len(actual) and all(np.allclose(e, a, rtol=tol, atol=tol) for e, a in zip(expected, actual))


def gap(expected, actual):
    return max(float(np.abs(e - a).max()) for e, a in zip(expected, actual))


# ---- the rule itself, on this backend's Keras (no replicas needed)


def test_the_rule_selects_by_whose_moments_the_class_runs():
    net = cases.model(("keras", "configured", "wrapped", "own", "inherits"))
    selection = batchnorm.select(net)
    assert sorted(layer.name for layer in selection.synchronized) == ["configured_norm", "keras_norm", "wrapped_norm"]
    assert sorted((layer.name, reason) for layer, reason in selection.left) == [
        ("inherits_norm", batchnorm.OWN_MOMENTS), ("own_norm", batchnorm.OWN_MOMENTS)]
    _, _, own, _ = cases.classes()
    assert [batchnorm.own_moments(layer) for layer, _ in sorted(selection.left, key=lambda p: p[0].name)] == [own, own]
    everything = batchnorm.select(net, "all")
    assert len(everything.synchronized) == 5 and everything.left == []
    nothing = batchnorm.select(net, False)
    assert nothing.synchronized == [] and {reason for _, reason in nothing.left} == {batchnorm.NOT_ASKED}
    assert len(nothing.left) == 5


def test_the_warning_names_each_layer_left_alone_with_the_class_that_defines_its_moments_and_the_way_out():
    text = batchnorm.left_message(batchnorm.select(cases.model(("configured", "own", "inherits"))))
    assert text.startswith("BatchNormalization layer(s) 'own_norm' (OwnMoments._moments), 'inherits_norm' "
                           "(OwnMoments._moments) compute their batch statistics in a _moments of their own, which "
                           "distkeras leaves as it is: in training each replica normalizes them with the statistics "
                           "of its own share of the batch")
    assert "sync_batchnorm='all'" in text and "sync_batchnorm=False" in text
    assert batchnorm.left_message(batchnorm.select(cases.model(("configured", "wrapped")))) is None


@pytest.mark.parametrize("value", ["yes", 1, None, "All"])
def test_sync_batchnorm_is_true_false_or_all(value):
    with pytest.raises(distkeras.OptionError, match=r"Expected sync_batchnorm to be True, False or 'all'\. Received"):
        batchnorm.check_option(value)


@pytest.mark.parametrize("masked", [False, True])
def test_the_one_formula_is_keras_moments_on_one_replica(masked):
    """global_moments over one replica (the gather returns the row alone) is Keras' own _moments, masked or not."""
    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(rng.normal(size=(6, 4, 3)).astype("float32"))
    mask = keras.ops.convert_to_tensor(rng.random((6, 4)) > 0.3) if masked else None
    layer = keras.layers.BatchNormalization()
    layer.build((6, 4, 3))
    want = layer._moments(x, mask)
    got = batchnorm.global_moments(keras.ops, x, layer._reduction_axes, mask, lambda row: keras.ops.expand_dims(row, 0),
                                   keras.backend.epsilon())
    for w, g in zip(want, got):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(g), keras.ops.convert_to_numpy(w), rtol=1e-5, atol=1e-6)


def test_the_formula_over_replicas_is_the_whole_batchs_and_an_empty_replica_counts_for_nothing():
    rng = np.random.default_rng(1)
    whole = rng.normal(size=(7, 3)).astype("float32")
    parts = [whole[:3], whole[3:7], whole[7:]]  # the last replica has no rows
    rows = []

    def local(row):
        rows.append(keras.ops.convert_to_numpy(row))
        return keras.ops.expand_dims(row, 0)

    for part in parts:
        batchnorm.global_moments(keras.ops, keras.ops.convert_to_tensor(part), [0], None, local)
    table = keras.ops.convert_to_tensor(np.stack(rows))
    mean, variance = batchnorm.global_moments(keras.ops, keras.ops.convert_to_tensor(parts[0]), [0], None, lambda row: table)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(mean), whole.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variance), whole.var(axis=0), rtol=1e-5, atol=1e-6)
    assert np.isfinite(rows[2]).all() and not rows[2][0].any()


# ---- the rule in distribute()


@pytest.fixture(scope="module")
def single():
    return {norms: cases.train(norms, 1) for norms in [("configured",), ("wrapped",), ("own",)]}


@pytest.mark.parametrize("norms", [("configured",), ("wrapped",)])
def test_a_subclass_that_runs_keras_moments_is_synchronized(single, norms):
    got = replicated(2, cases.train, norms, 2, **RULED)
    assert got["hooked"] == [norms[0] + "_norm"] and got["warnings"] == []
    if BACKEND == "jax":  # compression: the gradients travel in bf16, close to exact
        assert close(single[norms]["weights"], got["weights"], tol=2e-2)
        return
    assert close(single[norms]["weights"], got["weights"])
    off = replicated(2, cases.train, norms, 2, sync_batchnorm=False)
    assert off["hooked"] == ([norms[0] + "_norm"] if BACKEND == "tensorflow" else [])  # TF: per replica, NaN-safe
    assert gap(single[norms]["weights"], off["weights"]) > 1e-3  # per-replica statistics: not one device


def test_a_subclass_with_its_own_moments_is_left_alone_with_one_warning():
    got = replicated(2, cases.train, ("configured", "own"), 2, **RULED)
    assert got["hooked"] == ["configured_norm"] and got["own_ran"]
    assert len(got["warnings"]) == 1
    assert got["warnings"][0].startswith("BatchNormalization layer(s) 'own_norm' (OwnMoments._moments) compute their "
                                         "batch statistics in a _moments of their own, which distkeras leaves as it is")
    if BACKEND == "jax":
        assert "drop compression=" in got["warnings"][0]
    else:
        assert "sync_batchnorm='all'" in got["warnings"][0] and "sync_batchnorm=False" in got["warnings"][0]


@pytest.mark.skipif(not HAS_OPTION, reason="JAX has no sync_batchnorm option")
def test_all_replaces_an_override_and_false_silences_the_warning(single):
    everything = replicated(2, cases.train, ("own",), 2, sync_batchnorm="all")
    assert everything["hooked"] == ["own_norm"] and everything["warnings"] == [] and not everything["own_ran"]
    assert close(single[("own",)]["weights"], everything["weights"])  # Keras' formula over the global batch
    off = replicated(2, cases.train, ("own",), 2, sync_batchnorm=False)
    assert off["warnings"] == [] and off["own_ran"] and off["hooked"] == []


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's uncompressed step only")
def test_on_jax_without_compression_every_layer_sees_the_global_batch(single):
    got = replicated(2, cases.train, ("own",), 2)
    assert got["hooked"] == [] and got["warnings"] == [] and got["own_ran"]
    assert close(single[("own",)]["weights"], got["weights"])


def test_a_second_distribute_applies_its_own_choice():
    if not HAS_OPTION:
        pytest.skip("JAX has no sync_batchnorm option")
    got = replicated(2, cases.redistributed)
    assert got == {"first": ["own_norm"], "second": []}



def test_masked_inputs_are_synchronized_too():
    """A mask weighs the statistics (Keras' masked formula, epsilon included) over the global batch."""
    expected = cases.train_masked(1)
    got = replicated(2, cases.train_masked, 2, **RULED)
    assert close(expected, got, tol=2e-2 if BACKEND == "jax" else 1e-5)
    if HAS_OPTION:
        assert gap(expected, replicated(2, cases.train_masked, 2, sync_batchnorm=False)) > 1e-3
