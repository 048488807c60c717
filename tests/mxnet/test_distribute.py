"""The central contract on keras-mxnet (Keras 2): data-parallel training on N MXNet contexts is one-context
training at the same global batch, and a saved model is the plain single-device model.

The same assertions as tests/backends/test_distribute.py, written against the Keras 2 API.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.mxnet.harness import CPU_DEVICES, keras  # noqa: F401 (skips without keras-mxnet)
from tests.backends.scenarios import CASES, data

import distkeras
from distkeras import backends, cluster
from distkeras.devices import Device

#: float32 SGD over a few steps: MXNet adds the contexts' gradients in another order than one context
#: adds the samples' (and runs other kernels for other batch shapes), so weights agree to rounding, not
#: bit for bit. Observed differences are below 3e-7.
ATOL = 1e-5
RTOL = 1e-5


def assert_weights_close(expected, actual):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


def build(regularizer=None, seed=0):
    """The scenarios' MLP (5 -> 16 tanh -> 3, SGD 0.1, mse), with weights drawn from a fixed seed."""
    model = keras.models.Sequential(
        [
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer, input_shape=(5,)),
            keras.layers.Dense(3),
        ]
    )
    rng = np.random.RandomState(seed)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(lr=0.1), loss="mse", metrics=["mae"])
    return model


def train(case, devices):
    samples, batch, epochs, regularizer = CASES[case]
    model = build(regularizer)
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
    x, y = data(samples)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights(), history.history


@pytest.fixture(scope="module")
def single_device_runs():
    return {case: train(case, 1) for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("devices", [2, 3])
def test_data_parallel_equals_single_device(single_device_runs, case, devices):
    expected_weights, expected_history = single_device_runs[case]
    weights, history = train(case, devices)
    assert_weights_close(expected_weights, weights)
    # The reported epoch loss and metric are the global batch's, not a plain mean over contexts.
    for name in ("loss", "mean_absolute_error"):
        np.testing.assert_allclose(history[name], expected_history[name], rtol=1e-5)


def test_plain_keras_mxnet_sums_the_contexts_gradients():
    """The fact the adapter corrects: keras-mxnet alone makes every step on N contexts N times as large."""
    import mxnet as mx

    x, y = data(12)
    steps = {}
    for contexts in (1, 3):
        model = build()
        model._context = [mx.cpu(i) for i in range(contexts)]  # what multi_gpu_model does, for CPU contexts
        model.compile(optimizer=keras.optimizers.SGD(lr=0.1), loss="mse")
        before = model.get_weights()
        model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        steps[contexts] = [after - start for after, start in zip(model.get_weights(), before)]
    for one, three in zip(steps[1], steps[3]):
        np.testing.assert_allclose(three, 3 * one, rtol=1e-4, atol=1e-7)


def test_training_actually_moves_the_weights(single_device_runs):
    trained, _ = single_device_runs["even"]
    assert max(float(np.abs(a - b).max()) for a, b in zip(build().get_weights(), trained)) > 1e-2


def mean_prediction(y_true, y_pred):
    # keras-mxnet binds the targets only if the loss uses them: y_true enters with weight 0.
    return keras.backend.mean(y_pred + 0.0 * y_true, axis=-1)


@pytest.mark.parametrize(
    "contexts, samples, batch",
    [
        (3, 101, 10),  # 10 rows split 3+3+4; the last batch, 1 row, is fewer rows than contexts
        (3, 8, 2),  # every batch has fewer rows than contexts
        (4, 30, 6),  # MXNet's rounding splits 6 rows over 4 contexts as 2+2+2+0 and refuses it
    ],
)
def test_every_sample_counts_exactly_once(contexts, samples, batch):
    # One weight per sample: x is the identity, the loss the batch's mean prediction, SGD with lr=1.
    # After one epoch, sample i's weight is -1/B_i (B_i: the size of its batch) exactly when sample i
    # was used once in its step and nothing else was: a dropped sample leaves 0, a sample counted
    # twice (or a padding copy of it that leaked in) moves further, a step weighed by the wrong batch
    # size moves it by another amount.
    distkeras.use_cpu_devices(max(contexts, CPU_DEVICES))
    try:
        model = keras.models.Sequential([keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", input_shape=(samples,))])
        model.compile(optimizer=keras.optimizers.SGD(lr=1.0), loss=mean_prediction)
        model = distkeras.distribute(model, devices=contexts)
        x, y = np.eye(samples, dtype="float32"), np.zeros((samples, 1), "float32")
        history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    finally:
        distkeras.use_cpu_devices(CPU_DEVICES)
    sizes = [min(batch, samples - start) for start in range(0, samples, batch)]
    expected = np.concatenate([np.full(size, -1.0 / size) for size in sizes])
    np.testing.assert_allclose(model.get_weights()[0][:, 0], expected, rtol=1e-6)
    # The epoch loss is the mean over samples of the prediction before each step: all 0.
    assert history.history["loss"] == [0.0]
    # evaluate and predict see every sample once too.
    predictions = model.predict(x, batch_size=batch)
    assert predictions.shape == (samples, 1)
    np.testing.assert_allclose(predictions[:, 0], expected, rtol=1e-6)
    assert model.evaluate(x, y, batch_size=batch, verbose=0) == pytest.approx(float(expected.mean()), rel=1e-5)


def test_sample_weights_weigh_as_on_one_device():
    x, y = data(30)
    weights = np.where(np.arange(30) % 4 == 0, 0.0, np.linspace(0.5, 2.0, 30)).astype("float32")
    single = build()
    expected_history = single.fit(x, y, sample_weight=weights, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    expected = single.get_weights()
    dist = distkeras.distribute(build(), devices=3)
    history = dist.fit(x, y, sample_weight=weights, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close(expected, dist.get_weights())
    # The loss weighs the contexts by samples of nonzero weight, the metric (which ignores sample weights) by rows.
    for name in ("loss", "mean_absolute_error"):
        np.testing.assert_allclose(history[name], expected_history[name], rtol=1e-5, err_msg=name)


def test_generators_and_validation_data():
    # fit_generator with keras' ImageDataGenerator is scenario 2's loop; it needs the getargspec shim.
    from keras.preprocessing.image import ImageDataGenerator

    x, y = data(96)
    images = x.reshape(96, 5, 1, 1).repeat(2, axis=2)

    def image_model():
        model = keras.models.Sequential([keras.layers.Flatten(input_shape=(5, 2, 1)), keras.layers.Dense(3)])
        model.set_weights([np.full((10, 3), 0.1, "float32"), np.zeros(3, "float32")])
        model.compile(optimizer=keras.optimizers.SGD(lr=0.05), loss="mse")
        return model

    # keras-mxnet reads weights back from the model that ran last: each model is read before the next runs.
    single = image_model()
    single.fit(images, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    expected, expected_loss = single.get_weights(), single.evaluate(images, y, batch_size=32, verbose=0)
    dist = distkeras.distribute(image_model(), devices=2)
    flow = ImageDataGenerator().flow(images, y, batch_size=12, shuffle=False)
    history = dist.fit_generator(flow, steps_per_epoch=8, epochs=1, validation_data=(images, y), shuffle=False, verbose=0)
    assert_weights_close(expected, dist.get_weights())
    assert history.history["val_loss"][0] == pytest.approx(expected_loss, rel=1e-5)


def test_distributed_model_keeps_weights_and_compile_config():
    model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(lr=0.0123, beta_1=0.8, clipnorm=0.7),
        loss="mean_absolute_error",
        metrics=["mse", "mape"],
    )
    before = model.get_weights()
    optimizer, optimizer_config = model.optimizer, model.optimizer.get_config()
    compiled = (model.loss, model.metrics, model.metrics_names)
    x, y = data(25)
    expected = model.evaluate(x, y, batch_size=12, verbose=0)
    dist = distkeras.distribute(model, devices=2)
    assert dist is model  # distributed in place
    assert [str(c) for c in model._context] == ["cpu(0)", "cpu(1)"]
    assert_weights_close(before, dist.get_weights())
    assert type(dist.optimizer) is type(optimizer) and dist.optimizer.get_config() == optimizer_config
    assert dist.optimizer.clip_gradient == 0.7  # keras-mxnet's get_config() leaves clipnorm out
    assert (dist.loss, dist.metrics, dist.metrics_names) == compiled
    np.testing.assert_allclose(dist.evaluate(x, y, batch_size=12, verbose=0), expected, rtol=1e-5)


def test_uncompiled_model_predicts_then_compiles_after_distribute():
    model = keras.models.Sequential([keras.layers.Dense(3, input_shape=(5,))])
    model.set_weights([np.ones((5, 3), "float32"), np.zeros(3, "float32")])
    dist = distkeras.distribute(model, devices=3)
    x, y = data(25)
    np.testing.assert_allclose(dist.predict(x, batch_size=12), x.sum(axis=1, keepdims=True).repeat(3, 1), rtol=1e-5, atol=1e-6)
    dist.compile(optimizer="sgd", loss="mse")
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)
    assert not np.allclose(dist.get_weights()[0], 1.0)


def test_a_sequential_starting_with_an_input_layer():
    """Keras 2.2's clone drops an explicit InputLayer; the distributed model must still be built and train."""
    x, y = data(24)
    model = keras.models.Sequential([keras.layers.InputLayer(input_shape=(x.shape[1],)),
                                      keras.layers.Dense(y.shape[1])])
    model.compile(optimizer="sgd", loss="mse")
    dist = distkeras.distribute(model, devices=2)
    before = dist.get_weights()[0].copy()
    np.testing.assert_array_equal(before, model.get_weights()[0])
    dist.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert dist.metrics_names == ["loss"] and not np.allclose(dist.get_weights()[0], before)


def test_one_device_returns_the_model_unchanged(capfd):
    model = build()
    assert distkeras.distribute(model, devices=1) is model
    assert "one device (cpu:0): the model is returned unchanged" in capfd.readouterr().err
    assert distkeras.describe(model)["distributed"] is False


def test_adapter_copes_with_one_context(single_device_runs):
    # keras-mxnet's multi_gpu_model refuses gpus=1; the adapter itself takes one device.
    dist = backends.get("mxnet").distribute(build(), [Device("cpu", 0)], cluster.SINGLE)
    x, y = data(96)
    dist.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(single_device_runs["even"][0], dist.get_weights())


def test_describe():
    dist = distkeras.distribute(build(), devices=["cpu:0", "cpu(2)"])
    assert [str(c) for c in dist._context] == ["cpu(0)", "cpu(2)"]
    assert distkeras.describe(dist) == {
        "backend": "mxnet",
        "devices": ["cpu:0", "cpu:2"],
        "replicas": 2,
        "model_shards": 1,
        "rank": 0,
        "workers": 1,
        "distributed": True,
        "shard": None,
    }


def test_global_batch_size():
    dist = distkeras.distribute(build(), devices=3)
    assert distkeras.global_batch_size(32, dist) == 96
    assert distkeras.global_batch_size(32, devices=2) == 64
    assert distkeras.global_batch_size(16) == 16 * CPU_DEVICES


# Runs in a fresh interpreter without distkeras: plain keras-mxnet. keras-mxnet 2.2.4.3 can't even be
# imported on Python >= 3.10 without the collections aliases Python 3.10 removed, so this script puts
# them back itself, as any keras-mxnet user on a new Python must. It does nothing about h5py: the files
# distkeras writes load as they are.
_RELOAD = """
import collections, collections.abc, json, sys
for name in ("Callable", "Iterable", "Mapping", "MutableMapping", "Sequence"):
    setattr(collections, name, getattr(collections.abc, name))
import numpy as np
import keras
model = keras.models.load_model(sys.argv[1])
plain = keras.models.Sequential([keras.layers.Dense(16, activation="tanh", input_shape=(5,)), keras.layers.Dense(3)])
plain.load_weights(sys.argv[2])
x = np.load(sys.argv[3])
np.save(sys.argv[4], model.predict(x))
np.save(sys.argv[5], plain.predict(x))
print(json.dumps({"distkeras": "distkeras" in sys.modules, "class": type(model).__name__,
                  "layers": [type(layer).__name__ for layer in model.layers],
                  "optimizer": [type(model.optimizer).__name__, model.optimizer.get_config()]}))
"""


def test_saved_model_loads_in_plain_keras_mxnet_without_distkeras(tmp_path):
    model = build()
    model.compile(optimizer=keras.optimizers.RMSprop(lr=0.002, rho=0.8), loss="mse")
    dist = distkeras.distribute(model, devices=2)
    x, y = data(36)
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)
    dist.save(str(tmp_path / "m.h5"))
    dist.save_weights(str(tmp_path / "w.h5"))
    np.save(str(tmp_path / "x.npy"), x)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND="mxnet", PYTHONPATH="")
    paths = [str(tmp_path / name) for name in ("m.h5", "w.h5", "x.npy", "p1.npy", "p2.npy")]
    done = subprocess.run(
        [sys.executable, "-c", _RELOAD] + paths,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, env=env, timeout=300, cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "distkeras": False,
        "class": "Sequential",
        "layers": ["Dense", "Dense"],
        "optimizer": ["RMSprop", json.loads(json.dumps(model.optimizer.get_config()))],
    }
    expected = dist.predict(x)
    np.testing.assert_allclose(np.load(paths[3]), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.load(paths[4]), expected, rtol=1e-5, atol=1e-6)


def fragile_model():
    """The scenarios' MLP whose last layer's get_config() fails once ``fail`` is set: halfway through Keras 2's
    save(), which has opened (and emptied) the target by then."""

    class Fragile(keras.layers.Dense):
        fail = False

        def get_config(self):
            if self.fail:
                raise RuntimeError("failed half-way")
            return super(Fragile, self).get_config()

    model = keras.models.Sequential([keras.layers.Dense(16, activation="tanh", input_shape=(5,)), Fragile(3)])
    model.compile(optimizer=keras.optimizers.SGD(lr=0.1), loss="mse")
    return model


@pytest.mark.parametrize("distributed", [False, True])
def test_a_save_that_fails_half_way_leaves_the_previous_file_and_nothing_else(tmp_path, distributed):
    model = fragile_model()
    if distributed:
        model = distkeras.distribute(model, devices=2)
    path = str(tmp_path / "m.h5")
    model.save(path)
    model.save_weights(str(tmp_path / "w.h5"))
    with open(path, "rb") as f:
        before = f.read()
    model.layers[-1].fail = True
    with pytest.raises(RuntimeError, match="half-way"):
        model.save(path)
    with open(path, "rb") as f:
        kept = f.read() == before
    assert kept == distributed  # plain Keras 2 leaves a truncated file; distkeras' rank 0 the previous one
    assert sorted(os.listdir(str(tmp_path))) == ["m.h5", "w.h5"]  # no temporary file


def test_save_load_distribute_rounds_never_nest(tmp_path):
    model = build()
    x, y = data(24)
    for round_ in range(3):
        model = distkeras.distribute(model, devices=2)
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
        path = str(tmp_path / "round{}.h5".format(round_))
        model.save(path)
        model = keras.models.load_model(path)
        assert [type(layer).__name__ for layer in model.layers] == ["Dense", "Dense"]
        assert len(model.weights) == 4
    assert os.path.getsize(str(tmp_path / "round2.h5")) <= os.path.getsize(str(tmp_path / "round0.h5")) * 1.05


# ---- bad input: a clear error that names what was asked, what exists and what to do


def test_device_that_is_not_there():
    with pytest.raises(distkeras.DeviceSpecError, match=r"You requested cpu:7; this machine has: cpu:0, cpu:1, cpu:2"):
        distkeras.distribute(build(), devices=["cpu:7"])


def test_gpu_that_is_not_there():
    with pytest.raises(distkeras.DeviceSpecError, match=r"You requested gpu:0; this machine has: cpu:0, cpu:1, cpu:2"):
        distkeras.distribute(build(), devices=[0])


def test_more_devices_than_exist():
    with pytest.raises(distkeras.DeviceSpecError, match="You requested 9 devices; this machine has 3"):
        distkeras.distribute(build(), devices=9)


@pytest.mark.parametrize("devices", [0, -2, []])
def test_no_devices(devices):
    with pytest.raises(distkeras.DeviceSpecError, match="Received: devices="):
        distkeras.distribute(build(), devices=devices)


def test_duplicate_devices():
    with pytest.raises(distkeras.DeviceSpecError, match="duplicates: cpu:1"):
        distkeras.distribute(build(), devices=["cpu:1", "cpu(1)"])


def test_unknown_option_names_the_known_ones():
    with pytest.raises(distkeras.OptionError, match=r"Unknown option\(s\) num_quantisation_bits for the mxnet backend\. Options it accepts: compression \(.*\), kvstore"):
        distkeras.distribute(build(), devices=2, num_quantisation_bits=8)


def test_bad_kvstore():
    with pytest.raises(distkeras.OptionError, match=r"Expected kvstore in \('device', 'local'\)\. Received: kvstore='nccl'"):
        distkeras.distribute(build(), devices=2, kvstore="nccl")


def test_local_kvstore_trains_the_same(single_device_runs):
    dist = distkeras.distribute(build(), devices=2, kvstore="local")
    x, y = data(96)
    dist.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(single_device_runs["even"][0], dist.get_weights())


def test_a_worker_outside_an_mxnet_job_is_told_how_to_start_one(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(distkeras.DistKerasError, match=r"not a worker of an MXNet parameter-server job: DMLC_ROLE=None.*"
                                                       r"distkeras launch --backend mxnet"):
        distkeras.distribute(build(), devices=2)


def test_a_scheduler_mxnet_cant_join_is_a_cluster_error_saying_what_to_run(monkeypatch):
    # Pod 1 of 2 of a Kubernetes Indexed Job (what Kubernetes and the pod spec set): no MXNet scheduler or
    # servers exist, so distribute() stops at once with what to run in each pod instead.
    for name in ("RANK", "WORLD_SIZE", "DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("JOB_COMPLETION_INDEX", "1"), ("HOSTNAME", "train-1"), ("DISTKERAS_WORLD_SIZE", "2"),
                        ("DISTKERAS_SERVICE", "svc")):
        monkeypatch.setenv(name, value)
    expected = (r"rank 1 of 2 \(kubernetes: .*JOB_COMPLETION_INDEX=1\), but not a worker of an MXNet parameter-server "
                r"job.*distkeras launch --backend mxnet --nnodes PODS --node-rank \$JOB_COMPLETION_INDEX")
    with pytest.raises(distkeras.ClusterError, match=expected):
        distkeras.distribute(build(), devices=2)


def test_an_unreachable_scheduler_is_a_clear_error(monkeypatch):
    from distkeras.launch import free_port

    port = free_port()  # nobody listens there
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("DMLC_ROLE", "worker")
    monkeypatch.setenv("DMLC_PS_ROOT_URI", "127.0.0.1")
    monkeypatch.setenv("DMLC_PS_ROOT_PORT", str(port))
    monkeypatch.setenv("DISTKERAS_SCHEDULER_TIMEOUT", "1")
    with pytest.raises(distkeras.NetworkError, match=r"MXNet's scheduler at 127\.0\.0\.1:{} .* can't be reached "
                                                     r"after 1 s".format(port)):
        distkeras.distribute(build(), devices=2)


def test_dist_kvstore_in_one_process_is_refused():
    with pytest.raises(distkeras.OptionError, match=r"kvstore='dist_sync' needs MXNet's parameter-server job: start "
                                                    r"the workers with `distkeras launch --backend mxnet"):
        distkeras.distribute(build(), devices=2, kvstore="dist_sync")


def test_unbuilt_model():
    with pytest.raises(distkeras.ModelError, match="not built"):
        distkeras.distribute(keras.models.Sequential([keras.layers.Dense(3)]), devices=2)


def test_not_a_model():
    with pytest.raises(distkeras.ModelError, match="Expected a Keras model"):
        distkeras.distribute(object(), devices=2)


def test_a_layer_is_refused_at_distribute():
    with pytest.raises(distkeras.ModelTypeError, match=r"of type Dense, a Keras layer, not a model"):
        distkeras.distribute(keras.layers.Dense(2), devices=2)


def test_cpu_contexts_can_be_changed_at_any_time():
    # MXNet takes any cpu(i) whenever asked: unlike TensorFlow, there is no "too late".
    distkeras.use_cpu_devices(5)
    try:
        assert [str(d) for d in backends.get("mxnet").list_devices()] == ["cpu:{}".format(i) for i in range(5)]
        assert len(distkeras.distribute(build(), devices=5)._context) == 5
    finally:
        distkeras.use_cpu_devices(CPU_DEVICES)


def test_2bit_compression_quantizes_what_the_contexts_push():
    """compression='2bit' is MXNet's own KVStore gradient compression, read from what training does: with SGD
    (lr 1, no momentum) the first step moves every weight by -lr * (q_0 + q_1), each context's pushed gradient
    q_i quantized to -t, 0 or +t, so every change is a multiple of the threshold t, and not all are zero."""
    threshold = 0.25
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(lr=1.0), loss="mse")
    before = model.get_weights()
    dist = distkeras.distribute(model, devices=2, compression={"type": "2bit", "threshold": threshold})
    x, y = data(8)
    dist.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    changes = np.concatenate([(a - b).ravel() for a, b in zip(dist.get_weights(), before)])
    steps = changes / threshold
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert set(np.round(steps).astype(int)) <= {-2, -1, 0, 1, 2} and np.abs(steps).max() >= 1
    # Uncompressed, the same step moves the weights by amounts that are no multiples of t.
    exact = build()
    exact.compile(optimizer=keras.optimizers.SGD(lr=1.0), loss="mse")
    exact = distkeras.distribute(exact, devices=2)
    exact.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = np.concatenate([(a - b).ravel() for a, b in zip(exact.get_weights(), before)]) / threshold
    assert np.abs(plain - np.round(plain)).max() > 1e-2


def test_2bit_compression_with_error_feedback_still_trains():
    x, y = data(64)
    model = distkeras.distribute(build(), devices=2, compression="2bit")
    history = model.fit(x, y, batch_size=16, epochs=15, shuffle=False, verbose=0).history
    assert history["loss"][-1] < 0.7 * history["loss"][0]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"compression": "bf16"}, r"Expected compression to be None, '2bit' or .*2-bit quantization only .*"
                                   r"Received: compression='bf16'"),
        ({"compression": {"type": "2bit", "threshold": -1}}, "with t > 0"),
        ({"compression": "2bit", "kvstore": "local"}, r"'device' KVStore, not in 'local'"),
    ],
)
def test_bad_compression(options, message):
    with pytest.raises(distkeras.OptionError, match=message):
        distkeras.distribute(build(), devices=2, **options)


def test_a_context_whose_sample_weights_are_all_zero():
    # 6 rows on 3 contexts, rows 0 and 1 (context 0's) weighted 0: Keras' loss on that context is 0/0. It counts
    # for nothing in one context's loss, its gradient and evaluate(), and must not turn them into NaN.
    x, y = data(12)
    weights = np.where(np.arange(12) % 6 < 2, 0.0, 1.5).astype("float32")
    single = build()
    expected_history = single.fit(x, y, sample_weight=weights, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    expected = single.evaluate(x, y, sample_weight=weights, batch_size=6, verbose=0)
    dist = distkeras.distribute(build(), devices=3)
    history = dist.fit(x, y, sample_weight=weights, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close(single.get_weights(), dist.get_weights())
    for name in ("loss", "mean_absolute_error"):
        np.testing.assert_allclose(history[name], expected_history[name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(dist.evaluate(x, y, sample_weight=weights, batch_size=6, verbose=0), expected, rtol=1e-5)


def test_contexts_draw_independent_dropout_masks():
    # One step of a Dropout model on 3 rows of ones, one per context: per unit, how many rows kept it. Contexts
    # drawing alike would make every count 0 or 3; MXNet's CPU contexts draw from one generator in turn, so the
    # masks are independent (not one context's: that draws the 3 rows' masks in one call, which no split repeats).
    from tests.mxnet.cases import dropout_kept, dropout_model

    model = distkeras.distribute(dropout_model(), devices=3)
    model.fit(np.ones((3, 1), "float32"), np.zeros((3, 64), "float32"), batch_size=3, verbose=0)
    kept = dropout_kept(model, 3)
    assert set(kept) <= {0, 1, 2, 3}
    assert int(((kept == 1) | (kept == 2)).sum()) >= 16, kept


def test_workers_calling_fit_differently_are_told_what_each_rank_passed():
    # What every rank of a job raises when their fit() calls differ (here rank 1 has one sample fewer); the job's
    # all-sum is stood in for by one that fills in rank 1's row (tests/mxnet/test_multiworker.py runs it for real).
    from distkeras.backends.mxnet import loops
    from distkeras.errors import ShardError

    class Job(object):
        rank, workers = 0, 2

        def all_sum(self, vector):
            rows = vector.reshape(2, -1, 2).copy()
            rows[1] = rows[0]
            rows[1, 0] = divmod(23 + 1, 4096)
            return rows.ravel()

    with pytest.raises(ShardError) as caught:
        loops._check_same_everywhere(Job(), "fit", [("samples", 24), ("batch_size", 8), ("epochs", 2), ("shuffle", 2),
                                                    ("validation_samples", -1), ("validation_split", 250000)])
    assert str(caught.value) == (
        "Every worker must call fit() with the same full arrays, batch_size, epochs, shuffle, validation_samples and "
        "validation_split (distkeras shards the data itself). "
        "Received (samples, batch_size, epochs, shuffle, validation_samples, validation_split) by rank: "
        "0: (24, 8, 2, 'batch', None, 0.25), 1: (23, 8, 2, 'batch', None, 0.25).")


def test_outputs_weighted_zero_in_other_rows_are_an_error_not_nan():
    # Two outputs; output b's sample weights are 0 in rows 2, 3 of each batch of 4, output a's nowhere: on 2
    # contexts, context 1 has rows of a but none of b, where Keras 2 computes b's loss as 0/0. The step raises before
    # it updates anything (without the check the weights became NaN); one context trains it as Keras does.
    from distkeras.errors import ShardError
    from tests.mxnet.cases import two_outputs

    x, y = data(8)
    weights = [np.ones(8, "float32"), (np.arange(8) % 4 < 2).astype("float32")]
    single = two_outputs(0)
    single.fit(x, [y, y[:, :2]], batch_size=4, epochs=1, shuffle=False, verbose=0, sample_weight=weights)
    assert all(np.isfinite(w).all() for w in single.get_weights())
    model = distkeras.distribute(two_outputs(0), devices=2)
    before = model.get_weights()
    with pytest.raises(ShardError, match=r"context 1 \(cpu\(1\)\) has rows of nonzero sample weight for output 'a' "
                                         r"but none for output 'b'"):
        model.fit(x, [y, y[:, :2]], batch_size=4, epochs=1, shuffle=False, verbose=0, sample_weight=weights)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ShardError):
        model.evaluate(x, [y, y[:, :2]], batch_size=4, verbose=0, sample_weight=weights)
