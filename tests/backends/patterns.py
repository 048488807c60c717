"""Common Keras usage patterns for the compatibility suite (``test_compat.py``), one function each.

``run(name, devices)`` builds the pattern's model from a fixed seed (so every run starts from the same
weights), distributes it over ``devices`` (1 = plain Keras, untouched), trains it as the pattern says and
returns plain data: the initial and final weights, the History, and how many replicas the *framework*
says ran (TensorFlow: the strategy's replicas and the devices of a mirrored variable; JAX: the devices
holding a variable; PyTorch: the process group's size and the distinct process ids of its ranks).

A pattern is ``build(keras) -> (model, x, y, fit_kwargs)``. Models are tiny and data small; no shuffling,
no dropout, so the single-device run is reproducible. A Dense layer that feeds a BatchNormalization has
no bias: BN cancels it, so its exact gradient is zero and any optimizer that normalises the step (Adam)
would turn rounding noise into updates of learning-rate size.
"""

import os

import numpy as np

SAMPLES = 60
BATCH = 12  # 60 / 12: five even steps on 2 and 3 replicas, then the callbacks' epochs


def _data(samples=SAMPLES, features=6, outputs=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.normal(size=(samples, outputs)).astype("float32")
    return x, y


def _mlp(keras, optimizer, **compile_kwargs):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], **compile_kwargs)
    x, y = _data()
    return model, x, y, {}


def sequential(keras):
    return _mlp(keras, keras.optimizers.SGD(0.1))


def functional_multi_io(keras):
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(a), b])
    out1 = keras.layers.Dense(3, name="reg")(h)
    out2 = keras.layers.Dense(2, activation="softmax", name="cls")(h)
    model = keras.Model({"a": a, "b": b}, {"reg": out1, "cls": out2})
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
        loss_weights={"reg": 1.0, "cls": 0.5},
        metrics={"cls": ["accuracy"]},
    )
    x, y = _data()
    rng = np.random.default_rng(2)
    xs = {"a": x, "b": rng.normal(size=(SAMPLES, 4)).astype("float32")}
    ys = {"reg": y, "cls": rng.integers(0, 2, size=(SAMPLES,))}
    return model, xs, ys, {}


def embedding_lstm(keras):
    model = keras.Sequential(
        [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.LSTM(6), keras.layers.Dense(3)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(3)
    x = rng.integers(0, 20, size=(SAMPLES, 5)).astype("int32")
    return model, x, _data()[1], {}


def custom_layer_losses(keras):
    class Scaled(keras.layers.Layer):
        """A custom layer with a weight regulariser and an activity loss through add_loss()."""

        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], 8), initializer="glorot_uniform",
                                     regularizer=keras.regularizers.L2(0.01))

        def call(self, x):
            h = keras.ops.tanh(keras.ops.matmul(x, self.w))
            self.add_loss(0.001 * keras.ops.mean(keras.ops.square(h)))
            return h

    model = keras.Sequential([keras.Input((6,)), Scaled(), keras.layers.Dense(3, kernel_regularizer="l2")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    return model, x, y, {}


def _subclassed_classes(keras):
    class Opaque(keras.Model):
        """The Keras guide's style: layers made in __init__, which takes a layer and a function; no get_config."""

        def __init__(self, body, activation):
            super().__init__()
            self.body = body
            self.activation = activation
            self.head = keras.layers.Dense(3)

        def call(self, x):
            return self.head(self.activation(self.body(x)))

    return Opaque


def subclassed_without_config(keras):
    model = _subclassed_classes(keras)(keras.layers.Dense(16), keras.activations.tanh)
    x, y = _data()
    model(x[:1])  # a subclassed model creates its weights on its first call
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model, x, y, {}


def subclassed_with_config(keras):
    class Configurable(keras.Model):
        def __init__(self, width=16, **kwargs):
            super().__init__(**kwargs)
            self.width = width
            self.hidden = keras.layers.Dense(width, activation="tanh")
            self.head = keras.layers.Dense(3)

        def call(self, x):
            return self.head(self.hidden(x))

        def get_config(self):
            return {**super().get_config(), "width": self.width}

    model = Configurable(16)
    x, y = _data()
    model(x[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model, x, y, {}


def nested_models(keras):
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh")], name="inner")
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(inner(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    return model, x, y, {}


def sgd_schedule(keras):
    return _mlp(keras, keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.2, 3, 0.5), momentum=0.9))


def adamw_schedule(keras):
    schedule = keras.optimizers.schedules.CosineDecay(0.01, 10, warmup_target=0.02, warmup_steps=3)
    return _mlp(keras, keras.optimizers.AdamW(schedule, weight_decay=0.05))


def clipnorm(keras):
    return _mlp(keras, keras.optimizers.SGD(0.5, clipnorm=0.05))


def global_clipnorm(keras):
    return _mlp(keras, keras.optimizers.SGD(0.5, global_clipnorm=0.1))


def clipvalue(keras):
    return _mlp(keras, keras.optimizers.SGD(0.5, clipvalue=0.01))


def ema(keras):
    return _mlp(keras, keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3))


def accumulation(keras):
    return _mlp(keras, keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=2))


def mixed_float16(keras):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, x, y, kwargs = _mlp(keras, keras.optimizers.SGD(0.1))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    return model, x, y, kwargs


def mixed_bfloat16(keras):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        return _mlp(keras, keras.optimizers.SGD(0.1))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def batchnorm_convnet(keras):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = _data(features=36)
    return model, x.reshape(-1, 6, 6, 1), y, {}


def callbacks_lr_and_early_stop(keras):
    model, x, y, _ = _mlp(keras, keras.optimizers.SGD(0.1))
    callbacks = [
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
        keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0),
    ]
    return model, x, y, {"callbacks": callbacks, "epochs": 6}


def sample_and_class_weights(keras):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, _ = _data()
    y = np.random.default_rng(4).integers(0, 3, size=(SAMPLES,))
    sample_weight = np.linspace(0.2, 2.0, SAMPLES).astype("float32")
    return model, x, y, {"sample_weight": sample_weight, "class_weight": None}


def class_weights(keras):
    model, x, y, _ = sample_and_class_weights(keras)
    return model, x, y, {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}


def trained_before_distribute(keras):
    model, x, y, kwargs = _mlp(keras, keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # momenta and iterations to carry over
    return model, x, y, kwargs


def steps_per_execution(keras):
    """Several steps per call (Keras after 3.15 stacks them into one scan on JAX), at a global batch of 10:
    3 replicas don't divide it."""
    model, x, y, _ = _mlp(keras, keras.optimizers.SGD(0.1), steps_per_execution=2)
    return model, x, y, {"batch_size": 10}


def stateful_lstm(keras):
    """An LSTM that carries its state from batch to batch for a fixed batch (batch_shape): JAX runs each global
    batch as one program; TensorFlow and PyTorch cut it per replica, and distkeras refuses it there (NOT_ON)."""
    model = keras.Sequential(
        [keras.Input(batch_shape=(BATCH, 5, 4)), keras.layers.LSTM(6, stateful=True, name="stateful_lstm"),
         keras.layers.Dense(3)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(4).normal(size=(SAMPLES, 5, 4)).astype("float32")
    return model, x, _data()[1], {}


#: name -> (build, weight tolerance). float16 and bfloat16 compute rounds at 1e-4 and 1e-3 (measured: max |ΔW| 1.2e-4
#: and 6.4e-4 on TF and JAX); everything else agrees to float32 rounding.
PATTERNS = {
    "sequential": (sequential, 1e-5),
    "functional_multi_io": (functional_multi_io, 1e-5),
    "embedding_lstm": (embedding_lstm, 1e-5),
    "custom_layer_losses": (custom_layer_losses, 1e-5),
    "subclassed_without_config": (subclassed_without_config, 1e-5),
    "subclassed_with_config": (subclassed_with_config, 1e-5),
    "nested_models": (nested_models, 1e-5),
    "sgd_schedule": (sgd_schedule, 1e-5),
    "adamw_schedule": (adamw_schedule, 1e-5),
    "clipnorm": (clipnorm, 1e-5),
    "global_clipnorm": (global_clipnorm, 1e-5),
    "clipvalue": (clipvalue, 1e-5),
    "ema": (ema, 1e-5),
    "accumulation": (accumulation, 1e-5),
    "mixed_float16": (mixed_float16, 5e-4),
    "mixed_bfloat16": (mixed_bfloat16, 2e-3),
    "batchnorm_convnet": (batchnorm_convnet, 1e-4),
    "callbacks_lr_and_early_stop": (callbacks_lr_and_early_stop, 1e-5),
    "sample_and_class_weights": (sample_and_class_weights, 1e-5),
    "class_weights": (class_weights, 1e-5),
    "trained_before_distribute": (trained_before_distribute, 1e-5),
    "steps_per_execution": (steps_per_execution, 1e-5),
    "stateful_lstm": (stateful_lstm, 1e-5),
}

#: Patterns a backend's Keras itself can't run: torch refuses steps_per_execution > 1 ("must be 1 with the
#: PyTorch backend"), and Keras 3.15's TensorFlow trainer fails with it under any MirroredStrategy, plain Keras
#: too (InvalidArgumentError at a placeholder in its step loop; checked without distkeras). A stateful RNN keeps its
#: state for the whole batch, which TensorFlow's and PyTorch's replicas each run a share of: distkeras refuses it
#: there (test_compat.test_a_stateful_rnn_is_refused_where_replicas_cut_the_batch).
NOT_ON = {"steps_per_execution": ("torch", "tensorflow"), "stateful_lstm": ("torch", "tensorflow")}


def names(backend):
    return sorted(name for name in PATTERNS if backend not in NOT_ON.get(name, ()))


def replicas_seen(model):
    """How many replicas the framework itself says trained ``model``: (replicas, distinct places)."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        strategy = model.distribute_strategy
        value = model.trainable_weights[0].value
        devices = {v.device for v in getattr(value, "values", (value,))}
        return strategy.num_replicas_in_sync, len(devices)
    if backend == "jax":
        devices = model.trainable_weights[0].value.sharding.device_set
        return len(devices), len({d.id for d in devices})
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1, 1
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return dist.get_world_size(), len(set(pids))


def run(name, devices, inspect=None, **options):
    """Train pattern ``name`` on ``devices`` (1: plain Keras); initial and final weights, History, replicas.

    ``options`` go to ``distribute()``; ``inspect(model)``, called after training, adds its plain-data result
    as "inspected"."""
    import keras

    import distkeras

    build, _ = PATTERNS[name]
    keras.utils.set_random_seed(0)
    model, x, y, kwargs = build(keras)
    initial = [np.asarray(w, dtype="float32") for w in model.get_weights()]
    if devices > 1:
        distributed = distkeras.distribute(model, devices=devices, **options)
        assert distributed is model, "distribute() must return the user's own model"
    kwargs = dict(kwargs)
    fit_kwargs = {"batch_size": BATCH, "epochs": kwargs.pop("epochs", 2), "shuffle": False, "verbose": 0}
    fit_kwargs.update(kwargs)
    history = model.fit(x, y, **fit_kwargs)
    if options.get("shard") == "all":  # weights held by their owners only: get_weights() gathers them
        weights = [np.asarray(w, dtype="float32") for w in model.get_weights()]
    else:
        weights = [np.asarray(keras.ops.convert_to_numpy(w), dtype="float32") for w in model.weights]
    return {
        "initial": initial,
        "weights": weights,
        "paths": [w.path for w in model.weights],
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "replicas": replicas_seen(model),
        "inspected": None if inspect is None else inspect(model),
    }


def custom_train_step(keras):
    """A train_step written as the Keras guide "Customizing what happens in fit()" shows for the backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        class Custom(keras.Sequential):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                gradients = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(gradients, self.trainable_variables)
                return _update_metrics(self, loss, y, y_pred)

    elif backend == "jax":
        import jax

        class Custom(keras.Sequential):
            def compute_loss_and_updates(self, trainable, non_trainable, metrics_variables, x, y, training=False):
                y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
                loss, (trainable, non_trainable, metrics_variables) = self.stateless_compute_loss(
                    trainable, non_trainable, metrics_variables, x=x, y=y, y_pred=y_pred, training=training)
                return loss, (y_pred, non_trainable, metrics_variables)

            def train_step(self, state, data):
                trainable, non_trainable, optimizer_variables, metrics_variables = state
                x, y = data
                grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
                (loss, (y_pred, non_trainable, metrics_variables)), grads = grad_fn(
                    trainable, non_trainable, metrics_variables, x, y, training=True)
                trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
                new_metrics = []
                for metric in self.metrics:
                    this = metrics_variables[len(new_metrics):len(new_metrics) + len(metric.variables)]
                    if metric.name == "loss":
                        this = metric.stateless_update_state(this, loss)
                    else:
                        this = metric.stateless_update_state(this, y, y_pred)
                    new_metrics += list(this)
                logs = {m.name: m.stateless_result(new_metrics[i:i + len(m.variables)])
                        for i, m in zip(_offsets(self.metrics), self.metrics)}
                return logs, (trainable, non_trainable, optimizer_variables, new_metrics)

    else:
        import torch

        class Custom(keras.Sequential):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                loss.backward()
                trainable_weights = [v for v in self.trainable_weights]
                gradients = [v.value.grad for v in trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(gradients, trainable_weights)
                return _update_metrics(self, loss, y, y_pred)

    model = Custom([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    x, y = _data()
    return model, x, y, {}


def _update_metrics(model, loss, y, y_pred):
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in model.metrics}


def _offsets(metrics):
    offsets, at = [], 0
    for metric in metrics:
        offsets.append(at)
        at += len(metric.variables)
    return offsets


PATTERNS["custom_train_step"] = (custom_train_step, 1e-5)
