"""The models and the comparison of the pipeline tests (tests/backends/test_*_pipeline.py), backend-neutral: a
Sequential MLP (a regularizer, optionally Dropout), a functional convnet with a skip connection and a functional
transformer stack (attention with dropout, residuals, LayerNorm), their data, and
what "trains as one device" means (weights rtol 1e-4 atol 2e-5, History, evaluate, predict). Import it after the
backend's devices are set up (it imports Keras)."""

import os

import keras
import numpy as np

import distkeras
import distkeras.callbacks
from distkeras.errors import OptionError

RNG = np.random.default_rng(0)
X, Y = RNG.normal(size=(30, 6)).astype("float32"), RNG.normal(size=(30, 2)).astype("float32")
X_IMG, Y_IMG = RNG.normal(size=(20, 8, 8, 1)).astype("float32"), RNG.integers(0, 3, size=(20,)).astype("int32")


def mlp(dropout=0.0, optimizer=None):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="d1"),
              keras.layers.Dense(8, activation="tanh", name="d2", kernel_regularizer=keras.regularizers.L2(1e-2))]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, name="drop"))
    layers += [keras.layers.Dense(6, activation="relu", name="d3"), keras.layers.Dense(2, name="d4")]
    model = keras.Sequential(layers, name="mlp")
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def convnet():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(inputs)
    y = keras.layers.Conv2D(4, 3, padding="same", name="c2")(x)
    x = keras.layers.Add(name="skip")([x, y])  # a skip connection: no cut between c1 and skip
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(8, activation="relu", name="fc")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(x), name="convnet")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def transformer():
    """A functional transformer stack: an embedding, 2 blocks (attention with dropout, residual, LayerNorm, a
    feed-forward pair, residual, LayerNorm), pooling and a classifier; cuts fall between blocks only."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(16, 8, name="embed")(ids)
    for b in range(2):
        a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.2, name="attn{}".format(b))(x, x)
        x = keras.layers.LayerNormalization(name="ln{}a".format(b))(keras.layers.Add(name="res{}a".format(b))([x, a]))
        h = keras.layers.Dense(16, activation="relu", name="ff{}a".format(b))(x)
        h = keras.layers.Dense(8, name="ff{}b".format(b))(h)
        x = keras.layers.LayerNormalization(name="ln{}b".format(b))(keras.layers.Add(name="res{}b".format(b))([x, h]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    model = keras.Model(ids, keras.layers.Dense(3, name="head")(x), name="transformer")
    # SGD, not Adam: the attention's key bias has a gradient of zero up to rounding, which Adam scales to steps of
    # the learning rate (noise, the same for one device and a pipeline only to rounding).
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Scale(keras.layers.Layer):
    """A learned scalar (a weight of shape ()): the tensor's one element, freed and gathered like any other."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


def mlp_scalar():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="d1"),
                              Scale(name="scale"), keras.layers.Dense(8, activation="tanh", name="d2"),
                              keras.layers.Dense(2, name="d3")], name="mlp_scalar")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


X_TOK, Y_TOK = RNG.integers(0, 16, size=(20, 6)).astype("int32"), RNG.integers(0, 3, size=(20,)).astype("int32")
MODELS = {"mlp": (mlp, X, Y), "mlp-dropout": (lambda: mlp(0.3), X, Y), "convnet": (convnet, X_IMG, Y_IMG),
          "transformer": (transformer, X_TOK, Y_TOK), "mlp-scalar": (mlp_scalar, X, Y)}


def assert_same(one, other, atol=2e-5):
    assert len(one["weights"]) == len(other["weights"])
    for a, b in zip(one["weights"], other["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    assert sorted(one["history"]) == sorted(other["history"])
    for key in one["history"]:
        np.testing.assert_allclose(one["history"][key], other["history"][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one["evaluate"], other["evaluate"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one["predict"], other["predict"], rtol=1e-4, atol=atol)


class Subclassed(keras.Model):
    """A subclassed model: a call() of its own, no graph of layers to cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b = keras.layers.Dense(4), keras.layers.Dense(1)

    def build(self, input_shape):
        self.a.build(input_shape)
        self.b.build((None, 4))

    def call(self, x):
        return self.b(self.a(x))


def refusal(build, devices=2, **options):
    """distribute()'s OptionError message for the model ``build()`` makes, on the first ``devices`` devices (None
    where it distributed)."""
    model = build()
    try:
        distkeras.distribute(model, devices, **options)
    except OptionError as exc:
        return str(exc)
    return None


def residual():
    """A model one skip connection spans whole: no layer boundary that one tensor crosses."""
    inputs = keras.Input((6,))
    a = keras.layers.Dense(6, name="a")(inputs)
    b = keras.layers.Dense(6, name="b")(a)
    model = keras.Model(inputs, keras.layers.Add(name="add")([inputs, b]), name="residual")
    model.compile(optimizer="sgd", loss="mse")
    return model


def assert_cut_refusals(refusal=refusal):
    """What no backend can cut, each a clear error: ``refusal(build, **options)`` gives distribute()'s
    OptionError message for the model ``build()`` makes (None where it distributed)."""
    said = refusal(convnet, pipeline_stages=["c2"])
    assert "can't be cut after 'c2'" in said and "skip connection" in said and "'skip'" in said
    assert "It can be cut after 'c1', 'skip', 'pool', 'flat', 'fc'." in said  # not inside the skip
    said = refusal(mlp, pipeline_stages=9)
    assert "into at most 4 stages" in said and "'d1', 'd2', 'd3'" in said
    # Too few cut places: the message names what blocks the others (it said "after nowhere" and no more).
    said = refusal(convnet, pipeline_stages=7)
    assert "into at most 6 stages" in said and "not after 'c2' (2 tensors cross there" in said, said
    assert "a skip connection spans the cut" in said
    said = refusal(residual, pipeline_stages=2)
    assert "can be cut in 0 place(s) only" in said and "not after 'a' (2 tensors cross there (the model's input, " \
        "the output of 'a'): a skip connection spans the cut)" in said, said
    said = refusal(mlp, pipeline_stages=["nope"])
    assert "doesn't have" in said and "'d1'" in said
    model = Subclassed()
    model.build((None, 3))
    model.compile("sgd", "mse")
    said = refusal(lambda: model, pipeline_stages=2)
    assert "subclassed" in said and "Functional or Sequential" in said
    said = refusal(mlp, pipeline_stages=2, schedule="zigzag")
    assert "Expected schedule in ('gpipe', '1f1b')" in said
    said = refusal(mlp, microbatches=2)
    assert "apply to pipeline_stages only" in said
    said = refusal(mlp, pipeline_stages=2, microbatches=0)
    assert "microbatches as a positive integer" in said


def assert_backup_resumes(directory, devices=2):
    """In one process (TensorFlow, JAX): a pipelined MLP stopped at its third epoch and run again with
    BackupAndRestore resumes from the last epoch's checkpoint to the uninterrupted one-device run (unshuffled: an
    epoch-end checkpoint keeps no random state, Keras' BackupAndRestore neither)."""
    one = mlp()
    one.fit(X, Y, batch_size=8, epochs=3, verbose=0, shuffle=False)

    def stop(epoch, logs):
        if epoch == 2:
            raise KeyboardInterrupt

    backup = os.path.join(str(directory), "backup")
    model = distkeras.distribute(mlp(), devices, pipeline_stages=2, microbatches=3)
    try:
        model.fit(X, Y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[
            distkeras.callbacks.BackupAndRestore(backup, delete_checkpoint=False),
            keras.callbacks.LambdaCallback(on_epoch_begin=stop)])
        raise AssertionError("the stop at epoch 2 didn't stop fit()")
    except KeyboardInterrupt:
        pass
    model = distkeras.distribute(mlp(), devices, pipeline_stages=2, microbatches=3)
    history = model.fit(X, Y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[
        distkeras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)]).history
    assert len(history["loss"]) == 1, history  # only the epoch left ran
    for a, b in zip(one.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


#: Sample weights of X's rows (the reduction tests): uneven, so a loss weighed by rows is not one weighed by weight.
SW = np.random.default_rng(5).uniform(0.25, 2.0, size=(30,)).astype("float32")


def reduction_mlp(reduction):
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["mae"],
                  loss=keras.losses.MeanSquaredError(reduction=reduction))
    return model


def train_reduction(reduction, devices=None, **options):
    """The MLP with an MSE of ``reduction``, fit with sample weights (batch 8 of 30 rows, unshuffled); one device
    where ``devices`` is None. What :func:`assert_same` compares."""
    model = reduction_mlp(reduction)
    if devices is not None:
        model = distkeras.distribute(model, devices, **options)
    history = model.fit(X, Y, sample_weight=SW, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    return {"weights": model.get_weights(), "history": history,
            "evaluate": model.evaluate(X, Y, sample_weight=SW, batch_size=8, verbose=0),
            "predict": model.predict(X[:7], verbose=0)}


def assert_reduction_refusals(refusal=refusal):
    """A loss that reduces itself (reduction None or "none") is refused with the reason and what to do."""
    for reduction in (None, "none"):
        said = refusal(lambda r=reduction: reduction_mlp(r), pipeline_stages=2, microbatches=2)
        assert said is not None and "reduction={!r}".format(reduction) in said and "'sum'" in said, said
