"""JAX-only behaviour: where variables and batches really live on the mesh, model parallelism, the JAX
options and the CPU device split."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras  # noqa: F401 (skips if missing)

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="JAX adapter tests; KERAS_BACKEND={}".format(BACKEND))

from tests.backends import scenarios  # noqa: E402
from tests.backends.test_distribute import ATOL, RTOL, assert_weights_close  # noqa: E402
from tests.full import only_in_full  # noqa: E402

import distkeras  # noqa: E402
from distkeras import backends  # noqa: E402

FLAG = "--xla_force_host_platform_device_count"


class Probe(keras.layers.Layer):
    """Records how each batch that reaches it in a compiled step is laid out: (rows, sharding spec)."""

    seen = []

    def call(self, x):
        import jax

        jax.debug.inspect_array_sharding(x, callback=lambda s: Probe.seen.append((x.shape[0], tuple(s.spec))))
        return x


def probed_model():
    Probe.seen.clear()
    model = keras.Sequential([keras.Input((5,)), Probe(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def jax_devices(names):
    import jax

    return {jax.devices("cpu")[int(n.split(":")[1])] for n in names}


def shards(variable):
    """{device: shard shape} of a variable's value."""
    return {s.device: s.data.shape for s in variable.value.addressable_shards}


# ---- data parallel: where things live


def test_data_parallel_keeps_a_full_replica_of_every_variable_on_every_device():
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", metrics=["mae"])
    dist = distkeras.distribute(model, devices=["cpu:0", "cpu:2"])
    x, y = scenarios.data(24)
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)
    mesh = jax_devices(["cpu:0", "cpu:2"])
    state = dist.weights + dist.optimizer.variables + dist.metrics_variables
    assert len(dist.optimizer.variables) > 2 and len(dist.metrics_variables) >= 4  # momenta, loss and mae totals
    for v in state:
        assert shards(v) == {d: tuple(v.shape) for d in mesh}, v.path


def test_batches_are_split_over_the_devices_in_fit_evaluate_and_predict():
    dist = distkeras.distribute(probed_model(), devices=3)
    x, y = scenarios.data(30)  # batches of 12, 12 and 6: all divide by 3
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)
    dist.evaluate(x, y, batch_size=12, verbose=0)
    dist.predict(x, batch_size=12, verbose=0)
    dist.train_on_batch(x[:6], y[:6])
    assert Probe.seen and all(spec[:1] == ("batch",) for _, spec in Probe.seen), Probe.seen
    assert {size for size, _ in Probe.seen} == {12, 6}


def test_a_batch_the_devices_dont_divide_runs_whole_on_each_and_matches_one_device(caplog):
    dist = distkeras.distribute(probed_model(), devices=3)
    single = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    single.set_weights(dist.get_weights())
    single.compile(optimizer="sgd", loss="mse")
    x, y = scenarios.data(28)  # batches of 12, 12 and 4
    history = dist.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0).history
    expected = single.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0).history
    assert_weights_close(single.get_weights(), dist.get_weights())
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=RTOL)
    assert {(size, spec[:1] == ("batch",)) for size, spec in Probe.seen} == {(12, True), (4, False)}
    assert "a batch of 4 samples doesn't split evenly over 3 devices" in caplog.text
    np.testing.assert_allclose(dist.predict(x, batch_size=12, verbose=0), single.predict(x, verbose=0), rtol=RTOL, atol=ATOL)
    logs = dist.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(single.evaluate(x, y, batch_size=12, verbose=0), rel=RTOL)


class Placed:
    """Spies on the function Keras' JAX trainer places every batch with: (rows, sharding spec) of each x."""

    def __init__(self, monkeypatch):
        from keras.src.backend.jax import trainer

        self.seen, placed = [], trainer._distribute_data

        def spy(data, layouts=None):
            out = placed(data, layouts)
            first = keras.tree.flatten(out)[0]
            self.seen.append((first.shape[0], tuple(first.sharding.spec)[:1]))
            return out

        monkeypatch.setattr(trainer, "_distribute_data", spy)


def _uneven_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.3),
                              keras.layers.GaussianNoise(0.1), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae", keras.metrics.R2Score()],
                  weighted_metrics=["mse"])
    return model


@pytest.mark.parametrize("batch_size, weighted", [(4, False), (2, True)])
def test_uneven_batches_are_padded_split_and_equal_one_device(monkeypatch, caplog, batch_size, weighted):
    """10 rows in batches of 4 (4, 4, 2) or 2 on 3 devices: every batch is padded to a multiple of 3 and split,
    and fit (Dropout and GaussianNoise drawing, sample weights or none, metrics weighted and not, validation on 5
    rows), evaluate and predict give one device's numbers: weights, Adam's slots, History, predictions."""
    x, y = scenarios.data(10)
    weights = np.linspace(0.5, 2.0, 10).astype("float32") if weighted else None
    single = _uneven_model()
    expected = single.fit(x, y, sample_weight=weights, batch_size=batch_size, epochs=2, shuffle=False,
                          verbose=0, validation_data=(x[:5], y[:5])).history
    dist = distkeras.distribute(_uneven_model(), devices=3)
    placed = Placed(monkeypatch)
    history = dist.fit(x, y, sample_weight=weights, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                       validation_data=(x[:5], y[:5])).history
    assert_weights_close(single.get_weights(), dist.get_weights())
    assert_weights_close([keras.ops.convert_to_numpy(v) for v in single.optimizer.variables],
                         [keras.ops.convert_to_numpy(v) for v in dist.optimizer.variables])
    assert history.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=RTOL, atol=ATOL, err_msg=key)
    logs = dist.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0, return_dict=True)
    want = single.evaluate(x, y, sample_weight=weights, batch_size=batch_size, verbose=0, return_dict=True)
    for key in want:
        assert logs[key] == pytest.approx(want[key], rel=RTOL, abs=ATOL), key
    predicted = dist.predict(x, batch_size=batch_size, verbose=0)
    assert predicted.shape == (10, 3)
    np.testing.assert_allclose(predicted, single.predict(x, batch_size=batch_size, verbose=0), rtol=RTOL, atol=ATOL)
    padded = {4: {6, 3}, 2: {3}}[batch_size]  # 4 -> 6 and 2 -> 3 rows, one per device
    assert {rows for rows, _ in placed.seen} == padded and all(spec == ("batch",) for _, spec in placed.seen), placed.seen
    assert "doesn't split evenly" not in caplog.text


@pytest.mark.parametrize("loss, metric", [
    (keras.losses.MeanAbsoluteError(reduction="mean"), "mse"),
    (keras.losses.MeanAbsoluteError(reduction="mean_with_sample_weight"), "mse"),
    ("sparse_categorical_crossentropy", "accuracy"),
])
def test_padded_batches_equal_one_device_for_each_allowed_loss_reduction(monkeypatch, loss, metric):
    x, y = scenarios.data(10)
    weights = np.linspace(0.5, 2.0, 10)  # float64: placed as float32
    if metric == "accuracy":
        y = np.arange(10) % 3

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=[metric], weighted_metrics=[metric])
        return model

    single = build()
    expected = single.fit(x, y, sample_weight=weights, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    dist = distkeras.distribute(build(), devices=3)
    placed = Placed(monkeypatch)
    history = dist.fit(x, y, sample_weight=weights, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert {rows for rows, _ in placed.seen} == {6, 3}  # 4 and 2 rows, padded to 6 and 3
    assert_weights_close(single.get_weights(), dist.get_weights())
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_a_batch_smaller_than_the_device_count_is_padded_in_predict():
    dist = distkeras.distribute(probed_model(), devices=3)  # Probe is a layer of its own: fit keeps the fallback
    x, _ = scenarios.data(7)
    single = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    single.set_weights(dist.get_weights())
    np.testing.assert_allclose(dist.predict(x, batch_size=5, verbose=0), single.predict(x, verbose=0), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(dist.predict(x[:1], verbose=0), single.predict(x[:1], verbose=0), rtol=RTOL, atol=ATOL)
    assert {size for size, _ in Probe.seen} == {6, 3} and all(spec[:1] == ("batch",) for _, spec in Probe.seen)


class OwnLayer(keras.layers.Layer):
    def call(self, x):
        return x


@pytest.mark.parametrize("case, why", [
    ("batchnorm", "normalises by the statistics of the batch in training"),
    ("sum", "its loss reduction is 'sum'"),
    ("own_layer", "OwnLayer is your own class"),
    ("mask", "makes a mask"),
    ("activity", "activity regularization"),
])
def test_uneven_batches_keep_the_whole_batch_fallback_where_padding_is_not_proven_exact(caplog, case, why):
    keras.utils.set_random_seed(0)

    def build():
        keras.utils.set_random_seed(0)
        middle = {"batchnorm": keras.layers.BatchNormalization(), "own_layer": OwnLayer(),
                  "mask": keras.layers.Masking(), "activity": keras.layers.Dense(8, activity_regularizer="l2")}
        layers = [keras.Input((5,)), keras.layers.Dense(8)] + ([middle[case]] if case in middle else [])
        model = keras.Sequential(layers + [keras.layers.Dense(3)])
        loss = keras.losses.MeanSquaredError(reduction="sum") if case == "sum" else "mse"
        model.compile(optimizer="sgd", loss=loss, metrics=["mae"])
        return model

    x, y = scenarios.data(10)
    single = build()
    expected = single.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    dist = distkeras.distribute(build(), devices=3)
    history = dist.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    assert why in caplog.text and "runs whole on every device" in caplog.text
    assert_weights_close(single.get_weights(), dist.get_weights())
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=RTOL, atol=ATOL)


def test_negative_sample_weights_are_refused_while_padding():
    dist = distkeras.distribute(_uneven_model(), devices=3)
    x, y = scenarios.data(10)
    with pytest.raises(distkeras.DistKerasError, match="A sample weight is negative.*non-negative"):
        dist.fit(x, y, sample_weight=-np.ones(10, "float32"), batch_size=4, verbose=0)


def test_private_api_pin_uneven_padding():
    """jax_uneven.py reaches into: the trainer module's ``_distribute_data(data, layouts=None)`` (looked up per
    call), the compiled loss' ``_flat_losses`` entries' ``loss``, the compiled metrics' ``_flat_metrics`` and
    ``_flat_weighted_metrics`` groups (their ``metrics`` and ``update_state``), the model's ``_loss_tracker``
    and what makes ``_symbolic_build`` draw a batch."""
    import inspect

    from keras.src.backend.jax import trainer
    from keras.src.trainers import compile_utils
    from keras.src.trainers.trainer import Trainer

    assert list(inspect.signature(trainer._distribute_data).parameters) == ["data", "layouts"]
    assert "_distribute_data(data, layouts)" in inspect.getsource(trainer.JAXEpochIterator._get_distributed_iterator)
    assert compile_utils.CompileLoss.Loss._fields[1] == "loss"
    model = distkeras.distribute(_uneven_model(), devices=3)
    assert getattr(trainer._distribute_data, "distkeras", False)  # wrapped, and looked up per call
    model.fit(*scenarios.data(6), batch_size=6, verbose=0)
    assert model._compile_loss._flat_losses[0].loss.reduction == "sum_over_batch_size"
    groups = model._compile_metrics._flat_metrics + model._compile_metrics._flat_weighted_metrics
    assert all(hasattr(g, "metrics") and "sample_weight" in inspect.signature(g.update_state).parameters for g in groups)
    assert isinstance(model._loss_tracker, keras.metrics.Mean)
    source = inspect.getsource(Trainer._symbolic_build)
    assert "self._compile_metrics.built" in source and "self._compile_loss.built" in source


def test_batch_statistics_are_those_of_the_global_batch():
    # One SPMD program over the global batch: BatchNormalization normalises by the whole batch's moments
    # (and updates its moving ones) exactly as one device does, even on a batch that runs replicated.
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = scenarios.data(40)  # batches of 12, 12, 12 and 4
    single = build()
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    dist = distkeras.distribute(build(), devices=3)
    dist.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(single.get_weights(), dist.get_weights())  # moving mean and variance included


def test_models_on_different_device_sets_coexist_and_leave_no_global_distribution():
    x, y = scenarios.data(24)
    two = distkeras.distribute(scenarios.build(keras), devices=2)
    three = distkeras.distribute(scenarios.build(keras), devices=3)
    for model in (two, three, two):
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    assert keras.distribution.distribution() is None
    assert shards(two.weights[0]).keys() == jax_devices(["cpu:0", "cpu:1"])
    assert shards(three.weights[0]).keys() == jax_devices(["cpu:0", "cpu:1", "cpu:2"])


def test_a_distributed_model_can_be_moved_to_other_devices_with_its_optimizer_state():
    x, y = scenarios.data(24)

    def start():
        model = scenarios.build(keras)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        return model

    single = start()
    single.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    model = distkeras.distribute(start(), devices=2)
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    momenta = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    assert distkeras.distribute(model, devices=3) is model
    assert shards(model.weights[0]).keys() == jax_devices(["cpu:0", "cpu:1", "cpu:2"])
    for before, v in zip(momenta, model.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), before)
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(single.get_weights(), model.get_weights())


def test_the_users_model_is_distributed_in_place():
    model = scenarios.build(keras)
    variables = [id(v) for v in model.variables + model.optimizer.variables]
    before = model.get_weights()
    assert distkeras.distribute(model, devices=2) is model
    assert [id(v) for v in model.variables + model.optimizer.variables] == variables  # nothing rebuilt
    assert shards(model.weights[0]).keys() == jax_devices(["cpu:0", "cpu:1"])
    assert_weights_close(before, model.get_weights())
    assert "fit" not in type(model).__dict__ and "fit" in model.__dict__  # an instance hook, not a new class


def test_metric_and_optimizer_made_before_a_later_compile_are_moved_onto_the_mesh():
    dist = distkeras.distribute(scenarios.build(keras), devices=3)
    rmse = keras.metrics.RootMeanSquaredError(name="rmse")
    dist.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=[rmse])
    x, y = scenarios.data(24)
    logs = dist.fit(x, y, batch_size=6, epochs=2, verbose=0).history
    assert len(logs["rmse"]) == 2
    mesh = jax_devices(["cpu:0", "cpu:1", "cpu:2"])
    for v in rmse.variables + dist.optimizer.variables:
        assert shards(v).keys() == mesh, v.path
    assert float(keras.ops.convert_to_numpy(rmse.result())) == pytest.approx(logs["rmse"][-1], rel=1e-5)


# ---- model parallel


def test_model_parallel_shards_kernels_and_their_optimizer_slots():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    dist = distkeras.distribute(model, devices=2, strategy="model")
    dist.fit(np.ones((8, 6), "float32"), np.ones((8, 3), "float32"), batch_size=4, verbose=0)
    mesh = jax_devices(["cpu:0", "cpu:1"])
    kernel, bias, last_kernel, _ = dist.weights
    assert shards(kernel) == {d: (6, 4) for d in mesh}  # 8 columns, 4 per device
    assert shards(bias) == {d: (8,) for d in mesh}  # replicated: only kernels are sharded by default
    assert shards(last_kernel) == {d: (8, 3) for d in mesh}  # 3 columns don't split over 2: replicated
    slots = [v for v in dist.optimizer.variables if tuple(v.shape) == (6, 8)]
    assert len(slots) == 2 and all(shards(v) == {d: (6, 4) for d in mesh} for v in slots)  # Adam's m and v


@pytest.mark.parametrize(
    "devices, options, sharded",
    [
        (2, {"strategy": "model"}, [(5, 8), None, None, None]),
        (3, {"strategy": "model"}, [None, None, (16, 1), None]),
        (2, {"strategy": "model", "layout_map": {"KERNEL1": ("model", None)}}, [None, None, (8, 3), None]),
        (2, {"strategy": "model", "layout_map": {"KERNEL0": (None, "model"), "BIAS0": ("model",)}},
         [(5, 8), (8,), None, None]),
        (3, {"strategy": "model", "model_shards": 1}, [None, None, None, None]),
    ],
)
def test_model_parallel_training_equals_single_device(devices, options, sharded):
    x, y = scenarios.data(96)
    single = scenarios.build(keras)
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model = scenarios.build(keras)
    if "layout_map" in options:  # layer names differ from run to run: name the variables by their place
        paths = {"KERNEL0": model.weights[0].path, "BIAS0": model.weights[1].path, "KERNEL1": model.weights[2].path}
        options = dict(options, layout_map={re.escape(paths[k]): v for k, v in options["layout_map"].items()})
    dist = distkeras.distribute(model, devices=devices, **options)
    history = dist.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    for v, shape in zip(dist.weights, sharded):
        assert set(shards(v).values()) == {shape or tuple(v.shape)}, v.path
    assert_weights_close(single.get_weights(), dist.get_weights())
    np.testing.assert_allclose(history["loss"], single.history.history["loss"], rtol=RTOL, atol=ATOL)


def test_model_parallel_with_a_batch_axis():
    # 2 devices, model_shards=1: a 'batch' axis of 2 and a 'model' axis of 1.
    dist = distkeras.distribute(probed_model(), devices=2, strategy="model", model_shards=1)
    x, y = scenarios.data(12)
    dist.fit(x, y, batch_size=6, verbose=0)
    assert Probe.seen and all(spec[:1] == ("batch",) for _, spec in Probe.seen)


# ---- bad options


@pytest.mark.parametrize(
    "options, message",
    [
        ({"strategy": "pipeline"}, r"Expected strategy in \('data', 'model'\). Received: strategy='pipeline'"),
        ({"layout_map": {"k": (None, "model")}}, "apply to strategy='model' only"),
        ({"model_shards": 2}, "apply to strategy='model' only"),
        ({"strategy": "model", "model_shards": 2}, "Expected model_shards to be a positive int that divides the 3"),
        ({"strategy": "model", "model_shards": 0}, "Received: model_shards=0"),
        ({"strategy": "model", "layout_map": [("k", None)]}, "Expected layout_map to be a dict"),
        ({"strategy": "model", "layout_map": {".*kernel": (None, "modle")}}, "Bad layout_map.*modle"),
        ({"strategy": "model", "layout_map": {".*dense.*kernel": ("model",)}}, r"Expected 2 axes for .*/kernel of shape \(5, 16\)"),
        ({"strategy": "model", "layout_map": {".*kernel": ("model", None)}}, r"'model' axis \(3 devices\) to divide"),
        ({"strategy": "model", "layout_map": {".*conv.*": (None, "model")}}, r"'\.\*conv\.\*' match no variable"),
        ({"strategy": "model", "layout_map": {".*kernel": (None, None), ".*dense.*": (None, None)}}, "matches multiple"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(distkeras.OptionError, match=message):
        distkeras.distribute(scenarios.build(keras), devices=3, **options)


def test_model_parallel_with_nothing_to_shard():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(5)])
    with pytest.raises(distkeras.OptionError, match="found nothing to shard.*divisible by model_shards=3"):
        distkeras.distribute(model, devices=3, strategy="model")


def test_multi_worker_without_jax_distributed_is_a_clear_error(monkeypatch):
    # This process started as a single process; the variables of a 2-process job appear only now, after
    # JAX started, so jax.distributed can't run (test_multiworker.py covers a real 2-process job).
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    with pytest.raises(distkeras.TooLateError, match="worker 1 of 2 .*jax.distributed is not running.*Import distkeras "
                                                     "before JAX runs its first computation"):
        distkeras.distribute(scenarios.build(keras), devices=3)


# ---- the CPU device split


def test_set_cpu_devices_keeps_other_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false {}=8 --xla_backend_optimization_level=1".format(FLAG))
    backends.get("jax").set_cpu_devices(3)  # the count JAX runs with here: allowed
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_cpu_enable_fast_math=false", "--xla_backend_optimization_level=1", FLAG + "=3"
    ]


_FRESH = """
import json, os, sys
import distkeras
distkeras.use_cpu_devices(2)
imported = "jax" in sys.modules
import jax
print(json.dumps({"imported": imported, "flags": os.environ["XLA_FLAGS"], "devices": len(jax.devices())}))
"""


def test_use_cpu_devices_before_jax_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND="jax", XLA_FLAGS="--xla_cpu_enable_fast_math=false",
               PYTHONPATH=os.path.dirname(os.path.dirname(distkeras.__file__)))
    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"imported": False, "flags": "--xla_cpu_enable_fast_math=false {}=2".format(FLAG), "devices": 2}


def test_optimizer_slots_made_before_distribute_take_their_variables_layout():
    """Pins the Keras privates _assign_layouts relies on: a variable's ``_layout``, and the slot naming
    ``<optimizer>/<variable path with "_">_<slot>``."""
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(np.ones((8, 6), "float32"), np.ones((8, 3), "float32"), batch_size=4, verbose=0)  # slots on one device
    assert hasattr(model.weights[0], "_layout")
    kernel_name = model.weights[0].path.replace("/", "_")
    assert any(v.path.partition("/")[2].startswith(kernel_name + "_") for v in model.optimizer.variables)
    dist = distkeras.distribute(model, devices=2, strategy="model")
    mesh = jax_devices(["cpu:0", "cpu:1"])
    slots = [v for v in dist.optimizer.variables if tuple(v.shape) == (6, 8)]
    assert len(slots) == 2 and all(shards(v) == {d: (6, 4) for d in mesh} for v in slots)
    dist.fit(np.ones((8, 6), "float32"), np.ones((8, 3), "float32"), batch_size=4, verbose=0)


def test_private_api_pin_gloo_interface():
    """jax.py's _gloo_on() replaces the CPU backend factory so that Gloo uses the interface that reaches the
    coordinator (jax passes none, and Gloo then advertises the host name's loopback address). Pins what it
    reaches into: the registration's mutable ``factory``, ``make_cpu_client(collectives=...)`` and jaxlib's
    ``make_gloo_tcp_collectives(..., interface=...)``. The namespace-host tests (test_multihost.py) show it
    working across hosts."""
    import inspect

    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    registration = xla_bridge._backend_factories["cpu"]
    assert hasattr(registration, "factory")
    assert "collectives" in inspect.signature(xla_bridge.make_cpu_client).parameters
    assert "interface" in _jax.make_gloo_tcp_collectives.__doc__
    assert hasattr(distributed.global_state, "client")


# ---- compression


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    return model


def _compiled_step_text(model, x, y):
    """The optimized HLO XLA compiled for ``model``'s train step on one global batch (x, y)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from distkeras.backends.jax import uneven as jax_uneven

    distribution = [d for d in jax_uneven._ours.keys()][-1]
    sharding = NamedSharding(distribution.device_mesh.backend_mesh, PartitionSpec("batch"))
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables, model.metrics_variables))
    data = (jax.device_put(x, sharding), jax.device_put(y, sharding))
    with distribution.scope():
        return jax.jit(model.train_step).lower(state, data).compile().as_text()


def _collectives(text):
    """(opcode, element type, shape) of every operand of every collective in an optimized HLO text."""
    found = []
    for line in text.splitlines():
        match = re.search(r"= (\(.*?\)|\w+\[[^\]]*\]\S*) (all-reduce|all-to-all|all-gather|reduce-scatter)(?:-start)?\(", line)
        if match:
            for dtype, shape in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
                found.append((match.group(2), dtype, tuple(int(d) for d in shape.split(",") if d)))
    return found


@pytest.mark.parametrize("compression, devices", [("bf16", 2), ("fp16", 2), ("bf16", 3), (None, 2)])
def test_the_compiled_step_sends_gradients_in_16_bits(compression, devices):
    """Read from XLA's optimized program: with compression the gradients cross devices as one 16-bit buffer
    (reduce-scatter traffic through all-to-all, then all-gather) and no
    kernel-shaped float32 collective is left; without it XLA all-reduces the kernels' gradients in float32."""
    x, y = scenarios.data(24)
    model = distkeras.distribute(_bn_model(), devices=devices, compression=compression)
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)  # builds optimizer and metrics
    found = _collectives(_compiled_step_text(model, x[:12], y[:12]))
    # Dimensions in any order: XLA may transpose a kernel's gradient before it all-reduces it. Not element counts:
    # the synchronized BatchNorm's float32 statistics (replicas x 3 x 1 x 8, and their (3, 1, 8) cotangent) have
    # as many elements as the (8, 3) kernel.
    kernels = {tuple(sorted(v.shape)) for v in model.trainable_variables if len(v.shape) == 2}
    wide = {tuple(sorted(shape)) for _, dtype, shape in found if dtype == "f32"}
    if compression is None:
        assert kernels <= wide, found
    else:
        assert not kernels & wide, found
        assert {op for op, dtype, _ in found if dtype == "u16"} == {"all-to-all", "all-gather"}, found


def test_exact_wire_with_batchnorm_equals_single_device():
    """The compressed step's own arithmetic, with the 16-bit cast taken out (wire float32): per-shard gradients
    averaged by psum, BatchNormalization statistics summed over the shards, metric updates added up: the
    single-device result, moving statistics and logs included."""
    from distkeras.backends.jax import uneven as jax_uneven
    from distkeras.backends.jax import steps as jax_steps

    x, y = scenarios.data(48)
    single = _bn_model()
    expected = single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    model = distkeras.distribute(_bn_model(), devices=2, compression="bf16", compression_fallback=False)
    distribution = list(jax_uneven._ours.keys())[-1]
    jax_steps.install(model, distribution.device_mesh.backend_mesh, "batch", "float32")
    history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close(single.get_weights(), model.get_weights())
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["mae"], expected["mae"], rtol=1e-5)


def test_compression_with_batchnorm_trains_close_to_single_device():
    x, y = scenarios.data(48)
    single = _bn_model()
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model = distkeras.distribute(_bn_model(), devices=2, compression="bf16")
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for e, a in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, e, rtol=2e-2, atol=2e-2)
    # Outside the step BatchNormalization is Keras' own again (predict, evaluate).
    np.testing.assert_allclose(model.predict(x, verbose=0), single.predict(x, verbose=0), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("compressed, plain, keep", [
    ([0.2, 0.2, 0.2, 0.2, 0.2], [0.4, 0.5, 0.4, 0.4, 0.6], True),   # across hosts on a slow link
    ([0.13, 0.12, 0.14, 0.13, 0.12], [0.05, 0.06, 0.05, 0.05, 0.07], False),  # one host: the detour costs
    ([0.1, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, 0.1], True),   # a tie keeps what was asked for
    ([0.1, 0.1, 9.0, 0.1, 0.1], [0.11, 0.11, 0.11, 0.11, 0.11], True),  # one stall doesn't decide
    ([0.2, 0.2, 0.2, 0.2], [0.1, 0.1, 0.15, 0.3], False),           # an even count: the middle two's mean
])
def test_compression_is_kept_only_where_its_median_step_is_no_slower(compressed, plain, keep):
    from distkeras.backends.jax import steps as jax_steps

    assert jax_steps.keep_compression(compressed, plain) is keep


def _trial_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # no optimizer state but the step count
    return model


def _assert_same(expected, actual):
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def _continued(weights, x, y, **options):
    """A fresh model set to ``weights``, distributed with ``options``, after one more epoch on (x, y)."""
    model = distkeras.distribute(_trial_model(), devices=2, **options)
    model.set_weights(weights)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("keep", [False, True])
def test_the_compression_trial_keeps_one_kind_of_step_for_good(keep, monkeypatch):
    """compression='bf16' on trial (the default): the first 12 steps alternate 16-bit and float32 steps, then the
    kind :func:`keep_compression` picks (patched here: the timing rule has its own test) trains every later step,
    across fit() calls and a new compile(). Read from the weights: after the trial the model trains exactly as
    the uncompressed distributed model does from the same weights, or as the always-16-bit one does, which
    differ from each other. Rank 0 warns once when it falls back."""
    import warnings

    from distkeras.backends.jax import steps as jax_steps

    monkeypatch.setattr(jax_steps, "keep_compression", lambda compressed, plain: keep)
    x, y = scenarios.data(96)  # 12 steps of 8
    model = distkeras.distribute(_trial_model(), devices=2, compression="bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # the trial
        after_trial = model.get_weights()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    fell_back = [w for w in caught if "made this model's training step slower" in str(w.message)]
    assert len(fell_back) == (0 if keep else 1), [str(w.message) for w in caught]
    exact = _continued(after_trial, x, y)
    compressed = _continued(after_trial, x, y, compression="bf16", compression_fallback=False)
    assert max(float(np.abs(a - b).max()) for a, b in zip(exact, compressed)) > 1e-6  # the two kinds differ
    _assert_same(compressed if keep else exact, model.get_weights())
    # A new compile() traces the step again: the kept kind's.
    before = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = _continued(before, x, y, **({"compression": "bf16", "compression_fallback": False} if keep else {}))
    _assert_same(expected, model.get_weights())


def test_the_compression_trial_alternates_both_kinds_before_it_decides(monkeypatch):
    """Until the trial ends, steps alternate 16-bit, float32, ...: after 2 steps the weights are those of one
    16-bit step then one float32 step; with compression_fallback=False no trial runs and no float32 step."""
    from distkeras.backends.jax import steps as jax_steps

    calls = []
    monkeypatch.setattr(jax_steps, "keep_compression", lambda compressed, plain: calls.append(1) or True)
    x, y = scenarios.data(16)  # 2 steps of 8
    model = distkeras.distribute(_trial_model(), devices=2, compression="bf16")
    start = model.get_weights()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    one = distkeras.distribute(_trial_model(), devices=2, compression="bf16", compression_fallback=False)
    one.set_weights(start)
    one.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = _continued(one.get_weights(), x[8:], y[8:])
    _assert_same(expected, model.get_weights())
    assert not calls  # undecided after 2 steps
    with pytest.raises(distkeras.OptionError, match="compression_fallback to be True or False"):
        distkeras.distribute(_trial_model(), devices=2, compression="bf16", compression_fallback="yes")


def test_compression_is_refused_where_it_has_no_gradient_to_compress():
    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    model = OwnStep([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(distkeras.OptionError, match="OwnStep.train_step is your own"):
        distkeras.distribute(model, devices=2, compression="bf16")
    with pytest.raises(distkeras.OptionError, match="compression applies to strategy='data'"):
        distkeras.distribute(scenarios.build(keras), devices=2, strategy="model", compression="bf16")


def test_private_api_pin_compressed_step():
    """jax_steps.py rebuilds Keras' JAX train_step around a shard_map'd gradient: it calls the trainer's
    ``compute_loss_and_updates`` (public), ``_update_metrics_variables`` (private: the metrics update
    train_step does after the optimizer) and hooks BatchNormalization's private ``_moments`` (its one place for
    batch statistics). Pinned here; their use is checked by the tests above."""
    import inspect

    from keras.src.backend.jax.trainer import JAXTrainer

    assert list(inspect.signature(JAXTrainer._update_metrics_variables).parameters) == [
        "self", "metrics_variables", "unscaled_loss", "x", "y", "y_pred", "sample_weight"]
    assert list(inspect.signature(keras.layers.BatchNormalization._moments).parameters) == ["self", "inputs", "mask"]
    source = inspect.getsource(JAXTrainer.train_step)
    assert "self._update_metrics_variables(" in source and "self.optimizer.stateless_apply(" in source


def test_bfloat16_bits_are_rounded_as_xla_rounds():
    """jax/steps.py encodes bfloat16 with integer arithmetic (XLA's CPU convert is slow): bit for bit what
    ``astype(bfloat16)`` gives, across the whole float32 range, with infinities, NaN, zeros and denormals."""
    import jax.numpy as jnp

    from distkeras.backends.jax.steps import _decode, _encode

    rng = np.random.default_rng(0)
    x = (rng.normal(size=50000) * 10.0 ** rng.integers(-40, 38, 50000)).astype("float32")
    x = np.concatenate([x, np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1e-45, 1.00390625], "float32")])
    bf16 = jnp.dtype(jnp.bfloat16)
    expected = np.asarray(jnp.asarray(x).astype(bf16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(_decode(_encode(jnp.asarray(x), bf16), bf16)), expected)


# ---- models with optimizers of their own (a GAN), unbuilt models, random layers


class GAN(keras.Model):
    """A GAN in the style of the Keras guides, written for JAX: ``compile(d_optimizer, g_optimizer, loss_fn)``
    and a stateless ``train_step`` (``stateless_call``, ``jax.value_and_grad``, ``stateless_apply``, latent
    noise from ``keras.random.normal`` with a SeedGenerator). Keras' JAX fit() carries only
    ``model.optimizer``'s variables through its jitted step, so a step with optimizers of its own runs eagerly
    and writes their new state back."""

    def __init__(self, discriminator, generator, latent_dim=4):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True  # no call(): Keras' fit() would otherwise try to build it by calling it

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile(run_eagerly=True)
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
        d_optimizer.build(self.discriminator.trainable_variables)
        g_optimizer.build(self.generator.trainable_variables)

    def train_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        values = {id(v): x for v, x in zip(self.trainable_variables + self.non_trainable_variables,
                                          list(trainable) + list(non_trainable))}
        own = {"g": self.generator, "d": self.discriminator}
        tv = {k: [values[id(v)] for v in m.trainable_variables] for k, m in own.items()}
        ntv = {k: [values[id(v)] for v in m.non_trainable_variables] for k, m in own.items()}
        real = data[0] if isinstance(data, tuple) else data
        batch = real.shape[0]
        seed_state = self.seed_generator.state
        with keras.StatelessScope(state_mapping=[(seed_state, values[id(seed_state)])]) as scope:
            noise_d = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
            noise_g = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
            values[id(seed_state)] = scope.get_current_value(seed_state)
        labels = keras.ops.concatenate([keras.ops.ones((batch, 1)), keras.ops.zeros((batch, 1))])

        def d_loss_fn(d_tv):
            fake, _ = self.generator.stateless_call(tv["g"], ntv["g"], noise_d)
            predictions, _ = self.discriminator.stateless_call(d_tv, ntv["d"], keras.ops.concatenate([fake, real]))
            return self.loss_fn(labels, predictions)

        d_loss, d_grads = jax.value_and_grad(d_loss_fn)(tv["d"])
        tv["d"], d_state = self.d_optimizer.stateless_apply([v.value for v in self.d_optimizer.variables], d_grads, tv["d"])

        def g_loss_fn(g_tv):
            fake, _ = self.generator.stateless_call(g_tv, ntv["g"], noise_g)
            predictions, _ = self.discriminator.stateless_call(tv["d"], ntv["d"], fake)
            return self.loss_fn(keras.ops.zeros((batch, 1)), predictions)

        g_loss, g_grads = jax.value_and_grad(g_loss_fn)(tv["g"])
        tv["g"], g_state = self.g_optimizer.stateless_apply([v.value for v in self.g_optimizer.variables], g_grads, tv["g"])
        for optimizer, new in ((self.d_optimizer, d_state), (self.g_optimizer, g_state)):
            for variable, value in zip(optimizer.variables, new):
                variable.assign(value)
        for k, m in own.items():
            values.update({id(v): x for v, x in zip(m.trainable_variables, tv[k])})
        with keras.StatelessScope(state_mapping=list(zip(self.metrics_variables, metrics_variables))) as scope:
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            logs = {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}
        metrics_variables = [scope.get_current_value(v) for v in self.metrics_variables]
        state = ([values[id(v)] for v in self.trainable_variables], [values[id(v)] for v in self.non_trainable_variables],
                 optimizer_variables, metrics_variables)
        return logs, state


def _gan():
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)])
    gan = GAN(discriminator, generator)
    gan.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02, beta_1=0.5),
                keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def _state(model, optimizers):
    return [keras.ops.convert_to_numpy(v) for v in model.weights] + [
        keras.ops.convert_to_numpy(v) for o in optimizers for v in o.variables]


def test_all_optimizers_finds_optimizers_in_attributes_lists_and_dicts_once_each():
    from distkeras.backends import keras_model

    gan = _gan()
    assert keras_model.all_optimizers(gan) == [gan.optimizer, gan.d_optimizer, gan.g_optimizer]
    extra = keras.optimizers.SGD()
    gan.more = [gan.d_optimizer, extra]
    gan.by_name = {"again": extra}
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    gan.scaled = scaled
    found = keras_model.all_optimizers(gan)
    assert found[:3] == [gan.optimizer, gan.d_optimizer, gan.g_optimizer]
    assert sorted(map(id, found[3:])) == sorted(map(id, [extra, scaled, scaled.inner_optimizer]))


@pytest.mark.parametrize("devices, trained_before", [
    pytest.param(2, False, marks=only_in_full(
        "[3-True] lays the same two optimizers (built in compile(), before distribute) on the mesh and trains them "
        "as one device, from a state trained before distribute (non-zero slots and iterations); 2 devices: the "
        "other tests of this module")),
    (3, True)])
def test_a_gan_with_optimizers_of_its_own_equals_one_device(devices, trained_before):
    """Both optimizers (set in compile(), built before distribute, trained before it in one case) are laid out on
    the mesh with the model: weights, both optimizers' slots and History equal one device's."""
    x = scenarios.data(12)[0][:, :5]
    x = np.concatenate([x, x[:, :1]], axis=1)  # 6 features
    single = _gan()
    expected = single.fit(x, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    gan = _gan()
    if trained_before:
        gan.fit(x, batch_size=6, epochs=1, shuffle=False, verbose=0)
    dist = distkeras.distribute(gan, devices=devices)
    mesh = jax_devices(["cpu:{}".format(i) for i in range(devices)])
    for v in dist.d_optimizer.variables + dist.g_optimizer.variables:
        assert shards(v).keys() == mesh, v.path
    history = dist.fit(x, batch_size=6, epochs=1 if trained_before else 2, shuffle=False, verbose=0).history
    assert_weights_close(_state(single, [single.d_optimizer, single.g_optimizer]),
                         _state(dist, [dist.d_optimizer, dist.g_optimizer]))
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(history[key], expected[key][-len(history[key]):], rtol=RTOL, atol=ATOL)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("devices", [2, 3])
def test_an_unbuilt_subclassed_model_creates_its_variables_on_the_mesh_and_equals_one_device(devices):
    def build():
        keras.utils.set_random_seed(0)
        model = Subclassed()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model

    x, y = scenarios.data(24)
    single = build()
    expected = single.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    model = build()
    assert not model.built and not model.variables
    dist = distkeras.distribute(model, devices=devices)
    history = dist.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    mesh = jax_devices(["cpu:{}".format(i) for i in range(devices)])
    for v in dist.weights + dist.optimizer.variables:
        assert shards(v) == {d: tuple(v.shape) for d in mesh}, v.path
    assert_weights_close(single.get_weights(), dist.get_weights())
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=RTOL, atol=ATOL)


class Sampling(keras.layers.Layer):
    """z = mean + noise, the noise from keras.random.normal with the layer's own SeedGenerator (a VAE's)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        return x + keras.random.normal(keras.ops.shape(x), seed=self.seed_generator)


def test_random_layers_draw_what_one_device_draws():
    """Dropout and a keras.random.normal sampling layer on 3 devices: one SPMD program over the global batch
    draws what one device draws for every row (weights, seed states and History equal)."""
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dropout(0.4), Sampling(),
                                  keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = scenarios.data(24)
    single = build()
    expected = single.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    dist = distkeras.distribute(build(), devices=3)
    history = dist.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close([keras.ops.convert_to_numpy(v) for v in single.variables],
                         [keras.ops.convert_to_numpy(v) for v in dist.variables])
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=RTOL, atol=ATOL)
