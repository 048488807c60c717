"""A training loop written by hand (no fit()), data-parallel: the loops of Keras' "Writing a training loop from
scratch" guides. Lines marked `# distkeras:` are the only changes from the single-device script.

    KERAS_BACKEND=jax DISTKERAS_CPU_DEVICES=2 python examples/custom_training_loop.py   # or tensorflow, torch

A loop's step is written per backend (TensorFlow's GradientTape in a tf.function, JAX's jitted stateless step,
PyTorch's eager backward()), so this script holds all three and picks the one for KERAS_BACKEND; keep the one you
use. The three distkeras lines are the same on every backend: `distribute_dataset` gives each replica its rows of
every global batch, `attach` makes the optimizer and the metrics the job's, `distribute_step` runs the step on
every replica (docs/loops.md). The data is scikit-learn's digits (shipped with it: nothing to download).
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
import numpy as np
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the replicas")
args = parser.parse_args()

digits = load_digits()
x_train = (digits.data / 16.0).astype("float32")
y_train = digits.target.astype("int32")
rows = len(x_train) // args.batch_size * args.batch_size  # whole batches: every replica gets its share of each
x_train, y_train = x_train[:rows], y_train[:rows]

inputs = keras.Input(shape=(64,))
hidden = keras.layers.Dense(64, activation="relu")(inputs)
outputs = keras.layers.Dense(10)(hidden)
model = distkeras.distribute(keras.Model(inputs, outputs))  # distkeras: every GPU, else every (virtual) CPU device

optimizer = keras.optimizers.Adam(learning_rate=1e-3)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
distkeras.attach(model, optimizer, train_acc_metric)  # distkeras: the job's optimizer and metric
chief = distkeras.is_main_process()  # distkeras: one process prints (PyTorch runs one per device)

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048, seed=0).batch(args.batch_size)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        train_acc_metric.update_state(y, logits)
        return loss_value

    dataset = distkeras.distribute_dataset(dataset, model)  # distkeras: each replica's rows of every batch
    train_step = distkeras.distribute_step(train_step, model)  # distkeras: the step on every replica
    for epoch in range(args.epochs):
        for x_batch, y_batch in dataset:
            loss_value = train_step(x_batch, y_batch)  # the global batch's loss
        if chief:
            print("epoch {}: loss {:.4f}, accuracy {:.4f}".format(epoch, float(loss_value),
                                                                  float(train_acc_metric.result())))
        train_acc_metric.reset_state()

elif keras.backend.backend() == "jax":
    import jax

    batches = [(x_train[i:i + args.batch_size], y_train[i:i + args.batch_size])
               for i in range(0, rows, args.batch_size)]

    def compute_loss_and_updates(trainable_variables, non_trainable_variables, metric_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x,
                                                               training=True)
        loss = loss_fn(y, y_pred)
        metric_variables = train_acc_metric.stateless_update_state(metric_variables, y, y_pred)
        return loss, (non_trainable_variables, metric_variables)

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metric_variables = state
        x, y = data
        (loss, (non_trainable_variables, metric_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, metric_variables, x, y)
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        return loss, (trainable_variables, non_trainable_variables, optimizer_variables, metric_variables)

    batches = distkeras.distribute_dataset(batches, model)  # distkeras: (unchanged on JAX)
    train_step = distkeras.distribute_step(train_step, model)  # distkeras: each batch laid out over the devices
    optimizer.build(model.trainable_variables)
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables], [v.value for v in train_acc_metric.variables])
    for epoch in range(args.epochs):
        for data in batches:
            loss, state = train_step(state, data)  # the global batch's loss
        accuracy = train_acc_metric.stateless_result(state[3])
        if chief:
            print("epoch {}: loss {:.4f}, accuracy {:.4f}".format(epoch, float(loss), float(accuracy)))
        train_acc_metric.reset_state()
        state = state[:3] + ([v.value for v in train_acc_metric.variables],)
    for variable, value in zip(model.trainable_variables + model.non_trainable_variables, state[0] + state[1]):
        variable.assign(value)  # the trained values back into the model, to evaluate or save it

else:  # torch
    import torch

    loader = torch.utils.data.DataLoader(  # the same batches, in the same order, on every process
        torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        batch_size=args.batch_size)
    loader = distkeras.distribute_dataset(loader, model)  # distkeras: this process' rows of every batch
    # (an eager loop has no step function to give distribute_step, which returns a step unchanged on PyTorch)
    for epoch in range(args.epochs):
        for x_batch, y_batch in loader:
            logits = model(x_batch)
            loss = loss_fn(y_batch, logits)  # this process' rows' loss
            model.zero_grad()
            trainable_weights = list(model.trainable_weights)
            loss.backward()
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                optimizer.apply(gradients, trainable_weights)  # the gradients averaged over the processes first
            train_acc_metric.update_state(y_batch, logits)
        accuracy = float(train_acc_metric.result())  # a collective: every process calls it
        if chief:
            print("epoch {}: loss {:.4f}, accuracy {:.4f}".format(epoch, loss.item(), accuracy))
        train_acc_metric.reset_state()

logits = model.predict(x_train, batch_size=args.batch_size, verbose=0)
if chief:
    print("training accuracy: {:.4f}".format(float(np.mean(np.argmax(logits, axis=1) == y_train))))
