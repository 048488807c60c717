"""Hand-written training loops (keras.io's "Writing a training loop from scratch" guides) on a distributed model.

Each backend's guide loop (a small MLP on MNIST-like data, a train metric, a validation loop) with the lines of
:mod:`distkeras.loops` at N=2 equals the same loop on one device at the same global batch: weights, optimizer
variables and metric results; without them, the loop is stopped (TensorFlow) or warned about once (JAX, PyTorch).
"""

import logging

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated

import distkeras

TOLERANCE = 1e-5
SAMPLES, FEATURES, CLASSES, BATCH = 44, 12, 4, 8  # the last batch of each pass has 4 rows


def data():
    rng = np.random.default_rng(7)
    x = rng.random((SAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, SAMPLES).astype("int32")
    return x, y


def get_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(FEATURES,), name="digits")
    x1 = keras.layers.Dense(16, activation="relu")(inputs)
    x2 = keras.layers.Dense(16, activation="relu")(x1)
    outputs = keras.layers.Dense(CLASSES, name="predictions")(x2)
    return keras.Model(inputs=inputs, outputs=outputs)


def make_optimizer(kind, model):
    if kind == "adam":
        return keras.optimizers.Adam(learning_rate=1e-2)
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    if kind == "model":  # model.optimizer, compiled before distribute()
        return model.optimizer
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-2)


class Caught(logging.Handler):
    """distkeras' warnings (its logger does not propagate to pytest's caplog)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("distkeras").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("distkeras").removeHandler(self)


def outcome(model, optimizer, train_acc, val_acc, losses, seen):
    variables = getattr(optimizer, "variables", None)
    if variables is None:  # torch.optim: its state tensors
        state = [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "dim") and t.dim()]
        opt = [t.detach().cpu().numpy() for t in state]
    else:
        opt = [keras.ops.convert_to_numpy(v.value) for v in variables]
    return {
        "weights": [keras.ops.convert_to_numpy(w.value) for w in model.weights],
        "optimizer": opt,
        "train_acc": float(train_acc), "val_acc": float(val_acc), "losses": losses, "seen": seen,
    }


def assert_same(one, many):
    assert len(one["weights"]) == len(many["weights"]) and len(one["optimizer"]) == len(many["optimizer"])
    for a, b in zip(one["weights"] + one["optimizer"], many["weights"] + many["optimizer"]):
        np.testing.assert_allclose(b, a, atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(many["losses"], one["losses"], atol=TOLERANCE, rtol=TOLERANCE)
    assert abs(one["train_acc"] - many["train_acc"]) < TOLERANCE
    assert abs(one["val_acc"] - many["val_acc"]) < TOLERANCE


def compiled(kind):
    model = get_model()
    if kind == "model":
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2))
    return model


def guide_setup(devices, kind):
    """What the three guides set up before their loop: data, the model (distributed on several devices), the
    optimizer, the loss and the two accuracy metrics."""
    x, y = data()
    model = compiled(kind)
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
    return (x, y, model, make_optimizer(kind, model), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.metrics.SparseCategoricalAccuracy(), keras.metrics.SparseCategoricalAccuracy())


# ---- TensorFlow: the guide's tf.function loop


def tf_guide(devices, kind, lines=True):
    import tensorflow as tf

    x, y, model, optimizer, loss_fn, train_acc_metric, val_acc_metric = guide_setup(devices, kind)
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    val_dataset = tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(BATCH)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        train_acc_metric.update_state(y, logits)
        return loss_value

    @tf.function
    def test_step(x, y):
        val_logits = model(x, training=False)
        val_acc_metric.update_state(y, val_logits)

    seen = []
    if devices > 1 and lines:
        train_dataset = distkeras.distribute_dataset(train_dataset, model)
        val_dataset = distkeras.distribute_dataset(val_dataset, model)
        distkeras.attach(model, optimizer, train_acc_metric, val_acc_metric)
        train_step = distkeras.distribute_step(train_step, model)
        test_step = distkeras.distribute_step(test_step, model)
    losses = []
    for _epoch in range(2):
        for x_batch, y_batch in train_dataset:
            if devices > 1 and lines:  # what each replica computed: its part of the batch
                seen.append([int(v.shape[0]) for v in model.distribute_strategy.experimental_local_results(x_batch)])
            losses.append(float(train_step(x_batch, y_batch)))
    train_acc = float(train_acc_metric.result())
    for x_batch, y_batch in val_dataset:
        test_step(x_batch, y_batch)
    return outcome(model, optimizer, train_acc, val_acc_metric.result(), losses, seen)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the TensorFlow guide's loop")
@pytest.mark.parametrize("kind", ["adam", "sgd", "model"])
def test_tensorflow_guide_loop_equals_one_device(kind):
    one = tf_guide(1, kind)
    many = tf_guide(2, kind)
    assert_same(one, many)
    assert many["seen"][:6] == [[4, 4]] * 5 + [[2, 2]]  # two replicas, each half of every batch


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the TensorFlow guide's loop")
def test_tensorflow_loop_without_the_lines_says_what_to_add():
    # Raised while tf.function traces the step: TensorFlow re-raises it with the trace (a StagingError).
    with pytest.raises(Exception) as raised:
        tf_guide(2, "adam", lines=False)
    message = str(raised.value)
    assert "LoopError: optimizer.apply() of Adam" in message and "was not attached to it" in message
    assert "distkeras.attach(model, optimizer" in message and "distkeras.distribute_step(train_step" in message
    assert "tuple indices" not in message


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the TensorFlow guide's loop")
def test_tensorflow_attached_optimizer_outside_a_replica_step_is_an_error():
    import tensorflow as tf

    model = distkeras.distribute(compiled("model"), devices=2)
    x, y = data()
    with tf.GradientTape() as tape:  # the guide's eager loop body, on the whole batch
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[:8], model(x[:8], training=True))
    grads = tape.gradient(loss, model.trainable_weights)
    with pytest.raises(distkeras.LoopError, match="outside a replica step.*distribute_step"):
        model.optimizer.apply(grads, model.trainable_weights)


# ---- JAX: the guide's jitted stateless loop


def jax_guide(devices, kind, lines=True):
    import jax

    x, y, model, optimizer, loss_fn, train_acc_metric, val_acc_metric = guide_setup(devices, kind)
    train_dataset = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 40, BATCH)]  # 40: every batch splits
    val_dataset = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 16, BATCH)]

    def compute_loss_and_updates(trainable_variables, non_trainable_variables, metric_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x)
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

    @jax.jit
    def eval_step(state, data):
        trainable_variables, non_trainable_variables, metric_variables = state
        x, y = data
        y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x)
        metric_variables = val_acc_metric.stateless_update_state(metric_variables, y, y_pred)
        return y_pred, (trainable_variables, non_trainable_variables, metric_variables)

    if devices > 1 and lines:
        train_dataset = distkeras.distribute_dataset(train_dataset, model)
        val_dataset = distkeras.distribute_dataset(val_dataset, model)
        distkeras.attach(model, optimizer, train_acc_metric, val_acc_metric)
        train_step = distkeras.distribute_step(train_step, model)
        eval_step = distkeras.distribute_step(eval_step, model)
    optimizer.build(model.trainable_variables)

    def values(variables):  # JAX 0.10 takes arrays, not Keras variables, in a jitted function's state
        return [v.value for v in variables]

    state = (values(model.trainable_variables), values(model.non_trainable_variables), values(optimizer.variables),
             values(train_acc_metric.variables))
    losses = []
    for _epoch in range(2):
        for batch in train_dataset:
            loss, state = train_step(state, batch)
            losses.append(float(loss))
    trainable, non_trainable, optimizer_values, metric_values = state
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_values):
        variable.assign(value)
    for variable, value in zip(train_acc_metric.variables, metric_values):
        variable.assign(value)
    state = (trainable, non_trainable, values(val_acc_metric.variables))
    seen = []
    for batch in val_dataset:
        y_pred, state = eval_step(state, batch)
        seen.append(sorted(int(shard.data.shape[0]) for shard in y_pred.addressable_shards))
    for variable, value in zip(val_acc_metric.variables, state[2]):
        variable.assign(value)
    return outcome(model, optimizer, train_acc_metric.result(), val_acc_metric.result(), losses, seen)


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX guide's loop")
@pytest.mark.parametrize("kind", ["adam", "sgd", "model"])
def test_jax_guide_loop_equals_one_device(kind):
    one = jax_guide(1, kind)
    with Caught() as caught:
        many = jax_guide(2, kind)
    assert_same(one, many)
    assert many["seen"] == [[4, 4], [4, 4]]  # the logits of each replica's rows, on its own device
    assert not caught.messages


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX guide's loop")
def test_jax_loop_without_the_lines_warns_once():
    with Caught() as caught:
        without = jax_guide(2, "adam", lines=False)
    assert without["seen"] == [[8, 8], [8, 8]]  # every device computed the whole batch
    assert len(caught.messages) == 1, caught.messages
    assert "every device computes the whole batch" in caught.messages[0]
    assert "distkeras.distribute_step(train_step, model)" in caught.messages[0]


# ---- PyTorch: the guide's eager loop, in every process of a 2-process job


def torch_guide(devices, kind, lines=True):
    import torch

    x, y, model, optimizer, loss_fn, train_acc_metric, val_acc_metric = guide_setup(devices, kind)
    train_dataloader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=BATCH, shuffle=False)
    val_dataloader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x[:20]), torch.from_numpy(y[:20])), batch_size=BATCH)
    if devices > 1 and lines:
        train_dataloader = distkeras.distribute_dataset(train_dataloader, model)
        val_dataloader = distkeras.distribute_dataset(val_dataloader, model)
        distkeras.attach(model, optimizer, train_acc_metric, val_acc_metric)
    losses, seen = [], []
    with Caught() as caught:
        for _epoch in range(2):
            for inputs, targets in train_dataloader:
                seen.append(int(inputs.shape[0]))
                logits = model(inputs)
                loss = loss_fn(targets, logits)
                model.zero_grad()
                trainable_weights = [v for v in model.trainable_weights]
                loss.backward()
                if isinstance(optimizer, torch.optim.Optimizer):  # the guide's first loop
                    optimizer.step()
                else:
                    gradients = [v.value.grad for v in trainable_weights]
                    with torch.no_grad():
                        optimizer.apply(gradients, trainable_weights)
                train_acc_metric.update_state(targets, logits)
                losses.append(float(loss.detach()))
        train_acc = float(train_acc_metric.result())
        for x_batch_val, y_batch_val in val_dataloader:
            val_logits = model(x_batch_val, training=False)
            val_acc_metric.update_state(y_batch_val, val_logits)
        result = outcome(model, optimizer, train_acc, val_acc_metric.result(), losses, seen)
    result["warnings"] = caught.messages
    return result


@pytest.mark.skipif(BACKEND != "torch", reason="the PyTorch guide's loop")
@pytest.mark.parametrize("kind", ["adam", "torch", "model"])
def test_torch_guide_loop_equals_one_device(kind):
    one = torch_guide(1, kind)
    many = replicated(2, torch_guide, 2, kind)
    # Each rank's loss is its rows' mean: not compared; weights, optimizer state and metrics are.
    many["losses"] = one["losses"]
    assert_same(one, many)
    assert many["seen"][:6] == [4, 4, 4, 4, 4, 2]  # rank 0's rows of each batch: half
    assert not many["warnings"]


@pytest.mark.skipif(BACKEND != "torch", reason="the PyTorch guide's loop")
def test_torch_loop_without_the_lines_warns_once():
    without = replicated(2, torch_guide, 2, "adam", lines=False)
    assert without["seen"][:6] == [8, 8, 8, 8, 8, 4]  # the whole batch, on every rank
    assert len(without["warnings"]) == 1, without["warnings"]
    assert "every process computes the whole batch" in without["warnings"][0]
    assert "distkeras.distribute_dataset(train_dataset, model)" in without["warnings"][0]
