"""Programs of the Keras repository itself (github.com/keras-team/keras: ``examples/`` and ``integration_tests/``;
its trainer's own tests are in ``kerastrainer``), a second outside source beside keras-io's: written as each file
writes its model, its custom layers and steps, ``compile()`` and its fit/evaluate/predict calls; only tiny
(generated data in place of mnist, small widths, a global batch of 12). The backend-specific custom-fit tests run on
their own backend only, as their files do; they are one pattern, keras-io's custom fit (:func:`custom_fit_test`)."""

import numpy as np

from tests.backends.corpus.common import ALL, BN_ADAM, distribute, evaluate, fit, keras, labels, predict, result, rng
from tests.backends.realcode import custom_fit_class

E, T = "keras:examples/", "keras:integration_tests/"


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


def custom_fit_test(devices):
    """integration_tests/{tf,torch,jax}_custom_fit_test.py: one program on three backends, each file's
    ``CustomModel`` (a ``train_step`` of the running backend's own autodiff, a ``Loss`` object and two metric
    trackers of its own). The three files write keras.io's custom-train-step guides' model again, so the model is
    :func:`tests.backends.realcode.custom_fit_class`, the keras-io suite's (whose extra ``test_step`` is not run
    here): one pattern, counted once."""
    k = keras()
    k.utils.set_random_seed(84)
    inputs = k.Input(shape=(32,))
    outputs = k.layers.Dense(1)(inputs)
    model = custom_fit_class(k)(inputs, outputs)
    model.compile(optimizer="adam")
    model = distribute(model, devices)
    r = rng(83)
    x, y = r.random((24, 32)).astype("float32"), r.random((24, 1)).astype("float32")
    history = fit(model, x, y, epochs=1)
    assert "loss" in history.history and "mae" in history.history
    return result(model, history)


#: Each file runs on its own backend only.
tf_custom_fit = torch_custom_fit = jax_custom_fit = custom_fit_test


PROGRAMS = {
    "demo_functional": (E + "demo_functional.py", 1e-5, ALL, "slow", "pass"),
    "demo_mnist_convnet": (E + "demo_mnist_convnet.py", 1e-5, ALL, "slow", "pass"),
    "demo_subclass": (E + "demo_subclass.py", 1e-5, ALL, "slow", "pass"),
    "demo_custom_layer_backend_agnostic": (E + "demo_custom_layer_backend_agnostic.py", 1e-5, ALL, "slow", "pass"),
    "basic_full_flow": (T + "basic_full_flow.py", 1e-5, ALL, "slow", "pass"),
    "numerical_test": (T + "numerical_test.py", BN_ADAM, ALL, "slow", "pass"),
    "tf_custom_fit": (T + "tf_custom_fit_test.py", 1e-5, ("tensorflow",), "slow", "pass"),
    "torch_custom_fit": (T + "torch_custom_fit_test.py", 1e-5, ("torch",), "slow", "pass"),
    "jax_custom_fit": (T + "jax_custom_fit_test.py", 1e-5, ("jax",), "slow", "pass"),
}
