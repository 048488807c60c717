"""Real code for the real-code suite (``test_realcode.py``): the official Keras examples and guides, shrunk.

Each program is written the way its keras.io example or guide writes it (same layers, same custom
steps, same compile() arguments, same fit/evaluate/predict calls), only tiny: generated data instead of
downloads, small widths, a few steps. Programs that override ``train_step``/``test_step`` do it the way
the guide for the running backend does: TensorFlow a ``tf.GradientTape``, JAX a stateless step
(``stateless_call``/``StatelessScope`` + ``stateless_apply``), PyTorch ``zero_grad()``/``backward()``/
``optimizer.apply()``.

A program is ``name(devices, perturb=False)``: it seeds Keras (``keras.utils.set_random_seed``), builds
its model, adds the one line a user adds (``model = distkeras.distribute(model, devices)`` when
``devices > 1``), trains, and returns :func:`result`: plain data (every weight, every variable of every
optimizer the model holds, the History, evaluate()'s and predict()'s results, the replicas the framework
reports). ``perturb=True`` alters one training sample on a distributed run only: the test that shows the
suite can fail.
"""

import os
import shutil
import tempfile

import numpy as np

from tests.backends.patterns import replicas_seen

BATCH = 12  # the global batch: 2 and 3 replicas divide it
EVAL_BATCH = 5  # mnist_convnet's evaluate()/predict() batch: 11 samples make batches 5, 5, 1 (a tail smaller than N)
#: Other programs evaluate and predict 12 samples in one batch of 12: each new batch shape costs a compilation.


def _keras():
    import keras

    return keras


def _backend():
    return _keras().backend.backend()


def _images(samples, seed, classes=None, side=8):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(samples, side, side, 1)).astype("float32")
    if classes is None:
        return x
    return x, rng.integers(0, classes, size=(samples,))


def _altered(x, devices, perturb):
    """The test hook: one sample changed, on a distributed run only."""
    if not perturb or devices == 1:
        return x
    x = np.array(x, copy=True)
    x[1] = x[1] + 0.5
    return x


def _distribute(model, devices):
    import distkeras

    if devices > 1:
        model = distkeras.distribute(model, devices)  # the one line a user adds
    return model


def _optimizers(model):
    """Every optimizer the model holds: ``model.optimizer`` and any other attribute that is one (a GAN's)."""
    keras = _keras()
    found = {}
    if getattr(model, "optimizer", None) is not None:
        found["optimizer"] = model.optimizer
    for name, value in sorted(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found.values()):
            found[name] = value
    return found


def _numpy(value):
    return np.asarray(_keras().ops.convert_to_numpy(value))


def result(model, history, evaluated=None, predicted=None, **extra):
    """What a program returns: plain data a test can compare, and that pickles from a worker process."""
    optimizer_paths, optimizer_values = [], []
    for attr, optimizer in _optimizers(model).items():
        for v in optimizer.variables:
            optimizer_paths.append("{}:{}".format(attr, v.path))
            optimizer_values.append(_numpy(v).astype("float64"))
    out = {
        "paths": [w.path for w in model.weights],
        "weights": [_numpy(w).astype("float64") if _numpy(w).dtype.kind == "f" else _numpy(w) for w in model.weights],
        "optimizer_paths": optimizer_paths,
        "optimizer": optimizer_values,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate": None if evaluated is None else {k: float(v) for k, v in evaluated.items()},
        "predict": None if predicted is None else np.asarray(predicted, dtype="float64"),
        "replicas": replicas_seen(model),
    }
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------------------------
# keras.io/examples/vision/mnist_convnet


def mnist_convnet(devices, perturb=False):
    keras = _keras()
    layers = keras.layers
    keras.utils.set_random_seed(0)
    num_classes = 10
    x_train, y_train = _images(36, seed=1, classes=num_classes)
    x_test, y_test = _images(11, seed=2, classes=num_classes)
    y_train = keras.utils.to_categorical(y_train, num_classes)
    y_test = keras.utils.to_categorical(y_test, num_classes)
    model = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(4, kernel_size=(2, 2), activation="relu"),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(num_classes, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    model = _distribute(model, devices)
    # 36 samples, validation_split=0.1: 33 train (steps of 12, 12, 9) and 3 validation samples
    history = model.fit(_altered(x_train, devices, perturb), y_train, batch_size=BATCH, epochs=2,
                        validation_split=0.1, shuffle=False, verbose=0)
    score = model.evaluate(x_test, y_test, batch_size=EVAL_BATCH, verbose=0, return_dict=True)
    predicted = model.predict(x_test, batch_size=EVAL_BATCH, verbose=0)
    return result(model, history, score, predicted)


# --------------------------------------------------------------------------------------------------------------
# keras.io/examples/nlp/text_classification_with_transformer


def _transformer_layers(keras):
    layers, ops = keras.layers, keras.ops

    class TransformerBlock(layers.Layer):
        def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
            super().__init__()
            self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
            self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
            self.dropout1 = layers.Dropout(rate)
            self.dropout2 = layers.Dropout(rate)

        def call(self, inputs, training=False):
            attn_output = self.att(inputs, inputs)
            attn_output = self.dropout1(attn_output, training=training)
            out1 = self.layernorm1(inputs + attn_output)
            ffn_output = self.ffn(out1)
            ffn_output = self.dropout2(ffn_output, training=training)
            return self.layernorm2(out1 + ffn_output)

    class TokenAndPositionEmbedding(layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim):
            super().__init__()
            self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            maxlen = ops.shape(x)[-1]
            positions = ops.arange(start=0, stop=maxlen, step=1)
            positions = self.pos_emb(positions)
            x = self.token_emb(x)
            return x + positions

    return TransformerBlock, TokenAndPositionEmbedding


def text_transformer(devices, perturb=False):
    keras = _keras()
    layers = keras.layers
    keras.utils.set_random_seed(0)
    vocab_size, maxlen = 30, 6
    rng = np.random.default_rng(3)
    x_train = rng.integers(0, vocab_size, size=(24, maxlen)).astype("int32")
    y_train = rng.integers(0, 2, size=(24,))
    x_val = rng.integers(0, vocab_size, size=(12, maxlen)).astype("int32")
    y_val = rng.integers(0, 2, size=(12,))
    TransformerBlock, TokenAndPositionEmbedding = _transformer_layers(keras)
    embed_dim, num_heads, ff_dim = 8, 2, 8
    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(6, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model = _distribute(model, devices)
    if perturb and devices > 1:
        x_train = np.array(x_train, copy=True)
        x_train[1] = (x_train[1] + 1) % vocab_size
    history = model.fit(x_train, y_train, batch_size=BATCH, epochs=2, validation_data=(x_val, y_val),
                        shuffle=False, verbose=0)
    score = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)
    predicted = model.predict(x_val, batch_size=BATCH, verbose=0)
    return result(model, history, score, predicted)


# --------------------------------------------------------------------------------------------------------------
# keras.io/examples/generative/vae: the Sampling layer, a train_step with the loss written by hand with ops


def _stateless(model, trainable, non_trainable, fn):
    """JAX: run ``fn()`` with ``model``'s variables read from the given values (keras.StatelessScope, as
    ``Layer.stateless_call`` does); ``fn``'s result and the non-trainable values it left."""
    keras = _keras()
    mapping = list(zip(model.trainable_variables, trainable)) + list(zip(model.non_trainable_variables, non_trainable))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        out = fn()
    new_non_trainable = [scope.get_current_value(v) for v in model.non_trainable_variables]
    return out, [n if n is not None else o for n, o in zip(new_non_trainable, non_trainable)]


def _stateless_trackers(metrics, metrics_variables, values):
    """JAX: update each Mean tracker with its value, statelessly; (logs, new metrics variables)."""
    logs, new, at = {}, [], 0
    for metric, value in zip(metrics, values):
        this = metrics_variables[at:at + len(metric.variables)]
        at += len(metric.variables)
        this = metric.stateless_update_state(this, value)
        logs[metric.name] = metric.stateless_result(this)
        new += list(this)
    return logs, new


def _vae_class(keras):
    ops = keras.ops
    backend = keras.backend.backend()

    class VAEBase(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")
            if backend != "tensorflow":  # no call() to build it: the JAX/PyTorch guides' wrappers say it is built
                self.built = True

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

        def losses_of(self, data):
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            return total_loss, reconstruction_loss, kl_loss

        def track(self, total_loss, reconstruction_loss, kl_loss):
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {
                "loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result(),
            }

    if backend == "tensorflow":
        import tensorflow as tf

        class VAE(VAEBase):
            def train_step(self, data):
                with tf.GradientTape() as tape:
                    total_loss, reconstruction_loss, kl_loss = self.losses_of(data)
                grads = tape.gradient(total_loss, self.trainable_weights)
                self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
                return self.track(total_loss, reconstruction_loss, kl_loss)

    elif backend == "jax":
        import jax

        class VAE(VAEBase):
            def train_step(self, state, data):
                trainable, non_trainable, optimizer_variables, metrics_variables = state

                def loss_fn(trainable, non_trainable):
                    losses, non_trainable = _stateless(self, trainable, non_trainable, lambda: self.losses_of(data))
                    return losses[0], (losses, non_trainable)

                (_, (losses, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable)
                trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
                logs, metrics_variables = _stateless_trackers(self.metrics, metrics_variables, losses)
                logs["loss"] = logs.pop("total_loss")
                return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    else:
        import torch

        class VAE(VAEBase):
            def train_step(self, data):
                self.zero_grad()
                total_loss, reconstruction_loss, kl_loss = self.losses_of(data)
                total_loss.backward()
                trainable_weights = [v for v in self.trainable_weights]
                gradients = [v.value.grad for v in trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(gradients, trainable_weights)
                return self.track(total_loss, reconstruction_loss, kl_loss)

    return VAE


def vae(devices, perturb=False):
    keras = _keras()
    layers, ops = keras.layers, keras.ops
    keras.utils.set_random_seed(0)

    class Sampling(layers.Layer):
        """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            batch = ops.shape(z_mean)[0]
            dim = ops.shape(z_mean)[1]
            epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    latent_dim = 2
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Flatten()(x)
    x = layers.Dense(8, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(4 * 4 * 4, activation="relu")(latent_inputs)
    x = layers.Reshape((4, 4, 4))(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", strides=2, padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    mnist_digits = _images(24, seed=4)
    model = _vae_class(keras)(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam())
    model = _distribute(model, devices)
    history = model.fit(_altered(mnist_digits, devices, perturb), epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    return result(model, history)


# --------------------------------------------------------------------------------------------------------------
# keras.io/examples/generative/dcgan_overriding_train_step and the "customizing fit()" guides' GAN:
# compile(d_optimizer, g_optimizer, loss_fn)


def _gan_class(keras):
    ops = keras.ops
    backend = keras.backend.backend()

    class GANBase(keras.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
            self.seed_generator = keras.random.SeedGenerator(1337)
            if backend != "tensorflow":  # as the PyTorch guide's GAN: no call() to build it on a first batch
                self.built = True

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
            super().compile(**kwargs)
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def d_loss_of(self, real_images):
            batch_size = ops.shape(real_images)[0]
            random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            generated_images = self.generator(random_latent_vectors)
            combined_images = ops.concatenate([generated_images, real_images], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
            predictions = self.discriminator(combined_images)
            return self.loss_fn(labels, predictions)

        def g_loss_of(self, real_images):
            batch_size = ops.shape(real_images)[0]
            random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            misleading_labels = ops.zeros((batch_size, 1))
            predictions = self.discriminator(self.generator(random_latent_vectors))
            return self.loss_fn(misleading_labels, predictions)

        def track(self, d_loss, g_loss):
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    if backend == "tensorflow":
        import tensorflow as tf

        class GAN(GANBase):
            def train_step(self, real_images):
                if isinstance(real_images, tuple):
                    real_images = real_images[0]
                with tf.GradientTape() as tape:
                    d_loss = self.d_loss_of(real_images)
                grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
                self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
                with tf.GradientTape() as tape:
                    g_loss = self.g_loss_of(real_images)
                grads = tape.gradient(g_loss, self.generator.trainable_weights)
                self.g_optimizer.apply(grads, self.generator.trainable_weights)
                return self.track(d_loss, g_loss)

    elif backend == "jax":
        import jax

        class GAN(GANBase):
            """JAX: Keras' stateless state carries one optimizer's variables, so this step runs eagerly
            (compile(run_eagerly=True)): each half's loss and gradients are one jitted function, the two
            optimizers apply statelessly and their variables are assigned."""

            def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
                super().compile(d_optimizer, g_optimizer, loss_fn, run_eagerly=True, **kwargs)

            def _half(self, trainable, non_trainable, part, loss_of, real_images):
                paths = [v.path for v in self.trainable_variables]
                mine = [paths.index(v.path) for v in part.trainable_variables]
                if part.name not in self.__dict__.setdefault("grad_fns", {}):

                    def loss_fn(own, trainable, non_trainable, real_images):
                        values = list(trainable)
                        for i, value in zip(mine, own):
                            values[i] = value
                        return _stateless(self, values, non_trainable, lambda: loss_of(real_images))

                    self.grad_fns[part.name] = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
                (loss, non_trainable), grads = self.grad_fns[part.name](
                    [trainable[i] for i in mine], trainable, non_trainable, real_images)
                optimizer = self.d_optimizer if part is self.discriminator else self.g_optimizer
                if not optimizer.built:
                    optimizer.build(part.trainable_variables)
                new, optimizer_values = optimizer.stateless_apply(
                    [v.value for v in optimizer.variables], grads, [trainable[i] for i in mine])
                for variable, value in zip(optimizer.variables, optimizer_values):
                    variable.assign(value)
                trainable = list(trainable)
                for i, value in zip(mine, new):
                    trainable[i] = value
                return loss, trainable, non_trainable

            def train_step(self, state, real_images):
                trainable, non_trainable, optimizer_variables, metrics_variables = state
                if isinstance(real_images, tuple):
                    real_images = real_images[0]
                d_loss, trainable, non_trainable = self._half(
                    trainable, non_trainable, self.discriminator, self.d_loss_of, real_images)
                g_loss, trainable, non_trainable = self._half(
                    trainable, non_trainable, self.generator, self.g_loss_of, real_images)
                logs, metrics_variables = _stateless_trackers(self.metrics, metrics_variables, [d_loss, g_loss])
                return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    else:
        import torch

        class GAN(GANBase):
            def train_step(self, real_images):
                if isinstance(real_images, tuple):
                    real_images = real_images[0]
                self.zero_grad()
                d_loss = self.d_loss_of(real_images)
                d_loss.backward()
                grads = [v.value.grad for v in self.discriminator.trainable_weights]
                with torch.no_grad():
                    self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
                self.zero_grad()
                g_loss = self.g_loss_of(real_images)
                g_loss.backward()
                grads = [v.value.grad for v in self.generator.trainable_weights]
                with torch.no_grad():
                    self.g_optimizer.apply(grads, self.generator.trainable_weights)
                return self.track(d_loss, g_loss)

    return GAN


def gan(devices, perturb=False):
    keras = _keras()
    layers = keras.layers
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    latent_dim = 4
    generator = keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            layers.Dense(4 * 4 * 4),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((4, 4, 4)),
            layers.Conv2DTranspose(4, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    all_digits = _images(24, seed=5)
    model = _gan_class(keras)(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    model.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    model = _distribute(model, devices)
    history = model.fit(_altered(all_digits, devices, perturb), epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    return result(model, history)


# --------------------------------------------------------------------------------------------------------------
# keras.io/examples/vision/knowledge_distillation: Distiller with compile(student_loss_fn, distillation_loss_fn,
# alpha, temperature), its own train_step and test_step


def _distiller_class(keras):
    ops = keras.ops
    backend = keras.backend.backend()

    class DistillerBase(keras.Model):
        def __init__(self, student, teacher):
            super().__init__()
            self.teacher = teacher
            self.student = student

        def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
            super().compile(optimizer=optimizer, metrics=metrics)
            self.student_loss_fn = student_loss_fn
            self.distillation_loss_fn = distillation_loss_fn
            self.alpha = alpha
            self.temperature = temperature

        def call(self, x):
            return self.student(x)

        def losses_of(self, x, y):
            teacher_predictions = self.teacher(x, training=False)
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                ops.softmax(teacher_predictions / self.temperature, axis=1),
                ops.softmax(student_predictions / self.temperature, axis=1),
            ) * (self.temperature**2)
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
            return loss, student_loss, distillation_loss, student_predictions

        def tracked(self, y, y_prediction, **losses):
            for metric in self.metrics:
                if metric.name != "loss":
                    metric.update_state(y, y_prediction)
            results = {m.name: m.result() for m in self.metrics if m.name != "loss"}
            results.update(losses)
            return results

        def test_step(self, data):
            x, y = data
            y_prediction = self.student(x, training=False)
            student_loss = self.student_loss_fn(y, y_prediction)
            return self.tracked(y, y_prediction, student_loss=student_loss)

    if backend == "tensorflow":
        import tensorflow as tf

        class Distiller(DistillerBase):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    loss, student_loss, distillation_loss, student_predictions = self.losses_of(x, y)
                trainable_vars = self.student.trainable_variables
                gradients = tape.gradient(loss, trainable_vars)
                self.optimizer.apply_gradients(zip(gradients, trainable_vars))
                return self.tracked(y, student_predictions, student_loss=student_loss,
                                    distillation_loss=distillation_loss)

    elif backend == "jax":
        import jax

        class Distiller(DistillerBase):
            def _metrics_logs(self, metrics_variables, y, y_prediction):
                logs, new, at = {}, [], 0
                for metric in self.metrics:
                    this = metrics_variables[at:at + len(metric.variables)]
                    at += len(metric.variables)
                    if metric.name != "loss":
                        this = metric.stateless_update_state(this, y, y_prediction)
                        logs[metric.name] = metric.stateless_result(this)
                    new += list(this)
                return logs, new

            def train_step(self, state, data):
                trainable, non_trainable, optimizer_variables, metrics_variables = state
                x, y = data

                def loss_fn(trainable, non_trainable):
                    out, non_trainable = _stateless(self, trainable, non_trainable, lambda: self.losses_of(x, y))
                    return out[0], (out, non_trainable)

                (_, (out, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable)
                trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
                _, student_loss, distillation_loss, student_predictions = out
                logs, metrics_variables = self._metrics_logs(metrics_variables, y, student_predictions)
                logs.update(student_loss=student_loss, distillation_loss=distillation_loss)
                return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

            def test_step(self, state, data):
                trainable, non_trainable, metrics_variables = state
                x, y = data
                y_prediction, non_trainable = _stateless(
                    self, trainable, non_trainable, lambda: self.student(x, training=False))
                student_loss = self.student_loss_fn(y, y_prediction)
                logs, metrics_variables = self._metrics_logs(metrics_variables, y, y_prediction)
                logs["student_loss"] = student_loss
                return logs, (trainable, non_trainable, metrics_variables)

    else:
        import torch

        class Distiller(DistillerBase):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                loss, student_loss, distillation_loss, student_predictions = self.losses_of(x, y)
                loss.backward()
                trainable_vars = self.student.trainable_weights
                gradients = [v.value.grad for v in trainable_vars]
                with torch.no_grad():
                    self.optimizer.apply(gradients, trainable_vars)
                return self.tracked(y, student_predictions, student_loss=student_loss,
                                    distillation_loss=distillation_loss)

    return Distiller


def distiller(devices, perturb=False):
    keras = _keras()
    layers = keras.layers
    keras.utils.set_random_seed(0)

    def convnet(name, filters):
        return keras.Sequential(
            [
                keras.Input(shape=(8, 8, 1)),
                layers.Conv2D(filters, (3, 3), strides=(2, 2), padding="same"),
                layers.LeakyReLU(negative_slope=0.2),
                layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
                layers.Flatten(),
                layers.Dense(10),
            ],
            name=name,
        )

    teacher = convnet("teacher", 6)
    student = convnet("student", 3)
    x_train, y_train = _images(24, seed=6, classes=10)
    x_test, y_test = _images(12, seed=7, classes=10)
    teacher.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[keras.metrics.SparseCategoricalAccuracy()])
    teacher.fit(x_train, y_train, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)  # trained on one device, as given
    teacher.trainable = False
    model = _distiller_class(keras)(student=student, teacher=teacher)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )
    model = _distribute(model, devices)
    history = model.fit(_altered(x_train, devices, perturb), y_train, epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    score = model.evaluate(x_test, y_test, batch_size=BATCH, verbose=0, return_dict=True)
    predicted = model.predict(x_test, batch_size=BATCH, verbose=0)
    return result(model, history, score, predicted)


# --------------------------------------------------------------------------------------------------------------
# keras.io/examples/vision/siamese_contrastive: a loss function returning a scalar ops.mean(...)


def siamese_contrastive(devices, perturb=False):
    keras = _keras()
    _layers, ops = keras.layers, keras.ops
    keras.utils.set_random_seed(0)

    def euclidean_distance(vects):
        x, y = vects
        sum_square = ops.sum(ops.square(x - y), axis=1, keepdims=True)
        return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))

    def loss(margin=1):
        def contrastive_loss(y_true, y_pred):
            square_pred = ops.square(y_pred)
            margin_square = ops.square(ops.maximum(margin - (y_pred), 0))
            return ops.mean((1 - y_true) * square_pred + (y_true) * margin_square)

        return contrastive_loss

    input = keras.layers.Input((8, 8, 1))
    x = keras.layers.BatchNormalization()(input)
    x = keras.layers.Conv2D(2, (3, 3), activation="tanh")(x)
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dense(4, activation="tanh")(x)
    embedding_network = keras.Model(input, x)
    input_1 = keras.layers.Input((8, 8, 1))
    input_2 = keras.layers.Input((8, 8, 1))
    tower_1 = embedding_network(input_1)
    tower_2 = embedding_network(input_2)
    merge_layer = keras.layers.Lambda(euclidean_distance, output_shape=(1,))([tower_1, tower_2])
    normal_layer = keras.layers.BatchNormalization()(merge_layer)
    output_layer = keras.layers.Dense(1, activation="sigmoid")(normal_layer)
    siamese = keras.Model(inputs=[input_1, input_2], outputs=output_layer)
    siamese.compile(loss=loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])
    model = _distribute(siamese, devices)
    pairs_train = _images(48, seed=8).reshape(24, 2, 8, 8, 1)
    labels_train = np.random.default_rng(9).integers(0, 2, size=(24,)).astype("float32")
    pairs_val = _images(24, seed=10).reshape(12, 2, 8, 8, 1)
    labels_val = np.random.default_rng(11).integers(0, 2, size=(12,)).astype("float32")
    x_train_1 = _altered(pairs_train[:, 0], devices, perturb)
    history = model.fit([x_train_1, pairs_train[:, 1]], labels_train, validation_data=([pairs_val[:, 0], pairs_val[:, 1]], labels_val),
                        batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    results = model.evaluate([pairs_val[:, 0], pairs_val[:, 1]], labels_val, batch_size=BATCH, verbose=0, return_dict=True)
    predictions = model.predict([pairs_val[:, 0], pairs_val[:, 1]], batch_size=BATCH, verbose=0)
    return result(model, history, results, predictions)


# --------------------------------------------------------------------------------------------------------------
# keras.io/guides/custom_train_step_in_{tensorflow,jax,torch}: "going lower-level" (a Loss object and metric
# trackers of its own) and "providing your own evaluation step"


def custom_fit_class(keras):
    backend = keras.backend.backend()

    class CustomBase(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

        def tracked(self, loss, y, y_pred):
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            loss = self.loss_fn(y, y_pred)
            return self.tracked(loss, y, y_pred)

    if backend == "tensorflow":
        import tensorflow as tf

        class CustomModel(CustomBase):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.loss_fn(y, y_pred)
                trainable_vars = self.trainable_variables
                gradients = tape.gradient(loss, trainable_vars)
                self.optimizer.apply(gradients, trainable_vars)
                return self.tracked(loss, y, y_pred)

    elif backend == "jax":
        import jax

        class CustomModel(CustomBase):
            def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
                y_pred, non_trainable_variables = self.stateless_call(
                    trainable_variables, non_trainable_variables, x, training=training)
                loss = self.loss_fn(y, y_pred)
                return loss, (y_pred, non_trainable_variables)

            def train_step(self, state, data):
                trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
                x, y = data
                grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
                (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                    trainable_variables, non_trainable_variables, x, y, training=True)
                trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                    optimizer_variables, grads, trainable_variables)
                logs, new_metrics_vars = self.stateless_tracked(metrics_variables, loss, y, y_pred)
                return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)

            def stateless_tracked(self, metrics_variables, loss, y, y_pred):
                loss_tracker_vars = metrics_variables[: len(self.loss_tracker.variables)]
                mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
                loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss)
                mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred)
                logs = {
                    self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                    self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars),
                }
                return logs, list(loss_tracker_vars) + list(mae_metric_vars)

            def test_step(self, state, data):
                x, y = data
                trainable_variables, non_trainable_variables, metrics_variables = state
                y_pred, non_trainable_variables = self.stateless_call(
                    trainable_variables, non_trainable_variables, x, training=False)
                loss = self.loss_fn(y, y_pred)
                logs, new_metrics_vars = self.stateless_tracked(metrics_variables, loss, y, y_pred)
                return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)

    else:
        import torch

        class CustomModel(CustomBase):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
                loss.backward()
                trainable_weights = [v for v in self.trainable_weights]
                gradients = [v.value.grad for v in trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(gradients, trainable_weights)
                return self.tracked(loss, y, y_pred)

    return CustomModel


def custom_fit(devices, perturb=False):
    keras = _keras()
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    model = custom_fit_class(keras)(inputs, outputs)
    model.compile(optimizer="adam")
    rng = np.random.default_rng(12)
    x, y = rng.normal(size=(24, 6)).astype("float32"), rng.normal(size=(24, 1)).astype("float32")
    x_test, y_test = rng.normal(size=(12, 6)).astype("float32"), rng.normal(size=(12, 1)).astype("float32")
    model = _distribute(model, devices)
    history = model.fit(_altered(x, devices, perturb), y, epochs=3, batch_size=BATCH, shuffle=False, verbose=0)
    score = model.evaluate(x_test, y_test, batch_size=BATCH, verbose=0, return_dict=True)
    predicted = model.predict(x_test, batch_size=BATCH, verbose=0)
    return result(model, history, score, predicted)


# --------------------------------------------------------------------------------------------------------------
# keras.io/guides/training_with_built_in_methods (checkpointing, early stopping, learning-rate schedules)


def callbacks(devices, perturb=False):
    keras = _keras()
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(6,), name="digits")
    x = keras.layers.Dense(8, activation="relu", name="dense_1")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-2), loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    model = _distribute(model, devices)
    rng = np.random.default_rng(13)
    x_train, y_train = rng.normal(size=(24, 6)).astype("float32"), rng.integers(0, 3, size=(24,))
    x_val, y_val = rng.normal(size=(12, 6)).astype("float32"), rng.integers(0, 3, size=(12,))
    folder = tempfile.mkdtemp(prefix="realcode-")
    try:
        checkpoints = [
            keras.callbacks.ModelCheckpoint(filepath=os.path.join(folder, "mymodel_{epoch}.keras"), verbose=0),
            keras.callbacks.ModelCheckpoint(filepath=os.path.join(folder, "best.weights.h5"), save_weights_only=True,
                                            save_best_only=True, monitor="val_loss", verbose=0),
            keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-2, patience=1, verbose=0),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=1e-1),
        ]
        history = model.fit(_altered(x_train, devices, perturb), y_train, batch_size=BATCH, epochs=6,
                            validation_data=(x_val, y_val), callbacks=checkpoints, shuffle=False, verbose=0)
        extra = {}
        if os.environ.get("RANK", "0") == "0":  # in a job of processes (PyTorch) rank 0 writes the checkpoints
            epochs = len(history.history["loss"])
            saved = keras.saving.load_model(os.path.join(folder, "mymodel_{}.keras".format(epochs)))
            best = keras.models.clone_model(saved)
            best.load_weights(os.path.join(folder, "best.weights.h5"))
            extra = {
                "saved_class": type(saved).__name__,
                "saved_weights": [_numpy(w).astype("float64") for w in saved.weights],
                "best_weights": [_numpy(w).astype("float64") for w in best.weights],
            }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    score = model.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True)
    predicted = model.predict(x_val, batch_size=BATCH, verbose=0)
    return result(model, history, score, predicted, **extra)


#: name -> (program, tolerance for weights and optimizer state).
PROGRAMS = {
    "mnist_convnet": (mnist_convnet, 1e-5),
    "text_transformer": (text_transformer, 1e-5),
    "vae": (vae, 1e-5),
    "gan": (gan, 1e-5),
    "distiller": (distiller, 1e-5),
    "siamese_contrastive": (siamese_contrastive, 1e-5),
    "custom_fit": (custom_fit, 1e-5),
    "callbacks": (callbacks, 1e-5),
}


def run(name, devices, perturb=False):
    """Run program ``name`` on ``devices`` (1: plain Keras); its :func:`result`."""
    program, _ = PROGRAMS[name]
    return program(devices, perturb=perturb)
