"""TensorFlow: transfer learning, shuffled datasets and TensorFlow's own random ops train what one device trains.

- A layer frozen when ``distribute()`` runs and unfrozen later (the transfer-learning guide's fine-tuning step)
  moves as on one device; a layer frozen after ``distribute()`` stops moving.
- A shuffling pipeline (``tf.data`` ``.shuffle()``, a ``PyDataset`` under fit's ``shuffle=True``) gives the
  distributed fit the order it gives one device: nothing draws a batch training doesn't use. An empty validation
  dataset warns, as on one device.
- ``tf.random.*`` in a custom ``train_step`` (keras-io's WGAN-GP draws its latent vectors and its interpolation
  weights so) draws one device's values for each replica's rows: stateless ops, and stateful ops with an op seed.
"""


import warnings

import numpy as np
import pytest

from tests.backends.harness import BACKEND, BatchLogs, keras

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow adapter tests (KERAS_BACKEND=tensorflow)")
TOLERANCE = 1e-5


def _data(samples=24, features=4, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(samples, features)).astype("float32"), rng.normal(size=(samples, 1)).astype("float32")


def _weights(model):
    return [np.array(w) for w in model.weights]


def _assert_same(expected, got, tolerance=TOLERANCE):
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        np.testing.assert_allclose(g, e, rtol=tolerance, atol=tolerance, err_msg="weight {}".format(i))


def _distributed(model, devices):
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
        assert model.distribute_strategy.num_replicas_in_sync == devices
    return model


# 1. Trainability follows the layer's flag after distribute() ----------------------------------------------------

def _fine_tune(devices):
    """The transfer-learning guide's two phases: a frozen base under a new head, then the whole model fine-tuned."""
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)],
                            name="base")
    base.trainable = False
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(base(inputs, training=False))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = _distributed(model, devices)
    x, y = _data()
    initial = _weights(base)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    frozen = _weights(base)
    base.trainable = True
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return initial, frozen, _weights(model), _weights(base)


def test_a_layer_frozen_at_distribute_fine_tunes_once_unfrozen():
    expected = _fine_tune(1)
    got = _fine_tune(2)
    _assert_same(got[0], got[1], 0)  # frozen: the base didn't move in the first phase
    assert max(float(np.abs(a - b).max()) for a, b in zip(expected[1], expected[3])) > 1e-3  # one device fine-tunes
    _assert_same(expected[2], got[2])


def _freeze_after(devices):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model = _distributed(model, devices)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    frozen = _weights(model.layers[0])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return frozen, _weights(model.layers[0]), _weights(model)


def test_a_layer_frozen_after_distribute_stops_moving():
    expected = _freeze_after(1)
    got = _freeze_after(2)
    _assert_same(got[0], got[1], 0)
    _assert_same(expected[2], got[2])


# 2. No batch drawn that training doesn't use --------------------------------------------------------------------

def _small_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def _fit_shuffled_tf_data(devices):
    import tensorflow as tf

    model = _distributed(_small_model(), devices)
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(24, seed=5, reshuffle_each_iteration=True).batch(6)
    history = model.fit(dataset, epochs=2, verbose=0).history
    return _weights(model), history


class _Batches(keras.utils.PyDataset):
    """A PyDataset of 4 batches of 6 (keras-io's ``Sequence`` pattern); fit()'s default shuffle=True reorders them."""

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // 6)

    def __getitem__(self, index):
        return self.x[index * 6:(index + 1) * 6], self.y[index * 6:(index + 1) * 6]


def _fit_shuffled_py_dataset(devices):
    model = _distributed(_small_model(), devices)
    # One epoch: the defect was a first epoch trained on the second permutation. Later epochs of a PyDataset
    # under MirroredStrategy vary from run to run on TensorFlow 2.21 though the batch order drawn is the same (a
    # from_generator dataset's epoch end; not this defect), which this test doesn't cover.
    history = model.fit(_Batches(*_data(22)), epochs=1, verbose=0).history  # shuffle=True: Python's random, seeded
    return _weights(model), history


def _fit_shuffled_torch_loader(devices):
    torch = pytest.importorskip("torch")
    model = _distributed(_small_model(), devices)
    x, y = _data(22)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=6,
                                         shuffle=True, generator=torch.Generator().manual_seed(3))
    history = model.fit(loader, epochs=1, verbose=0).history  # one epoch: see _fit_shuffled_py_dataset
    return _weights(model), history


@pytest.mark.parametrize("fit", [_fit_shuffled_tf_data, _fit_shuffled_py_dataset, _fit_shuffled_torch_loader],
                         ids=["tf.data", "PyDataset", "torch DataLoader"])
def test_a_shuffling_dataset_trains_on_the_order_one_device_trains_on(fit):
    weights, history = fit(1)
    weights_n, history_n = fit(2)
    _assert_same(weights, weights_n)
    for key in history:
        np.testing.assert_allclose(history_n[key], history[key], rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)


def _fit_with_empty_validation(devices):
    import tensorflow as tf

    model = _distributed(_small_model(), devices)
    x, y = _data()
    empty = tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=6, epochs=1, shuffle=False, validation_data=empty, verbose=0).history
    return _weights(model), history, sorted({str(w.message).split("\n")[0] for w in caught})


def test_an_empty_validation_dataset_warns_as_on_one_device():
    weights, history, said = _fit_with_empty_validation(1)
    weights_n, history_n, said_n = _fit_with_empty_validation(2)
    _assert_same(weights, weights_n)
    assert sorted(history_n) == sorted(history)
    assert said_n == said


def test_the_build_reads_the_distributed_datasets_spec():
    """Pins Keras' private ``TFEpochIterator._distributed_dataset``, whose ``element_spec`` the build reads."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    model = _distributed(_small_model(), 2)
    x, y = _data()
    iterator = TFEpochIterator(x=x, y=y, batch_size=6, distribute_strategy=model.distribute_strategy)
    spec = iterator._distributed_dataset.element_spec
    assert [tuple(s.shape)[1:] for s in spec[0]._value_specs] == [(4,), (4,)]  # one spec per replica


# 3. TensorFlow's random ops in a custom train_step ---------------------------------------------------------------

class _WGANGP(keras.Model):
    """keras-io's WGAN-GP, tiny: latent vectors and interpolation weights drawn with ``tf.random`` in train_step,
    a gradient penalty through a nested tape, optimizers of its own given to its ``compile()``."""

    def __init__(self, critic, generator, latent_dim, draws):
        super().__init__()
        self.critic, self.generator, self.latent_dim, self.draws = critic, generator, latent_dim, draws

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def gradient_penalty(self, batch_size, real, fake):
        import tensorflow as tf

        alpha = self.draws["alpha"](tf, [batch_size, 1], self.d_optimizer.iterations)
        interpolated = real + alpha * (fake - real)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.critic(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real):
        import tensorflow as tf

        if isinstance(real, tuple):
            real = real[0]
        batch_size = tf.shape(real)[0]
        for _ in range(2):  # the critic's extra steps
            latent = self.draws["latent"](tf, (batch_size, self.latent_dim), self.d_optimizer.iterations)
            with tf.GradientTape() as tape:
                fake = self.generator(latent, training=True)
                d_cost = tf.reduce_mean(self.critic(fake, training=True)) - tf.reduce_mean(self.critic(real, training=True))
                d_loss = d_cost + 10.0 * self.gradient_penalty(batch_size, real, fake)
            grads = tape.gradient(d_loss, self.critic.trainable_variables)
            self.d_optimizer.apply_gradients(zip(grads, self.critic.trainable_variables))
        latent = self.draws["generator"](tf, (batch_size, self.latent_dim), self.g_optimizer.iterations)
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.critic(self.generator(latent, training=True), training=True))
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


#: How the draws are written: TensorFlow's stateless functions (a seed of the step), stateful ones with an op seed.
_DRAWS = {
    "stateless": {
        "latent": lambda tf, shape, step: tf.random.stateless_normal(shape, seed=tf.stack([tf.cast(step, "int32"), 1])),
        "alpha": lambda tf, shape, step: tf.random.stateless_uniform(shape, seed=tf.stack([tf.cast(step, "int32"), 2])),
        "generator": lambda tf, shape, step: tf.random.stateless_truncated_normal(shape, seed=[3, 4]),
    },
    "op seed": {
        "latent": lambda tf, shape, step: tf.random.normal(shape, seed=7),
        "alpha": lambda tf, shape, step: tf.random.uniform(shape, 0.0, 1.0, seed=11),
        "generator": lambda tf, shape, step: tf.random.truncated_normal(shape, seed=13),
    },
}


def _train_wgan(devices, draws):
    keras.utils.set_random_seed(0)
    critic = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    model = _WGANGP(critic, generator, 3, _DRAWS[draws])
    model.compile(d_optimizer=keras.optimizers.Adam(0.01, beta_1=0.5), g_optimizer=keras.optimizers.Adam(0.01, beta_1=0.5))
    model = _distributed(model, devices)
    history = model.fit(_data()[0], batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return _weights(critic) + _weights(generator), history


@pytest.mark.parametrize("draws", sorted(_DRAWS))
def test_tf_random_in_a_custom_train_step_draws_one_devices_rows(draws):
    weights, history = _train_wgan(1, draws)
    weights_n, history_n = _train_wgan(2, draws)
    _assert_same(weights, weights_n, 1e-4)
    for key in history:
        np.testing.assert_allclose(history_n[key], history[key], rtol=1e-4, atol=1e-4, err_msg=key)


# 4. Per-batch logs of Keras' own steps are one device's ------------------------------------------------------------

def _classifier_batch_logs(devices, **options):
    """A classifier with ratio and count metrics, a batch of 10 (3 replicas: 4 + 3 + 3 rows): every batch's logs."""
    keras.utils.set_random_seed(3)
    x, _ = _data(samples=40)
    y = (x[:, :1] + 0.3 * x[:, 1:2] > 0).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                           keras.metrics.TruePositives(name="tp")])
    if devices > 1:
        model = distkeras.distribute(model, devices=devices, **options)
    logs = BatchLogs()
    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0, callbacks=[logs])
    model.evaluate(x, y, batch_size=10, verbose=0, callbacks=[logs])
    return logs


@pytest.mark.parametrize("devices", [2, 3])
def test_per_batch_logs_of_keras_own_steps_are_one_devices(devices):
    """Each replica's own AUC, precision or count averaged over the replicas is not one device's (counts came out
    halved, AUC 0.517 against 0.469 in keras-io's speaker recognition): a callback's batch logs, and the progress
    bar's, are the global batch's, for fit() and evaluate()."""
    single, distributed = _classifier_batch_logs(1), _classifier_batch_logs(devices)
    for want, got in ((single.train, distributed.train), (single.test, distributed.test)):
        assert len(want) == len(got) == 4
        for step, (w, g) in enumerate(zip(want, got)):
            assert sorted(w) == sorted(g)
            for key in w:
                np.testing.assert_allclose(g[key], w[key], rtol=1e-5, atol=1e-6, err_msg="{} {}".format(step, key))


def test_batch_logs_local_keeps_keras_own_average_and_the_check_compares_metrics_by_result():
    """``batch_logs="local"``: Keras' own per-batch logs (each replica's result, averaged: the true positives come
    out halved), no all-reduce for them; the one-device check, on, doesn't hold that against the step (it compares
    the metrics by result) and raises nothing. A value that is neither is refused."""
    single = _classifier_batch_logs(1)
    local = _classifier_batch_logs(2, batch_logs="local", verify=True)
    assert any(abs(g["tp"] - w["tp"]) > 0.1 for w, g in zip(single.train, local.train))
    with pytest.raises(distkeras.OptionError, match="batch_logs"):
        distkeras.distribute(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), devices=2, batch_logs="all")


# 4. A model built outside the scope after distribute() -----------------------------------------------------------

def _called_before_fit(devices, build_optimizer):
    """integration_tests/basic_full_flow.py's order: a subclassed model, unbuilt, compiled and distributed, called
    eagerly on the data (``model(x)``: its layers' variables are created then, outside the strategy's scope) and then
    fitted; optionally with its optimizer built by hand from those variables before fit()."""
    keras.utils.set_random_seed(3)

    class TwoDense(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = keras.layers.Dense(6, activation="relu"), keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

    model = TwoDense()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model = _distributed(model, devices)
    x, y = _data()
    before = np.array(model(x))
    if build_optimizer:
        model.optimizer.build(model.trainable_variables)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return before, history.history["loss"], _weights(model), np.array(model.predict(x, batch_size=8, verbose=0))


@pytest.mark.parametrize("build_optimizer", [False, True], ids=["called", "called-and-optimizer-built"])
def test_a_model_first_called_after_distribute_trains_as_one_device(build_optimizer):
    """Keras refused the first step ("Unknown variable ... the variables it was originally built with"): the
    variables created by the eager call were mirrored after the optimizer had keyed its slots by their old storage."""
    single, distributed = _called_before_fit(1, build_optimizer), _called_before_fit(2, build_optimizer)
    np.testing.assert_allclose(distributed[0], single[0], rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(distributed[1], single[1], rtol=TOLERANCE, atol=TOLERANCE)
    _assert_same(single[2], distributed[2])
    np.testing.assert_allclose(distributed[3], single[3], rtol=TOLERANCE, atol=TOLERANCE)


# 5. predict_on_batch() and steps_per_execution ---------------------------------------------------------------------

def _on_batch_and_executions(devices, steps_per_execution):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=steps_per_execution)
    model = _distributed(model, devices)
    x, y = _data(30)
    batches = []
    counted = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(batch))
    history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0, callbacks=[counted])
    return {"weights": _weights(model), "loss": history.history["loss"], "batches": batches,
            "evaluate": model.evaluate(x, y, batch_size=6, verbose=0),
            "predict": np.array(model.predict(x, batch_size=6, verbose=0)),
            "on_batch": np.array(model.predict_on_batch(x[:7]))}


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_predict_on_batch_and_executions_of_several_steps_are_one_devices(steps_per_execution):
    """predict_on_batch() returned every row once per replica (14 rows for 7 on 2 replicas): Keras hands the
    batch whole to every replica. fit() with steps_per_execution=3 raised "You must feed a value for placeholder
    tensor 'while/cond/Placeholder_N'" (Keras' while loop of strategy.run, plain Keras in strategy.scope() too);
    the execution's steps now run one call each, 5 steps an epoch in executions of 3 and 2, the callbacks at
    Keras' cadence."""
    single = _on_batch_and_executions(1, steps_per_execution)
    distributed = _on_batch_and_executions(2, steps_per_execution)
    assert distributed["on_batch"].shape == single["on_batch"].shape == (7, 1)
    assert distributed["batches"] == single["batches"]
    _assert_same(single["weights"], distributed["weights"])
    for key in ("loss", "evaluate", "predict", "on_batch"):
        np.testing.assert_allclose(distributed[key], single[key], rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)
