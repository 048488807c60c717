"""Models as users write them, for the PyTorch tests: subclassed, nested, with BatchNormalization, with the
Keras guide's custom ``train_step``. Imports only Keras (and torch), never distkeras: a plain process that
reloads a saved model imports its class from here.
"""

import keras
import torch


class WithLayerArgument(keras.Model):
    """A subclassed model whose ``__init__`` takes a layer and a function: no ``get_config``, so Keras can't
    clone it (nor save it as a .keras file); only its weights can be saved."""

    def __init__(self, body, squash=keras.ops.tanh):
        super().__init__()
        self.body = body
        self.squash = squash
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.squash(self.body(x)))


class Configured(keras.Model):
    """A subclassed model with ``get_config`` (and BatchNormalization): saved and reloaded as a .keras file."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units)
        self.norm = keras.layers.BatchNormalization()
        self.head = keras.layers.Dense(3)

    def call(self, x, training=None):
        return self.head(keras.ops.tanh(self.norm(self.hidden(x), training=training)))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class Block(keras.layers.Layer):
    """A layer (not a model) that keeps its sublayers in a list, BatchNormalization among them."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.parts = [keras.layers.Dense(units), keras.layers.BatchNormalization()]

    def call(self, x, training=None):
        return keras.ops.tanh(self.parts[1](self.parts[0](x), training=training))


class Outer(keras.Model):
    """A subclassed model around a Functional model around a Sequential; BatchNormalization at every depth."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.block = Block(6)
        self.head = keras.layers.Dense(3)

    def call(self, x, training=None):
        return self.head(self.block(self.inner(x, training=training), training=training))


def nested(input_shape=(5,)):
    sequential = keras.Sequential(
        [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Activation("tanh")]
    )
    inputs = keras.Input(input_shape)
    functional = keras.Model(inputs, keras.layers.Dense(8, activation="tanh")(sequential(inputs)))
    model = Outer(functional)
    model(keras.ops.zeros((2,) + tuple(input_shape)))
    return model


class GuideStep(keras.Model):
    """The ``train_step`` of Keras' guide "Customizing what happens in fit() with PyTorch", word for word."""

    def train_step(self, data):
        x, y = data

        # Call torch.nn.Module.zero_grad() to clear the leftover gradients
        # for the weights from the previous train step.
        self.zero_grad()

        # Compute loss
        y_pred = self(x, training=True)  # Forward pass
        loss = self.compute_loss(y=y, y_pred=y_pred)

        # Call torch.Tensor.backward() on the loss to compute gradients
        # for the weights.
        loss.backward()

        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]

        # Update weights
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)

        # Update metrics (includes the metric that tracks the loss)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)

        # Return a dict mapping metric names to current value
        # Note that it will include the loss (tracked in self.metrics).
        return {m.name: m.result() for m in self.metrics}


class OwnOptimizer(keras.Model):
    """A custom ``train_step`` that applies its gradients with an optimizer of its own, not ``self.optimizer``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own_optimizer = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        loss.backward()
        with torch.no_grad():
            self.own_optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        return {"loss": loss}


class WithUnused(keras.Model):
    """A subclassed model with a layer it never calls: that layer's variables get no gradient (None)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(3)
        self.unused = keras.layers.Dense(4)
        self.unused.build((None, 8))

    def call(self, x):
        return self.head(self.hidden(x))


class TransformedStep(GuideStep):
    """The guide's step, with gradients that are not the backward pass' own ``.grad`` tensors as they were:
    ``kind`` "scaled" (new tensors, twice the gradient), "in_place" (the .grad tensors doubled in place),
    "autograd" (``torch.autograd.grad``, no ``.grad`` at all) or "twice" (``backward()`` on each half of the
    loss, so .grad accumulates twice). On one device and distributed alike."""

    kind = "scaled"

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        trainable_weights = [v for v in self.trainable_weights]
        if self.kind == "autograd":
            gradients = list(torch.autograd.grad(loss, [v.value for v in trainable_weights]))
        elif self.kind == "twice":
            (loss * 0.5).backward(retain_graph=True)
            (loss * 0.5).backward()
            gradients = [v.value.grad for v in trainable_weights]
        else:
            loss.backward()
            gradients = [v.value.grad for v in trainable_weights]
            if self.kind == "in_place":
                for gradient in gradients:
                    gradient.mul_(2.0)
            else:
                gradients = [2.0 * gradient for gradient in gradients]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        return {"loss": loss}


class ByHand(keras.Model):
    """A custom ``train_step`` that changes its weights by hand (``assign``), with no optimizer at all."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        loss.backward()
        with torch.no_grad():
            for variable in self.trainable_weights:
                variable.assign(variable.value - 0.1 * variable.value.grad)
        return {"loss": loss}


# ---- the models of the Keras examples and guides that trained wrong when distributed (issue 21)


class Sampling(keras.layers.Layer):
    """The Keras VAE example's sampling layer: a seed generator of its own and ``keras.random.normal`` of the
    batch's shape."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=keras.ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """The Keras VAE example's model, its loss written by hand with ops in a PyTorch ``train_step``, logged
    through Mean trackers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.z_mean = keras.layers.Dense(2)
        self.z_log_var = keras.layers.Dense(2)
        self.sampling = Sampling()
        self.decoder = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(5)])
        self.trackers = [keras.metrics.Mean(name=name) for name in ("total_loss", "reconstruction_loss", "kl_loss")]

    @property
    def metrics(self):
        return self.trackers

    def encode(self, x):
        hidden = self.hidden(x)
        z_mean, z_log_var = self.z_mean(hidden), self.z_log_var(hidden)
        return z_mean, z_log_var, self.sampling([z_mean, z_log_var])

    def call(self, x):
        return self.decoder(self.encode(x)[2])

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        self.zero_grad()
        z_mean, z_log_var, z = self.encode(x)
        reconstruction = self.decoder(z)
        reconstruction_loss = keras.ops.mean(keras.ops.sum(keras.ops.square(x - reconstruction), axis=1))
        kl_loss = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
        kl_loss = keras.ops.mean(keras.ops.sum(kl_loss, axis=1))
        total_loss = reconstruction_loss + kl_loss
        total_loss.backward()
        grads = [v.value.grad for v in self.trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(grads, self.trainable_weights)
        for tracker, value in zip(self.trackers, (total_loss, reconstruction_loss, kl_loss)):
            tracker.update_state(value)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    """The Keras guide's GAN (PyTorch ``train_step``): no ``call()``, ``compile(d_optimizer, g_optimizer,
    loss_fn)``, two backward passes and two optimizers per step, latent noise from a seed generator."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True  # as the guide has it: no call() to build

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real):
        if isinstance(real, tuple):
            real = real[0]
        batch_size = real.shape[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = keras.ops.concatenate([self.generator(latent), real], axis=0)
        labels = keras.ops.concatenate([keras.ops.ones((batch_size, 1)), keras.ops.zeros((batch_size, 1))], axis=0)
        self.zero_grad()
        d_loss = self.loss_fn(labels, self.discriminator(combined))
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        self.zero_grad()
        g_loss = self.loss_fn(keras.ops.zeros((batch_size, 1)), self.discriminator(self.generator(latent)))
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class LossObjectStep(keras.Model):
    """A PyTorch ``train_step`` that calls a ``Loss`` object by hand and logs its value (no tracker), and a
    custom ``test_step`` that does the same."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_object = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.loss_object(y, self(x, training=True))
        loss.backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        return {"step_loss": loss}

    def test_step(self, data):
        x, y = data
        return {"step_loss": self.loss_object(y, self(x, training=False))}


class AddsLoss(keras.layers.Layer):
    """A layer that adds a loss of its activations (the mean over the batch) with ``add_loss``."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


class Unbuilt(keras.Model):
    """A subclassed model without an input shape: its layers are built by the first ``fit()``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.hidden(x))
