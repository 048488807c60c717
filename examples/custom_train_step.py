"""A model with its own `train_step`, data-parallel: the step Keras' "Customizing what happens in fit()" guides
write for each backend, unchanged. Lines marked `# distkeras:` are the only changes from the single-device script.

    KERAS_BACKEND=tensorflow DISTKERAS_CPU_DEVICES=2 python examples/custom_train_step.py   # or jax, torch

A custom step is written per backend (TensorFlow's GradientTape, JAX's stateless step, PyTorch's backward()), so
this script holds all three and picks the one for KERAS_BACKEND; keep the one you use. distkeras needs nothing
from it: on TensorFlow and PyTorch each replica's loss and gradients are weighed by its share of the global batch
and applied by `self.optimizer` as one device would, on JAX the step is one program over every device. The data
is scikit-learn's digits (shipped with it: nothing to download).
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--out", default="custom_train_step.keras")
args = parser.parse_args()


def update_metrics(model, loss, y, y_pred):
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in model.metrics}


if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    @keras.saving.register_keras_serializable(package="examples")
    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            return update_metrics(self, loss, y, y_pred)

elif keras.backend.backend() == "jax":
    import jax

    @keras.saving.register_keras_serializable(package="examples")
    class CustomModel(keras.Model):
        # The guide names this compute_loss_and_updates, which is also the name of the method Keras' JAX
        # trainer calls in evaluate(): another name keeps evaluate() working.
        def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training)
            loss = self.compute_loss(x, y, y_pred)
            return loss, (y_pred, non_trainable_variables)

        def train_step(self, state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y, training=True)
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            new_metrics_variables, logs = [], {}
            for metric in self.metrics:
                start = len(new_metrics_variables)
                this_metric_variables = metrics_variables[start:start + len(metric.variables)]
                if metric.name == "loss":
                    this_metric_variables = metric.stateless_update_state(this_metric_variables, loss)
                else:
                    this_metric_variables = metric.stateless_update_state(this_metric_variables, y, y_pred)
                logs[metric.name] = metric.stateless_result(this_metric_variables)
                new_metrics_variables += this_metric_variables
            return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_variables)

else:  # torch
    import torch

    @keras.saving.register_keras_serializable(package="examples")
    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss.backward()
            trainable_weights = list(self.trainable_weights)
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            return update_metrics(self, loss, y, y_pred)


digits = load_digits()
x = (digits.data / 16.0).astype("float32")
x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                    stratify=digits.target)

inputs = keras.Input(shape=(64,))
hidden = keras.layers.Dense(64, activation="relu")(inputs)
outputs = keras.layers.Dense(10, activation="softmax")(hidden)
model = CustomModel(inputs, outputs)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

model = distkeras.distribute(model)  # distkeras: every GPU, else every (virtual) CPU device
batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 samples per replica

model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
if distkeras.is_main_process():  # distkeras: one process prints and writes (PyTorch runs one per device)
    print("test accuracy: {:.4f}".format(accuracy))
    model.save(args.out)  # loads with keras.saving.load_model() once CustomModel is defined (imported)
