"""TensorFlow: code as the Keras examples write it trains on N replicas what it trains on one device.

Random layers (regularization and augmentation) and ``keras.random`` draws, a loss function returning a
scalar, ``add_loss``, a ``reduction="sum"`` loss, sparse (gather) gradients under Adam (token ids and a
position embedding's ``arange``), losses written by hand in a custom step with a custom ``test_step``, a
custom step returning its metrics' results (the distillation example), a conv net whose batches are smaller
than the replica count, and the Keras guide's GAN with optimizers of its own:
at N=3 (and N=2 in the full run, DISTKERAS_FULL_TESTS=1) the weights, every optimizer's variables, the History
and ``evaluate()`` equal one device's at the same global batch. 50 samples at batch 12: the last batch of 2 leaves a replica empty on
3 devices (the GAN's Mean trackers, updated with the step's scalar loss, are weighed by each replica's rows:
one device's value on uneven splits too; the custom steps, which also log a raw scalar of their own, use 48).
"""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.full import only_in_full

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow adapter tests (KERAS_BACKEND=tensorflow)")
ops = keras.ops
SAMPLES, BATCH, TOLERANCE = 50, 12, 1e-5  # 5 steps: 12 x 4, then 2 (1+1, or 1+1+0)


def data(features=5, outputs=1, samples=SAMPLES):
    rng = np.random.default_rng(1)
    return rng.normal(size=(samples, features)).astype("float32"), rng.normal(size=(samples, outputs)).astype("float32")


def train(build, devices, x, y, epochs=1, batch_size=BATCH):
    model = build()
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
        assert model.distribute_strategy.num_replicas_in_sync == devices
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history
    result = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    optimizers = [o for o in vars(model).values() if isinstance(o, keras.optimizers.Optimizer)]
    slots = [np.array(v) for o in [model.optimizer] + optimizers if o is not None for v in o.variables]
    return [np.array(w) for w in model.weights], slots, history, result


def assert_same(expected, actual, tolerance=TOLERANCE):
    weights, slots, history, result = expected
    weights_n, slots_n, history_n, result_n = actual
    assert len(weights) == len(weights_n) and len(slots) == len(slots_n) > 0
    for e, a in zip(weights + slots, weights_n + slots_n):
        np.testing.assert_allclose(a, e, rtol=tolerance, atol=tolerance)
    assert sorted(history) == sorted(history_n)
    for key in history:
        np.testing.assert_allclose(history_n[key], history[key], rtol=tolerance, atol=tolerance, err_msg=key)
    for key in result:
        np.testing.assert_allclose(result_n[key], result[key], rtol=tolerance, atol=tolerance, err_msg=key)


@pytest.fixture(params=[
    pytest.param(2, marks=only_in_full("N=3 runs every case: its last batch of 2 leaves a replica empty, and batches "
                                       "of 12 split 4+4+4 where N=2 splits them 6+6")),
    3,
])
def devices(request):
    """The replica count the examples' code runs at against one device: 3, and 2 too in the full run."""
    return request.param


def assert_exact(build, x, y, devices, **kwargs):
    expected = train(build, 1, x, y, **kwargs)
    assert max(float(np.abs(a - b).max()) for a, b in zip(expected[0], [np.array(w) for w in build().weights])) > 1e-3
    assert_same(expected, train(build, devices, x, y, **kwargs))


# A. Random draws --------------------------------------------------------------------------------------

class Noisy(keras.layers.Layer):
    """A custom layer drawing noise of its input's shape from a seed generator of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x, training=False):
        if training:
            return x + 0.5 * keras.random.normal(shape=ops.shape(x), seed=self.seed_generator)
        return x


def test_random_layers_draw_what_one_device_draws(devices):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(0.5), keras.layers.GaussianNoise(0.5),
                                  keras.layers.GaussianDropout(0.3), Noisy(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
        return model

    x, y = data()
    assert_exact(build, x, y, devices)


def test_augmentation_layers_and_spatial_dropout_draw_what_one_device_draws(devices):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.RandomFlip(), keras.layers.RandomRotation(0.2),
                                  keras.layers.RandomZoom(0.2), keras.layers.SpatialDropout2D(0.3),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    x = np.random.default_rng(0).normal(size=(SAMPLES, 6, 6, 1)).astype("float32")
    assert_exact(build, x, data()[1], devices)


def test_random_functions_draw_one_devices_rows():
    """Each keras.random function, drawn in a replica step, against the same draw on one device."""
    import tensorflow as tf

    x = np.arange(10 * 3, dtype="float32").reshape(10, 3)  # split 4+4+2 over 3 replicas

    def draws(x, seed=3):
        shape = ops.shape(x)
        return {
            "normal": keras.random.normal(shape, seed=seed),
            "uniform": keras.random.uniform(shape, seed=seed),
            "truncated_normal": keras.random.truncated_normal(shape, seed=seed),
            "randint": keras.random.randint(shape, 0, 100, seed=seed),
            "dropout": keras.random.dropout(x + 1.0, 0.5, seed=seed),
            "gamma": keras.random.gamma(shape, 2.0, seed=seed),
            "binomial": keras.random.binomial(shape, 5.0, 0.3, seed=seed),
            "beta": keras.random.beta(shape, 2.0, 3.0, seed=seed),
            "not_batch": keras.random.normal((7,), seed=seed),
        }

    expected = {k: np.array(v) for k, v in draws(x).items()}
    model = distkeras.distribute(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), devices=3)
    strategy = model.distribute_strategy
    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(10))
    got = strategy.run(draws, args=(next(iter(batches)),))
    for name, value in expected.items():
        parts = [np.array(v) for v in strategy.experimental_local_results(got[name])]
        if name == "not_batch":
            for part in parts:
                np.testing.assert_allclose(part, value, rtol=1e-6)
        else:
            np.testing.assert_allclose(np.concatenate(parts), value, rtol=1e-6, err_msg=name)


# B. A loss function returning a scalar, add_loss -----------------------------------------------------

def scalar_mse(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred))


class Penalised(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * ops.mean(ops.square(x)))
        return x


def test_a_loss_function_returning_a_scalar_and_add_loss(devices):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), Penalised(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=scalar_mse, metrics=["mae"])
        return model

    x, y = data()
    assert_exact(build, x, y, devices)


def test_a_loss_with_sum_reduction(devices):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.002), loss=keras.losses.MeanSquaredError(reduction="sum"))
        return model

    x, y = data()
    assert_exact(build, x, y, devices)


# C. Sparse gradients ----------------------------------------------------------------------------------

def test_adam_on_embedding_gradients(devices):
    """Keras' TensorFlow optimizers get a gather's gradient as IndexedSlices, one slice per lookup, and Adam
    squares each slice apart: the replicas' slices must reach it as such (concatenated), not summed dense."""
    def build():
        keras.utils.set_random_seed(0)
        ids = keras.Input((4,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(6, 3)(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        return model

    # Few ids, so the replicas' batches share rows of the table (their slices overlap).
    x = np.random.default_rng(2).integers(0, 6, size=(SAMPLES, 4)).astype("int32")
    y = data()[1]
    assert_exact(build, x, y, devices)


class TokenAndPosition(keras.layers.Layer):
    """The Keras text-transformer example's embedding: token ids from the batch, positions from arange."""

    def __init__(self):
        super().__init__()
        self.token_emb = keras.layers.Embedding(6, 3)
        self.pos_emb = keras.layers.Embedding(4, 3)

    def call(self, x):
        return self.token_emb(x) + self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))


@pytest.mark.parametrize("samples", [SAMPLES, 48], ids=["a short last batch", "whole batches"])
def test_adam_on_a_position_embedding(devices, samples):
    """A gather whose indices are no sample's (``arange(maxlen)``, the same on every replica) gives one
    device one slice per position with the whole batch's sum: the replicas' values are summed under those
    indices (concatenated, Adam would square each replica's part apart), the token ids' slices still
    concatenated."""
    def build():
        keras.utils.set_random_seed(0)
        ids = keras.Input((4,), dtype="int32")
        hidden = keras.layers.Flatten()(TokenAndPosition()(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        return model

    x = np.random.default_rng(2).integers(0, 6, size=(samples, 4)).astype("int32")
    # Whole batches of 12 on 3 replicas: each replica's batch has 4 rows, as many as arange(4) has positions (a
    # static shape: the position indices are no sample's, and still not mistaken for a row per sample).
    assert_exact(build, x, data(samples=samples)[1], devices)


class PerSamplePositions(keras.layers.Layer):
    """Positions looked up once per sample, the usual ways a GPT or an encoder writes them (issue 52): with NumPy
    input the batch's shape is static, so in the traced step these indices are constants, the same on every replica,
    and still one lookup per sample."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.token_emb = keras.layers.Embedding(6, 3)
        self.pos_emb = keras.layers.Embedding(4, 3)

    def call(self, x):
        tokens = self.token_emb(x)
        if self.how == "keras_hub":  # a slice of its table, broadcast: a dense gradient
            return tokens + self.hub(tokens)
        if self.how == "cumsum":
            positions = ops.cumsum(ops.ones_like(x), axis=-1) - 1
        else:
            positions = ops.broadcast_to(ops.arange(0, ops.shape(x)[-1], 1), ops.shape(x))
        return tokens + self.pos_emb(positions)

    def build(self, shape):
        if self.how == "keras_hub":
            import keras_hub

            self.hub = keras_hub.layers.PositionEmbedding(sequence_length=4)


@pytest.mark.parametrize("how, rate", [("cumsum", "constant"), ("cumsum", "warm-up"), ("broadcast arange", "constant"),
                                       ("keras_hub", "constant")])
def test_adam_on_positions_looked_up_per_sample_from_numpy_input(devices, how, rate):
    """``cumsum(ones_like(inputs)) - 1`` trained to other weights than one device on NumPy input: the indices don't
    depend on the batch in the traced step (ones_like of a static shape is a constant), so they were summed under
    replica 0's as a position embedding's ``arange`` is. They have a row per sample: concatenated now. Behind a
    warm-up from 0 too, and KerasHub's PositionEmbedding."""
    def build():
        keras.utils.set_random_seed(0)
        ids = keras.Input((4,), dtype="int32")
        hidden = keras.layers.Flatten()(PerSamplePositions(how)(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(hidden))
        schedule = 0.05 if rate == "constant" else keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=8, warmup_target=0.05, warmup_steps=3)
        model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
        return model

    x = np.random.default_rng(2).integers(0, 6, size=(48, 4)).astype("int32")  # whole batches: a static shape
    assert_exact(build, x, data(samples=48)[1], devices)


@pytest.mark.parametrize("how", ["ignore_class", "mask"])
def test_a_mean_over_kept_entries_weighs_each_replica_by_its_kept_entries(devices, how):
    """``SparseCategoricalCrossentropy(ignore_class=0)`` and a loss masked by the Embedding's ``mask_zero`` average
    over each replica's kept entries: weighed by rows, the replicas trained ~4e-3 away from one device (issue 52)."""
    from tests.backends import torch_cases

    def build():
        keras.utils.set_random_seed(0)
        return torch_cases.masked(keras, how)

    x, y = torch_cases.tokens(SAMPLES)
    assert_exact(build, x, y, devices)


def test_a_batch_size_fixed_in_call_is_told_to_take_it_from_the_input():
    """Issue 52: a draw of the global batch's size in call() (a diffusion model's noise) failed with Keras' raw
    "Dimensions must be equal, but are 4 and 8"."""
    from tests.backends import torch_cases

    model = distkeras.distribute(torch_cases.diffusion(keras), devices=2)
    x, y = data(features=4, samples=16)
    with pytest.raises(ValueError) as caught:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "Dimensions must be equal" in str(caught.value)
    assert "each replica runs its share of the global batch: 4 of its 8 rows here" in str(caught.value)
    assert "keras.ops.shape(x)[0]" in str(caught.value)


# D. Losses written by hand in a custom step, a custom test_step ---------------------------------------

class HandWritten(keras.Model):
    """The Keras guide's GradientTape step, the loss a Loss object called by hand or written with ops."""

    def __init__(self, by_ops=False, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.by_ops = by_ops
        self.loss_fn = keras.losses.MeanSquaredError()
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.loss_tracker]

    def loss_of(self, y, y_pred):
        return ops.mean(ops.square(y - y_pred)) if self.by_ops else self.loss_fn(y, y_pred)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_of(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result(), "step_loss": loss}

    def test_step(self, data):
        x, y = data
        loss = self.loss_of(y, self(x, training=False))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result(), "step_loss": loss}


@pytest.mark.parametrize("by_ops", [False, True], ids=["Loss-object", "ops"])
def test_a_loss_written_by_hand_in_a_custom_step(by_ops, devices):
    def build():
        keras.utils.set_random_seed(0)
        model = HandWritten(by_ops=by_ops)
        model(np.zeros((1, 5), "float32"))
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        return model

    # The step's own unweighted per-batch values are averaged over replicas: exact where batches split evenly.
    x, y = data(samples=48)
    assert_exact(build, x, y, devices)


class Tracked(keras.Model):
    """The Keras distillation example's steps: compiled metrics a custom step updates through
    ``self.metrics`` and returns as ``{m.name: m.result()}``, with a per-batch loss of its own."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, x):
        return self.dense(x)

    def tracked(self, y, y_pred, loss):
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(y, y_pred)
        results = {m.name: m.result() for m in self.metrics if m.name != "loss"}
        results["step_loss"] = loss
        return results

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_of(y, y_pred)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return self.tracked(y, y_pred, loss)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self.tracked(y, y_pred, self.loss_of(y, y_pred))


def test_a_custom_step_returning_metric_results(devices):
    """Its returned metric results are the global results (Keras builds the compiled metrics after
    distribute(), in a stateless scope: they must be mirrored too), its own per-batch loss the global
    batch's: History and evaluate() are one device's, tails of 2 (1+1, 1+1+0) included."""
    def build():
        keras.utils.set_random_seed(0)
        model = Tracked()
        model(np.zeros((1, 5), "float32"))
        model.compile(optimizer=keras.optimizers.Adam(0.05), metrics=[keras.metrics.SparseCategoricalAccuracy()])
        return model

    x, _ = data()
    y = (np.arange(SAMPLES) % 3).astype("int32")
    assert_exact(build, x, y, devices, epochs=2)


def test_a_conv_net_with_batches_smaller_than_the_replica_count(devices):
    """fit() and evaluate() with batches 5, 5, 1 (the last leaves a replica without rows) run an empty
    replica's convolutions and poolings with the right output shapes (TensorFlow's oneDNN Conv2D returns an
    empty input unchanged; its MaxPool gradient aborts on one) and train one device's numbers."""
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(4, 2, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        return model

    x = np.random.default_rng(2).normal(size=(11, 8, 8, 1)).astype("float32")
    assert_exact(build, x, data(samples=11)[1], devices, batch_size=5)


# E. A GAN with optimizers of its own (the Keras guide's) ------------------------------------------------

class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        import tensorflow as tf

        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        # The guide's label noise: drawn over the two batches concatenated.
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def build_gan():
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)])
    gan = GAN(discriminator, generator, latent_dim=3)
    gan.compile(d_optimizer=keras.optimizers.Adam(0.01), g_optimizer=keras.optimizers.Adam(0.01),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def train_gan(devices, x):
    gan = build_gan()
    if devices > 1:
        gan = distkeras.distribute(gan, devices=devices)
    history = gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    state = [np.array(v) for v in gan.weights + gan.d_optimizer.variables + gan.g_optimizer.variables]
    return state, history


def test_a_gan_with_optimizers_of_its_own(devices):
    x = np.random.default_rng(3).normal(size=(SAMPLES, 6)).astype("float32")
    state, history = train_gan(1, x)
    state_n, history_n = train_gan(devices, x)
    assert len(state_n) == len(state)
    for e, a in zip(state, state_n):
        np.testing.assert_allclose(a, e, rtol=TOLERANCE, atol=TOLERANCE)
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(history_n[key], history[key], rtol=TOLERANCE, atol=TOLERANCE)


def test_the_keras_privates_the_loss_and_random_rules_rely_on():
    """tensorflow/steps.py replaces functions of Keras' modules; a Keras that moves them fails here, by name."""
    import inspect

    from keras.src import backend
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import compile_utils

    distkeras.distribute(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), devices=2)
    # The loss rule: Keras' two functions, looked up on their module at call time by every caller.
    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        assert getattr(getattr(loss_module, name), "_distkeras_gated", False), name
    assert loss_module.reduce_values.__wrapped__.__globals__ is vars(loss_module)
    assert loss_module.reduce_weighted_values.__globals__ is vars(loss_module)
    trainer = next(c for c in keras.Model.__mro__ if "_aggregate_additional_loss" in vars(c))
    assert loss_module.reduce_values._distkeras_gated
    weighted = inspect.getsource(loss_module.reduce_weighted_values)
    assert "loss = reduce_values(values, sample_weight, reduction)" in weighted
    # The masked-mean rule: apply_mask, looked up as a module global by reduce_weighted_values; its weight for the
    # kept entries is entries / kept, and the masked losses reach it through Loss.__call__.
    assert loss_module.apply_mask._distkeras_gated and "sample_weight = apply_mask(" in weighted
    assert "mask_weight = ops.divide_no_nan(total, valid)" in inspect.getsource(loss_module.apply_mask.__wrapped__)
    assert "reduce_weighted_values(" in inspect.getsource(loss_module.Loss.__call__)
    for source in (inspect.getsource(trainer), inspect.getsource(compile_utils)):
        assert "loss_module.unscale_loss_for_distribution(" in source
    assert "loss_module.scale_loss_for_distribution(" in inspect.getsource(trainer)
    # The random rule: the TensorFlow backend's random module, its functions' signatures, and the layers
    # reaching it through ``backend.random``.
    module = backend.random
    assert module.__name__.endswith("tensorflow.random") and module._distkeras_patched
    for name in ("normal", "uniform", "truncated_normal", "randint", "gamma", "binomial", "beta"):
        assert list(inspect.signature(getattr(module, name).__wrapped__).parameters)[0] == "shape", name
    assert list(inspect.signature(module.dropout.__wrapped__).parameters) == ["inputs", "rate", "noise_shape", "seed"]
    assert list(inspect.signature(module.categorical.__wrapped__).parameters)[:2] == ["logits", "num_samples"]
    assert callable(module._get_concrete_noise_shape)
    from keras.src.layers.regularization import dropout, gaussian_noise

    assert "backend.random.dropout(" in inspect.getsource(dropout)
    assert "backend.random.normal(" in inspect.getsource(gaussian_noise)
    # Convolutions of an empty replica: the TensorFlow backend's functions, called through ``backend.nn``.
    from keras.src.backend.tensorflow import nn
    from keras.src.ops import nn as ops_nn

    for name in ("conv", "depthwise_conv", "separable_conv", "conv_transpose"):
        assert callable(getattr(nn, name).__wrapped__), name
        assert "backend.nn.{}(".format(name) in inspect.getsource(ops_nn), name
    # A custom step's metric results: Keras' stateless_result reads the variables given.
    assert list(inspect.signature(keras.metrics.Metric.stateless_result).parameters) == ["self", "metric_variables"]
