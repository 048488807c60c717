"""Programs of the Keras repository itself (github.com/keras-team/keras: ``examples/``, ``integration_tests/`` and
the trainer's own tests, ``keras/src/trainers/trainer_test.py``),
a second outside source beside keras-io's: written as each file writes its model, its custom layers and steps,
``compile()`` and its fit/evaluate/predict calls; only tiny (generated data in place of mnist, small widths, a
global batch of 12). The backend-specific custom-fit tests run on their own backend only, as their files do."""

import numpy as np

from tests.backends.corpus.common import ALL, BN_ADAM, distribute, evaluate, fit, keras, labels, predict, result, rng

E, T = "keras:examples/", "keras:integration_tests/"
#: Keras' own trainer tests (their models written with the public API where the test builds a private Trainer).
TR = "keras:keras/src/trainers/trainer_test.py"
SUM = ("not-one-device: add_loss(ops.sum(x)) sums each replica's own rows, so the loss and its gradient are half "
       "one device's (TensorFlow: loss -5.74 against -11.48, Adam momentum 0.6 against 1.2): a sum written by hand, "
       "which the one-device check catches at the first step")
CALLED_BEFORE_FIT = (
    "not-one-device: fails on TensorFlow: the subclassed model, unbuilt at distribute(), is called eagerly "
    "(model(x)) before fit(), and fit() then raises Keras' 'Unknown variable: ... This optimizer can only be called "
    "for the variables it was originally built with'. A distkeras defect, open: plain Keras trains it, and so does "
    "distkeras when the model is built or first called inside fit()")


def demo_functional(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(70)
    inputs = layers.Input((10,))
    x = layers.Dense(16, activation="relu")(inputs)
    residual = x
    x = layers.Dense(16, activation="relu")(x)
    x = layers.Dense(16, activation="relu")(x)
    x += residual
    x = layers.Dense(16, activation="relu")(x)
    residual = x
    x = layers.Dense(16, activation="relu")(x)
    x = layers.Dense(16, activation="relu")(x)
    x += residual
    outputs = layers.Dense(4)(x)
    model = k.Model(inputs, outputs)
    r = rng(71)
    x, y = r.random((30, 10)).astype("float32"), r.random((30, 4)).astype("float32")
    model.compile(optimizer=k.optimizers.Adam(learning_rate=0.001), loss=k.losses.MeanSquaredError(),
                  metrics=[k.metrics.CategoricalAccuracy(name="acc"), k.metrics.MeanSquaredError(name="mse")])
    model = distribute(model, devices)
    history = fit(model, x, y, validation_split=0.2)
    return result(model, history, evaluated=evaluate(model, x, y), predicted=predict(model, x))


def demo_mnist_convnet(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(72)
    r = rng(73)
    x_train = r.integers(0, 256, size=(30, 12, 12, 1)).astype("float32") / 255
    y_train = k.utils.to_categorical(labels(74, 30, 10), 10)
    model = k.Sequential([
        layers.Input(shape=(12, 12, 1)),
        layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    model = distribute(model, devices)
    history = fit(model, x_train, y_train, validation_split=0.1)
    return result(model, history, evaluated=evaluate(model, x_train[:12], y_train[:12]))


class _Subclassed:
    """demo_subclass.py's and basic_full_flow.py's MyModel (three Dense layers), made for the current Keras."""

    @staticmethod
    def make(hidden_dim, output_dim):
        k = keras()

        class MyModel(k.Model):
            def __init__(self, hidden_dim, output_dim, **kwargs):
                super().__init__(**kwargs)
                self.hidden_dim, self.output_dim = hidden_dim, output_dim
                self.dense1 = k.layers.Dense(hidden_dim, activation="relu")
                self.dense2 = k.layers.Dense(hidden_dim, activation="relu")
                self.dense3 = k.layers.Dense(output_dim)

            def call(self, x):
                x = self.dense1(x)
                x = self.dense2(x)
                return self.dense3(x)

        return MyModel(hidden_dim, output_dim)


def demo_subclass(devices):
    k = keras()
    k.utils.set_random_seed(75)
    model = _Subclassed.make(16, 4)
    r = rng(76)
    x, y = r.random((30, 8)).astype("float32"), r.random((30, 4)).astype("float32")
    model.compile(optimizer=k.optimizers.SGD(learning_rate=0.001), loss=k.losses.MeanSquaredError(),
                  metrics=[k.metrics.MeanSquaredError()])
    model = distribute(model, devices)
    history = fit(model, x, y, validation_split=0.2)
    return result(model, history, predicted=predict(model, x[:12]))


def basic_full_flow(devices):
    k = keras()
    k.utils.set_random_seed(77)
    model = _Subclassed.make(2, 1)
    r = rng(78)
    x, y = r.random((36, 4)).astype("float32"), r.random((36, 4)).astype("float32")
    model.compile(optimizer=k.optimizers.SGD(learning_rate=0.001), loss=k.losses.MeanSquaredError(),
                  metrics=[k.metrics.MeanSquaredError()])
    model = distribute(model, devices)
    before = k.ops.convert_to_numpy(model(x))
    history = fit(model, x, y, epochs=3, validation_split=0.2)
    after = k.ops.convert_to_numpy(model(x))
    assert not np.allclose(before, after)  # the file's assertNotAllClose
    return result(model, history, predicted=predict(model, x[:12]))


def demo_custom_layer_backend_agnostic(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(79)

    class MyDense(layers.Layer):
        def __init__(self, units, name=None):
            super().__init__(name=name)
            self.units = units

        def build(self, input_shape):
            input_dim = input_shape[-1]
            self.w = self.add_weight(shape=(input_dim, self.units), initializer=k.initializers.GlorotNormal(),
                                     name="kernel", trainable=True)
            self.b = self.add_weight(shape=(self.units,), initializer=k.initializers.Zeros(), name="bias",
                                     trainable=True)

        def call(self, inputs):
            return ops.matmul(inputs, self.w) + self.b

    class MyDropout(layers.Layer):
        def __init__(self, rate, name=None):
            super().__init__(name=name)
            self.rate = rate
            self.seed_generator = k.random.SeedGenerator(1337)

        def call(self, inputs):
            return k.random.dropout(inputs, self.rate, seed=self.seed_generator)

    class MyModel(k.Model):
        def __init__(self, hidden_dim, output_dim):
            super().__init__()
            self.dense1 = MyDense(hidden_dim)
            self.dense2 = MyDense(hidden_dim)
            self.dense3 = MyDense(output_dim)
            self.dp = MyDropout(0.5)

        def call(self, x):
            x1 = self.dense1(x)
            x2 = self.dense2(x)
            x = ops.concatenate([x1, x2], axis=-1)
            x = self.dp(x)
            return self.dense3(x)

    model = MyModel(hidden_dim=16, output_dim=4)
    r = rng(80)
    x, y = r.random((24, 8)).astype("float32"), r.random((24, 4)).astype("float32")
    model.compile(optimizer=k.optimizers.SGD(learning_rate=0.001), loss=k.losses.MeanSquaredError(),
                  metrics=[k.metrics.MeanSquaredError()])
    model = distribute(model, devices)
    history = fit(model, x, y)
    return result(model, history)


def numerical_test(devices):
    """integration_tests/numerical_test.py's Keras side: a convnet with BatchNormalization, compiled with
    ``jit_compile=False, run_eagerly=True``, fit unshuffled, then predict and evaluate."""
    k = keras()
    k.utils.set_random_seed(1337)
    r = rng(81)
    x_train = r.integers(0, 256, size=(24, 12, 12, 1)).astype("float32") / 255
    y_train = k.utils.to_categorical(labels(82, 24, 10), 10)
    model = k.Sequential([
        k.Input(shape=(12, 12, 1)),
        k.layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
        k.layers.BatchNormalization(),
        k.layers.MaxPooling2D(pool_size=(2, 2)),
        k.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        k.layers.BatchNormalization(scale=False, center=True),
        k.layers.MaxPooling2D(pool_size=(2, 2)),
        k.layers.Flatten(),
        k.layers.Dense(10, activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["mae", "accuracy"],
                  jit_compile=False, run_eagerly=True)
    model = distribute(model, devices)
    history = fit(model, x_train, y_train, epochs=1)
    return result(model, history, evaluated=evaluate(model, x_train, y_train), predicted=predict(model, x_train))


def _custom_fit_data():
    r = rng(83)
    return r.random((24, 32)).astype("float32"), r.random((24, 1)).astype("float32")


def _custom_fit_model(CustomModel):
    k = keras()
    k.utils.set_random_seed(84)
    inputs = k.Input(shape=(32,))
    outputs = k.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam")
    return model


def _custom_fit_run(CustomModel, devices):
    model = distribute(_custom_fit_model(CustomModel), devices)
    x, y = _custom_fit_data()
    history = fit(model, x, y, epochs=1)
    assert "loss" in history.history and "mae" in history.history
    return result(model, history)


def tf_custom_fit(devices):
    import tensorflow as tf

    k = keras()

    class CustomModel(k.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = k.metrics.Mean(name="loss")
            self.mae_metric = k.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = k.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return _custom_fit_run(CustomModel, devices)


def torch_custom_fit(devices):
    import torch

    k = keras()

    class CustomModel(k.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = k.metrics.Mean(name="loss")
            self.mae_metric = k.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = k.losses.MeanSquaredError()

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
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return _custom_fit_run(CustomModel, devices)


def jax_custom_fit(devices):
    import jax

    k = keras()

    class CustomModel(k.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = k.metrics.Mean(name="loss")
            self.mae_metric = k.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = k.losses.MeanSquaredError()

        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
            y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                                  training=training)
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
            loss_tracker_vars = metrics_variables[: len(self.loss_tracker.variables)]
            mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
            loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss)
            mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred)
            logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                    self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
            state = (trainable_variables, non_trainable_variables, optimizer_variables,
                     loss_tracker_vars + mae_metric_vars)
            return logs, state

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return _custom_fit_run(CustomModel, devices)


def _xy(seed, n, features, out):
    r = rng(seed)
    return r.random((n, features)).astype("float32"), r.random((n, out)).astype("float32")


def trainer_internal_only_loss(devices):
    """keras/src/trainers/trainer_test.py, test_internal_only_loss: a layer's ``add_loss(ops.sum(x))`` is the
    only loss (compile without one)."""
    k = keras()
    ops, layers = k.ops, k.layers
    k.utils.set_random_seed(85)

    class LossLayer(layers.Layer):
        def call(self, x):
            self.add_loss(ops.sum(x))
            return x

    model = k.Sequential([k.Input((2,)), layers.Dense(2), LossLayer(), layers.Dense(1)])
    model.compile(optimizer="adam")
    x, y = _xy(86, 24, 2, 1)
    model = distribute(model, devices)
    history = fit(model, x, y)
    return result(model, history)


def trainer_constraints_are_applied(devices):
    """test_constraints_are_applied: a ``non_neg`` kernel constraint, RMSprop."""
    k = keras()
    k.utils.set_random_seed(87)
    model = k.Sequential([k.Input((3,)), k.layers.Dense(2, kernel_constraint="non_neg")])
    model.compile(optimizer="rmsprop", loss="mse")
    x, y = _xy(88, 24, 3, 2)
    model = distribute(model, devices)
    history = fit(model, x, y)
    assert np.min(np.asarray(model.layers[0].kernel)) >= 0.0
    return result(model, history)


def _compute_loss_model(metric_of, regularized):
    k = keras()

    class MyModel(k.Model):
        def __init__(self):
            super().__init__()
            self.custom_metric = k.metrics.Mean(name="custom")
            self.dense = k.layers.Dense(2, activity_regularizer="l2" if regularized else None)

        def call(self, x):
            return self.dense(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training)
            self.custom_metric.update_state(metric_of(self, loss))
            return loss

    return MyModel()


def trainer_metric_update_in_compute_loss(devices):
    """test_metric_update_in_compute_loss: a ``compute_loss`` override updates a Mean of ``loss * 4``."""
    k = keras()
    k.utils.set_random_seed(89)
    model = _compute_loss_model(lambda model, loss: loss * 4, False)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _xy(90, 24, 4, 2)
    model = distribute(model, devices)
    history = fit(model, x, y * 2)
    np.testing.assert_allclose(history.history["custom"][0], history.history["loss"][0] * 4, rtol=1e-5)
    return result(model, history, evaluated=evaluate(model, x, y * 2))


def trainer_fwd_pass_loss_presence_in_compute_loss(devices):
    """test_fwd_pass_loss_presence_in_compute_loss: an ``activity_regularizer``'s loss read in ``compute_loss``
    (``sum(self.losses)``) into a custom Mean."""
    k = keras()
    k.utils.set_random_seed(91)
    model = _compute_loss_model(lambda model, loss: sum(model.losses), True)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _xy(92, 24, 4, 2)
    model = distribute(model, devices)
    history = fit(model, x, y * 2)
    assert history.history["custom"][0] > 0.0
    return result(model, history)


def trainer_loss_weights(devices):
    """test_loss_weights' dict-output case, written with the public API: two inputs and outputs, an MSE each,
    ``loss_weights={"y_one": 0.1, "y_two": 0.2}``, per-output metrics, SGD."""
    k = keras()
    k.utils.set_random_seed(93)
    x_one, x_two = k.Input((4,), name="x_one"), k.Input((4,), name="x_two")
    y_one = k.layers.Dense(3, use_bias=False, name="y_one")(x_one)
    y_two = k.layers.Dense(3, use_bias=False, name="y_two")(x_two)
    model = k.Model({"x_one": x_one, "x_two": x_two}, {"y_one": y_one, "y_two": y_two})
    model.compile(optimizer=k.optimizers.SGD(),
                  loss={"y_one": k.losses.MeanSquaredError(), "y_two": k.losses.MeanSquaredError()},
                  metrics={"y_one": k.metrics.MeanSquaredError(), "y_two": k.metrics.MeanSquaredError()},
                  loss_weights={"y_one": 0.1, "y_two": 0.2})
    r = rng(94)
    x = {"x_one": r.random((24, 4)).astype("float32"), "x_two": r.random((24, 4)).astype("float32")}
    y = {"y_one": r.random((24, 3)).astype("float32"), "y_two": r.random((24, 3)).astype("float32")}
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=3)
    return result(model, history, evaluated=evaluate(model, x, y))


def trainer_partial_loss_partial_label(devices):
    """test_partial_loss_partial_label: three outputs, a loss on the first only (``loss=["mse", None, None]``);
    fit as well as the test's evaluate."""
    k = keras()
    k.utils.set_random_seed(95)
    inputs = k.Input((2,))
    x = k.layers.Dense(3)(inputs)
    model = k.Model(inputs, [x, x, x])
    model.compile(optimizer="sgd", loss=["mse", None, None])
    data, labels_ = _xy(96, 24, 2, 3)
    model = distribute(model, devices)
    history = fit(model, data, labels_)
    return result(model, history, evaluated=evaluate(model, data, labels_))


PROGRAMS = {
    "demo_functional": (E + "demo_functional.py", 1e-5, ALL, "slow", "pass"),
    "demo_mnist_convnet": (E + "demo_mnist_convnet.py", 1e-5, ALL, "slow", "pass"),
    "demo_subclass": (E + "demo_subclass.py", 1e-5, ALL, "slow", "pass"),
    "demo_custom_layer_backend_agnostic": (E + "demo_custom_layer_backend_agnostic.py", 1e-5, ALL, "slow", "pass"),
    "basic_full_flow": (T + "basic_full_flow.py", 1e-5, ALL, "slow", {"tensorflow": CALLED_BEFORE_FIT}),
    "numerical_test": (T + "numerical_test.py", BN_ADAM, ALL, "slow", "pass"),
    "tf_custom_fit": (T + "tf_custom_fit_test.py", 1e-5, ("tensorflow",), "slow", "pass"),
    "torch_custom_fit": (T + "torch_custom_fit_test.py", 1e-5, ("torch",), "slow", "pass"),
    "jax_custom_fit": (T + "jax_custom_fit_test.py", 1e-5, ("jax",), "slow", "pass"),
    "trainer_internal_only_loss": (TR, 1e-5, ALL, "slow", {"tensorflow": SUM, "torch": SUM}),
    "trainer_constraints_are_applied": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_metric_update_in_compute_loss": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_fwd_pass_loss_presence_in_compute_loss": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_loss_weights": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_partial_loss_partial_label": (TR, 1e-5, ALL, "slow", "pass"),
}
