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
