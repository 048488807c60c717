"""Training scenarios for the equivalence tests: one model, one data set, one fit() call each.

``train(case, devices)`` builds the scenario's model from a fixed seed (so every run starts from the
same weights), distributes it over ``devices`` (1 = plain Keras, untouched), fits it and returns the
final weights and the history.

The other functions are the bodies of the multi-device tests in ``test_distribute.py``, which run them
through ``harness.replicated()`` (in the test process, or on every rank of a PyTorch job) and check what
they return. They return plain data, never a model.
"""

import os

import numpy as np

#: name -> (samples, global batch, epochs, kernel regularizer). SGD, no dropout, no shuffling.
CASES = {
    "even": (96, 12, 2, None),  # every batch splits evenly over 2 and 3 replicas
    "uneven_tail": (100, 12, 2, None),  # last batch of 4: 2+2 on 2 replicas, 2+1+1 on 3
    "batch_not_divisible": (101, 10, 2, None),  # 10 on 3 replicas: 4+3+3; last batch of 1
    "l2": (96, 12, 2, "l2"),  # regularisation losses must not count once per replica
}


def data(samples, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = rng.normal(size=(samples, 3)).astype("float32")
    return x, y


def build(keras, regularizer=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"])
    return model


def train(case, devices, **options):
    import keras

    import distkeras

    samples, batch, epochs, regularizer = CASES[case]
    model = build(keras, regularizer)
    if devices > 1:
        model = distkeras.distribute(model, devices=devices, **options)
    x, y = data(samples)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], history.history


def sample_count():
    """A metric counting the samples a step saw, summed over replicas."""
    import keras

    class SampleCount(keras.metrics.Metric):
        def __init__(self, name="samples", **kwargs):
            super().__init__(name=name, **kwargs)
            self.count = self.add_variable(shape=(), initializer="zeros", name="count", aggregation="sum")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], self.count.dtype))

        def result(self):
            # A tensor, not the variable itself: JAX refuses a Keras variable as the output of a traced step.
            return keras.ops.convert_to_tensor(self.count)

    return SampleCount()


def count_samples(devices):
    """101 samples, global batch 10: the samples fit(), evaluate() and predict() saw."""
    import keras

    import distkeras

    model = build(keras)
    model.compile(optimizer="sgd", loss="mse", metrics=[sample_count()])
    model = distkeras.distribute(model, devices=devices)
    x, y = data(101)
    history = model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    return history.history["samples"], evaluated["samples"], model.predict(x, batch_size=10, verbose=0).shape


def compile_config(devices):
    """A model compiled with non-default settings, and what distribute() made of it."""
    import keras

    import distkeras

    model = build(keras)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.0123, beta_1=0.8),
        loss=keras.losses.Huber(delta=0.5),
        metrics=["mae", keras.metrics.RootMeanSquaredError(name="rmse")],
    )
    dist = distkeras.distribute(model, devices=devices)
    x, y = data(24)
    return {
        "class": type(model),
        "dist_class": type(dist),
        "weights": model.get_weights(),
        "dist_weights": dist.get_weights(),
        "optimizer_class": type(model.optimizer),
        "dist_optimizer_class": type(dist.optimizer),
        "learning_rate": float(keras.ops.convert_to_numpy(dist.optimizer.learning_rate)),
        "beta_1": dist.optimizer.beta_1,
        "logs": dist.evaluate(x, y, batch_size=12, verbose=0, return_dict=True),
        "expected": model.evaluate(x, y, batch_size=12, verbose=0, return_dict=True),
    }


def compile_after_distribute(devices):
    """An uncompiled model, distributed, then compiled and fitted: its first kernel afterwards."""
    import numpy as np
    import keras

    import distkeras

    model = build(keras)
    fresh = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    fresh.set_weights(model.layers[-1].get_weights()[:1] * 0 + [np.ones((5, 3), "float32"), np.zeros(3, "float32")])
    dist = distkeras.distribute(fresh, devices=devices)
    dist.compile(optimizer="sgd", loss="mse")
    x, y = data(24)
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)
    return dist.get_weights()[0]


def continue_training(devices):
    """One epoch with momentum on one device, then one more on one device and, from the same start,
    distributed: (single-device weights, the distributed optimizer's iterations, distributed weights)."""
    import keras

    import distkeras

    x, y = data(96)

    def start():
        model = build(keras)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        return model

    single = start()
    single.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    dist = distkeras.distribute(start(), devices=devices)
    iterations = int(keras.ops.convert_to_numpy(dist.optimizer.iterations))
    dist.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    return single.get_weights(), iterations, dist.get_weights()


def describe(devices):
    import keras

    import distkeras

    return distkeras.describe(distkeras.distribute(build(keras), devices=devices))


def global_batch_sizes(devices):
    """global_batch_size() of a model distributed over ``devices``, of devices=2, and of every device."""
    import keras

    import distkeras

    dist = distkeras.distribute(build(keras), devices=devices)
    return distkeras.global_batch_size(32, dist), distkeras.global_batch_size(32, devices=2), distkeras.global_batch_size(16)


def fit_and_save(devices, directory):
    """Fit a distributed model on 36 samples, save it as m.keras and m.weights.h5; its predictions."""
    import keras

    import distkeras

    dist = distkeras.distribute(build(keras), devices=devices)
    x, y = data(36)
    dist.fit(x, y, batch_size=12, epochs=1, verbose=0)
    dist.save(os.path.join(directory, "m.keras"))
    dist.save_weights(os.path.join(directory, "m.weights.h5"))
    return dist.predict(x, verbose=0)


def after_rank0_wrote():
    """What a user's script does before other ranks read rank 0's file (README: no rank waits for
    another's file): on PyTorch, where replicas are processes, a barrier after rank 0's save() returned."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_load_rounds(devices, directory, rounds=3):
    """distribute, save, load, again: the loaded model's layer classes and weight count per round."""
    import keras

    import distkeras

    model = build(keras)
    seen = []
    for round_ in range(rounds):
        model = distkeras.distribute(model, devices=devices)
        path = os.path.join(directory, "round{}.keras".format(round_))
        model.save(path)
        after_rank0_wrote()
        model = keras.saving.load_model(path)
        seen.append(([type(layer).__name__ for layer in model.layers], len(model.weights)))
    return seen


def cpu_devices_after_start(devices, count):
    """distribute() over ``devices`` (the backend has started), then ask for ``count`` CPU devices: the error."""
    import keras

    import distkeras
    from distkeras.api import CPU_DEVICES_ENV

    distkeras.distribute(build(keras), devices=devices)
    before = os.environ.get(CPU_DEVICES_ENV)
    try:
        distkeras.use_cpu_devices(count)
    except distkeras.DistKerasError as exc:
        return exc
    finally:  # use_cpu_devices() sets the variable before it fails; later tests need the old count
        if before is None:
            os.environ.pop(CPU_DEVICES_ENV, None)
        else:
            os.environ[CPU_DEVICES_ENV] = before
    return None



def train_unbuilt(devices, wrapped=False):
    """A subclassed model distributed before it is built (its first fit() builds it), or a model that only
    wraps a built sub-model (``wrapped``: it is never built itself); returns its weights, History and
    the replicas and distinct places the framework reports (``patterns.replicas_seen``)."""
    import keras

    import distkeras

    keras.utils.set_random_seed(0)

    class Net(keras.Model):
        def __init__(self, inner=None, **kwargs):
            super().__init__(**kwargs)
            self.inner = inner
            if inner is None:
                self.hidden = keras.layers.Dense(16, activation="tanh")
                self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.inner(x) if self.inner is not None else self.out(self.hidden(x))

    model = Net(build(keras) if wrapped else None)
    assert not model.built
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"])
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
    x, y = data(60)
    history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    from tests.backends.patterns import replicas_seen

    return [np.asarray(w) for w in model.get_weights()], history.history, replicas_seen(model)



def interrupted_saves(devices, directory):
    """Save m.keras and m.weights.h5, then save both again with a layer that fails half-way through Keras' writing:
    (the errors, whether each file still holds the first save's bytes, the folder's files)."""
    import keras

    import distkeras

    class Fragile(keras.layers.Dense):
        fail = False

        def get_config(self):
            if self.fail:
                raise RuntimeError("failed half-way")
            return super().get_config()

        def save_own_variables(self, store):
            super().save_own_variables(store)
            if self.fail:
                raise RuntimeError("failed half-way")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), Fragile(3)])
    model.compile(optimizer="sgd", loss="mse")
    if devices > 1:
        model = distkeras.distribute(model, devices=devices)
    paths = [os.path.join(directory, name) for name in ("m.keras", "m.weights.h5")]
    model.save(paths[0])
    model.save_weights(paths[1])
    after_rank0_wrote()
    before = []
    for path in paths:
        with open(path, "rb") as f:
            before.append(f.read())
    model.layers[0].fail = True
    errors = []
    for save, path in zip((model.save, model.save_weights), paths):
        try:
            save(path)
        except RuntimeError as exc:
            errors.append(str(exc))
    after_rank0_wrote()
    kept = []
    for path, old in zip(paths, before):
        with open(path, "rb") as f:
            kept.append(f.read() == old)
    return errors, kept, sorted(os.listdir(directory))
