"""TensorFlow-only behaviour of the adapter (MirroredStrategy)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.backends import scenarios
from tests.full import only_in_full

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow adapter tests (KERAS_BACKEND=tensorflow)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_variable_is_mirrored_on_the_chosen_devices():
    import tensorflow as tf

    model = scenarios.build(keras)
    dist = distkeras.distribute(model, devices=["cpu:0", "cpu:2"])
    x, y = scenarios.data(24)
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)  # builds optimizer slots and metric state
    variables = dist.weights + dist.optimizer.variables + [v for m in dist.metrics for v in m.variables]
    assert len(variables) > len(dist.weights)
    for variable in variables:
        value = variable.value if hasattr(variable, "value") else variable
        assert isinstance(value, tf.distribute.DistributedValues), variable.path
        devices = sorted(v.device.rsplit("/", 1)[-1] for v in value.values)
        assert devices == ["device:CPU:0", "device:CPU:2"], (variable.path, devices)


def test_plain_keras_weighs_an_uneven_split_wrongly_and_distkeras_does_not(monkeypatch):
    # What exact_loss_scaling fixes: Keras 3 averages the replicas' mean losses with equal weight, so a
    # batch split 2+1+1 (the last of 100 samples at batch 12) counts its lone samples double.
    expected, _ = scenarios.train("uneven_tail", 1)
    plain = scenarios.build(keras)
    plain = distkeras.distribute(plain, devices=3, exact_loss_scaling=False)
    x, y = scenarios.data(100)
    plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    deviation = max(float(np.abs(a - b).max()) for a, b in zip(expected, plain.get_weights()))
    assert deviation > 1e-3
    exact, _ = scenarios.train("uneven_tail", 3)
    assert max(float(np.abs(a - b).max()) for a, b in zip(expected, exact)) < 1e-5


def count_all_reduces(monkeypatch):
    """The reductions replicas ask for through ``ReplicaContext.all_reduce`` (Keras' gradients among them)."""
    import tensorflow as tf

    calls = []
    all_reduce = tf.distribute.ReplicaContext.all_reduce

    def counted(self, reduce_op, value, options=None):
        calls.append(reduce_op)
        return all_reduce(self, reduce_op, value, options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", counted)
    return calls


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_exact_loss_scaling_on_one_host_adds_no_all_reduce(monkeypatch, run_eagerly):
    # On one host the global batch is the sum of the replicas' batches, known before they run: the
    # correction costs no collective, and stays exact. 21 samples at batch 10 on 3 replicas: 4+3+3 twice, last
    # 1+0+0 (two epochs: the second's steps start from the first's weights).
    calls = count_all_reduces(monkeypatch)
    x, y = scenarios.data(21)

    def fit(devices, exact_loss_scaling=True):
        model = scenarios.build(keras)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", run_eagerly=run_eagerly)
        if devices > 1:
            model = distkeras.distribute(model, devices=devices, exact_loss_scaling=exact_loss_scaling)
        del calls[:]
        model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), len(calls)

    expected, _ = fit(1)
    _, uncorrected = fit(3, exact_loss_scaling=False)
    exact, corrected = fit(3)
    assert corrected == uncorrected > 0
    for e, a in zip(expected, exact):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_a_strategy_run_of_the_replicas_batches_computes_each_replicas_own_mean_loss(monkeypatch):
    # A custom loop may call the model's strategy.run with anything. Where the arguments are the replicas'
    # batches, each replica's loss is its own mean (the loss rule of tensorflow/steps.py, no collective);
    # elsewhere Keras' own rule stays: each replica's loss divided by the replica count.
    import tensorflow as tf

    calls = count_all_reduces(monkeypatch)
    model = distkeras.distribute(scenarios.build(keras), devices=3)
    strategy = model.distribute_strategy
    x, y = scenarios.data(10)

    @tf.function
    def losses(x, y):
        return strategy.run(lambda x, y: model.compute_loss(x=x, y=y, y_pred=model(x), training=True), args=(x, y))

    squares = (model.predict(x, verbose=0) - y) ** 2
    whole = strategy.experimental_local_results(losses(tf.constant(x), tf.constant(y)))
    np.testing.assert_allclose(np.array(whole) * 3, [np.mean(squares)] * 3, rtol=1e-5)
    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(10))
    own = strategy.experimental_local_results(losses(*next(iter(batches))))
    split = [squares[:4], squares[4:8], squares[8:]]  # 10 rows on 3 replicas: 4+4+2
    np.testing.assert_allclose(own, [np.mean(part) for part in split], rtol=1e-5)
    assert calls == []


@pytest.mark.parametrize("ops", ["reduction_to_one_device", "hierarchical_copy"])
def test_cross_device_ops_option(ops):
    expected, _ = scenarios.train("even", 1)
    model = distkeras.distribute(scenarios.build(keras), devices=2, cross_device_ops=ops)
    x, y = scenarios.data(96)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for e, a in zip(expected, model.get_weights()):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_bad_cross_device_ops():
    with pytest.raises(distkeras.OptionError, match="Expected cross_device_ops in"):
        distkeras.distribute(scenarios.build(keras), devices=2, cross_device_ops="ring")


class Opaque(keras.Model):
    """A subclassed model with constructor arguments and no get_config: Keras can't clone it."""

    def __init__(self, width):
        super().__init__()
        self.hidden = keras.layers.Dense(width)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


@keras.saving.register_keras_serializable("distkeras_tests")
class Configurable(Opaque):
    def __init__(self, width, **kwargs):
        super().__init__(width)
        self.width = width

    def get_config(self):
        return {"width": self.width}


def test_a_subclassed_model_without_config_is_distributed_in_place():
    import tensorflow as tf

    model = Opaque(4)
    x = np.random.default_rng(0).normal(size=(6, 5)).astype("float32")
    before = model.predict(x, verbose=0)
    variables = [id(v) for v in model.weights]
    assert distkeras.distribute(model, devices=2) is model
    assert [id(v) for v in model.weights] == variables  # the same Keras variables, new storage behind them
    for variable in model.weights:
        assert isinstance(variable.value, tf.distribute.DistributedValues) and len(variable.value.values) == 2
    assert model.distribute_strategy.num_replicas_in_sync == 2
    np.testing.assert_allclose(model.predict(x, verbose=0), before, rtol=1e-6)


def test_a_subclassed_model_with_config_saves_and_reloads_as_the_plain_model(tmp_path):
    model = Configurable(4)
    model(np.zeros((1, 5), "float32"))
    model.compile(optimizer="sgd", loss="mse")
    dist = distkeras.distribute(model, devices=2)
    x = np.random.default_rng(0).normal(size=(12, 5)).astype("float32")
    dist.fit(x, x[:, :1], batch_size=4, verbose=0)
    dist.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded) is Configurable
    np.testing.assert_allclose(loaded.predict(x, verbose=0), dist.predict(x, verbose=0), rtol=1e-6)


def test_the_keras_privates_the_adapter_relies_on_are_there():
    """The adapter reaches into Keras 3's TensorFlow backend (see tensorflow.py); a Keras that renames
    any of these fails here, by name, rather than somewhere inside a training step."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    # The backend's classes are taken from live objects: Keras moves and renames its backend modules
    # (keras-nightly: tensorflow.core -> tensorflow.ops.core, TensorFlowTrainer -> Trainer).
    Variable = type(keras.Variable(0.0))
    TFOptimizer = next(c for c in type(keras.optimizers.SGD()).__mro__ if "_all_reduce_sum_gradients" in vars(c))
    TensorFlowTrainer = next(c for c in keras.Model.__mro__ if "_maybe_symbolic_build" in vars(c))
    model = scenarios.build(keras)
    assert "_distribute_strategy" in model.__dict__ and hasattr(TensorFlowTrainer, "_maybe_symbolic_build")
    assert callable(Variable._initialize) and isinstance(model.weights[0]._value, tf_variable())
    for name in ("_all_reduce_sum_gradients", "_backend_update_step", "_var_key"):
        assert callable(getattr(TFOptimizer, name)), name
    for name in ("_backend_apply_gradients", "_backend_increment_gradient_accumulators",
                 "_overwrite_model_variables_with_average_value", "_get_variable_index"):
        assert callable(getattr(BaseOptimizer, name)), name
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    optimizer.build(model.trainable_variables)
    assert "_distribution_strategy" in optimizer.__dict__ and len(optimizer._accumulated_gradients) == 4
    assert set(optimizer._trainable_variables_indices) == {optimizer._var_key(v) for v in model.trainable_variables}
    layer = keras.layers.BatchNormalization()
    layer.build((None, 4, 3))
    assert layer._reduction_axes == [0, 1] and callable(layer._moments)


def tf_variable():
    import tensorflow as tf

    return tf.Variable


def bn_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("samples", [  # 49: the last batch of 1 leaves a replica empty
    pytest.param(48, marks=only_in_full(
        "[49] trains the same 4 even batches of 12 and then a 1-row batch, and checks everything this one does "
        "(per-replica statistics differ from one device and stay finite, synchronized ones equal it, the saved "
        "config is the user's)")),
    49])
def test_per_replica_batchnorm_on_request_differs_and_stays_finite(samples):
    x, y = scenarios.data(samples)
    single = bn_model()
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    weights = {}
    for sync in (True, False):
        model = distkeras.distribute(bn_model(), devices=2, sync_batchnorm=sync)
        model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
        weights[sync] = model.get_weights()
        assert model.layers[1].get_config()["synchronized"] is False  # the saved config is the user's
    gap = max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), weights[False]))
    assert np.isfinite(gap) and gap > 1e-3  # per-replica statistics: not single-device training
    assert max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), weights[True])) < 1e-5


def run_script(body, env=None, timeout=300):
    script = "import sys\nsys.path.insert(0, {!r})\n".format(os.path.join(ROOT, "src")) + textwrap.dedent(body)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=full_env, timeout=timeout)


def test_distkeras_cpu_devices_environment_variable_with_an_unchanged_script():
    done = run_script("""
        import keras, distkeras
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model = distkeras.distribute(model)
        print(distkeras.describe(model)["devices"])
    """, env={"DISTKERAS_CPU_DEVICES": "3", "KERAS_BACKEND": "tensorflow"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['cpu:0', 'cpu:1', 'cpu:2']"


def test_distkeras_cpu_devices_too_late_is_reported_by_distribute():
    done = run_script("""
        import keras
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        import distkeras   # too late: TensorFlow has started with one CPU device
        try:
            distkeras.distribute(model, 2)
        except distkeras.TooLateError as exc:
            print("TooLateError:", exc)
    """, env={"DISTKERAS_CPU_DEVICES": "2", "KERAS_BACKEND": "tensorflow"})
    assert "TooLateError: DISTKERAS_CPU_DEVICES=2 asks for 2 CPU devices, but the tensorflow backend had already " \
           "started with 1" in done.stdout, done.stderr


def test_tf_keras_2_models_are_distributed_too():
    pytest.importorskip("tf_keras", reason="tf-keras (Keras 2 for TF_USE_LEGACY_KERAS=1) is not installed")
    done = run_script("""
        import distkeras
        distkeras.use_cpu_devices(3)
        import numpy as np, tf_keras as keras
        def make():
            keras.utils.set_random_seed(0)
            m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            return m
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(101, 5)).astype("float32"), rng.normal(size=(101, 3)).astype("float32")
        single = make()
        single.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
        diffs = []
        for steps_per_execution in (1, 4):
            dist = make()
            dist.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=steps_per_execution)
            dist = distkeras.distribute(dist, devices=3)
            dist.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
            diffs.append(max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), dist.get_weights())))
        print(type(dist).__module__, max(diffs))
    """, env={"TF_USE_LEGACY_KERAS": "1", "KERAS_BACKEND": "tensorflow"})
    assert done.returncode == 0, done.stderr[-3000:]
    module, diff = done.stdout.split()
    assert module.startswith("tf_keras.") and float(diff) < 1e-5


def test_plain_keras_clips_each_replicas_gradient_and_distkeras_the_global_one():
    """What the compatibility suite's clipping cases guard against: Keras 3 + MirroredStrategy, unaided,
    clips every replica's partial gradient before the all-reduce."""
    import tensorflow as tf

    from tests.backends import patterns

    def build():
        keras.utils.set_random_seed(0)
        model, x, y, _ = patterns.global_clipnorm(keras)
        return model, x, y

    single, x, y = build()
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        plain, _, _ = build()
    plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    ours, _, _ = build()
    distkeras.distribute(ours, devices=2).fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)

    def gap(model):
        return max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), model.get_weights()))

    assert gap(plain) > 1e-2 and gap(ours) < 1e-5
