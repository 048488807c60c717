"""The workloads: what model is trained, on what data, at what batch size per device.

Each workload builds a compiled Keras model with the active backend and makes a small pool of batches
that the timed windows cycle through, so memory does not grow with the length of a window. The models
build with Keras 3 and with Keras 2 (keras-mxnet 2.2.4.3).

- ``mlp``: the 41,157,101-parameter MLP of the make_parallel article (8000 -> 4000 tanh -> 2000 relu ->
  500 relu -> 300 relu -> 1 sigmoid, Adam, binary cross-entropy, random data, 2048 samples per device).
  ``width`` scales every layer but the output (0.1 gives 800 -> 400 -> 200 -> 50 -> 30 -> 1), for CPUs.
- ``cnn``: the keras-mxnet CIFAR-10 tutorial's CNN (two conv blocks of 32 and 64 filters with
  max-pooling and dropout, Dense 512, softmax, RMSprop), synthetic 32x32x3 images, 32 per device.
- ``digits``: the MLP of ``distkeras demo`` on scikit-learn's bundled digits (real data), 32 per device.
- ``bncnn``: a small BatchNormalization conv net (two blocks of Conv2D without bias, BatchNormalization
  and ReLU, of 32 and 64 filters, max-pooling between them, global average pooling, Dense softmax; Adam),
  synthetic 32x32x3 images, 32 per device: what synchronizing BatchNormalization statistics costs.
- ``transformer``: a small encoder language model (token Embedding, 5 blocks of
  MultiHeadAttention, LayerNormalization and a Dense feed-forward pair, a Dense softmax over the vocabulary;
  Adam), 48 M parameters at ``width`` 1.0, random tokens, sequences of 32, 2 per device: the memory benchmark's
  (``python -m benchmarks memory``) second model. ``width`` scales the model width and the vocabulary.
"""

from dataclasses import dataclass
from typing import Callable, List, Tuple

import numpy as np

#: The make_parallel article's layer widths (the output layer, 1 unit, is not scaled).
MLP_WIDTHS = (8000, 4000, 2000, 500, 300)
MLP_ACTIVATIONS = ("tanh", "relu", "relu", "relu")


@dataclass(frozen=True)
class Workload:
    """One benchmark model and its data.

    Attributes:
        name: one of :data:`NAMES`.
        description: a line for tables, naming the shape actually built.
        per_device_batch: samples per device per step; the global batch on N devices is N times it.
        loss: the compiled loss, by Keras name (hand-written training loops use it too).
        build: ``build(keras)`` returns the compiled, built model, created in the caller's scope.
        batches: ``batches(rng, batch_size, count)`` returns ``count`` (x, y) pairs of ``batch_size`` samples.
    """

    name: str
    description: str
    per_device_batch: int
    loss: str
    build: Callable
    batches: Callable[[np.random.Generator, int, int], List[Tuple[np.ndarray, np.ndarray]]]


def mlp_widths(width):
    """The MLP's input and hidden widths at scale ``width`` (1.0 = the article's)."""
    if width <= 0:
        raise ValueError("Expected width > 0. Received: width={!r}".format(width))
    return tuple(max(1, int(round(units * width))) for units in MLP_WIDTHS)


def mlp_parameters(width):
    """Parameter count of the MLP at ``width`` (41,157,101 at 1.0)."""
    sizes = mlp_widths(width) + (1,)
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def _keras2(keras):
    """True for Keras 2 (keras-mxnet 2.2.4.3)."""
    return keras.__version__.startswith("2.")


def _sequential(keras, shape, layers, name):
    """A Sequential of ``layers`` on inputs of ``shape``.

    Keras 3: after ``keras.Input``. Keras 2 (whose ``keras.Input`` is a tensor, not a layer): the first
    layer made again from its configuration with the input shape, as Keras 2 code spells it
    (``input_shape=``).
    """
    if not _keras2(keras):
        return keras.models.Sequential([keras.Input(shape=shape)] + layers, name=name)
    first = type(layers[0]).from_config(dict(layers[0].get_config(), batch_input_shape=(None,) + tuple(shape)))
    return keras.models.Sequential([first] + layers[1:], name=name)


def _dense_stack(keras, name, inputs, layers, optimizer, loss, metrics=None):
    """A compiled Sequential of Dense ``layers`` ((units, activation) pairs) on ``inputs`` features."""
    dense = [keras.layers.Dense(units, activation=activation) for units, activation in layers]
    model = _sequential(keras, (inputs,), dense, name)
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics)
    return model


def _mlp(width):
    inputs, *hidden = mlp_widths(width)

    def build(keras):
        layers = list(zip(hidden, MLP_ACTIVATIONS)) + [(1, "sigmoid")]
        return _dense_stack(keras, "mlp", inputs, layers, keras.optimizers.Adam(), "binary_crossentropy")

    def batches(rng, size, count):
        return [(rng.random((size, inputs), dtype=np.float32), (rng.random((size, 1)) > 0.5).astype(np.float32))
                for _ in range(count)]

    shape = "-".join(str(n) for n in (inputs, *hidden, 1))
    return Workload("mlp", "MLP {} ({:,} params)".format(shape, mlp_parameters(width)), 2048,
                    "binary_crossentropy", build, batches)


def _cnn():
    def build(keras):
        layers = keras.layers
        model = _sequential(keras, (32, 32, 3), [
            layers.Conv2D(32, (3, 3), padding="same", activation="relu"),
            layers.Conv2D(32, (3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Dropout(0.25),
            layers.Conv2D(64, (3, 3), padding="same", activation="relu"),
            layers.Conv2D(64, (3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Dropout(0.25),
            layers.Flatten(),
            layers.Dense(512, activation="relu"),
            layers.Dropout(0.5),
            layers.Dense(10, activation="softmax"),
        ], "cifar10_cnn")
        # The learning rate by position: Keras 2 calls it lr, Keras 3 learning_rate.
        model.compile(optimizer=keras.optimizers.RMSprop(1e-4), loss="sparse_categorical_crossentropy")
        return model

    def batches(rng, size, count):
        return [(rng.random((size, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, size=(size,)).astype(np.int32))
                for _ in range(count)]

    return Workload("cnn", "CIFAR-10 CNN, 32x32x3 synthetic (1,250,858 params)", 32,
                    "sparse_categorical_crossentropy", build, batches)


def _digits():
    from distkeras import demo

    def batches(rng, size, count):
        (x, y), _ = demo.load_digits()
        order = rng.permutation(len(x))
        picks = np.resize(order, size * count).reshape(count, size)  # cycles through the training set
        return [(x[p], y[p]) for p in picks]

    def build(keras):
        if not _keras2(keras):
            return demo.build_model(keras)
        layers = [(128, "relu"), (64, "relu"), (10, "softmax")]  # demo.build_model's, which takes Keras 3 only
        return _dense_stack(keras, "digits_mlp", 64, layers, keras.optimizers.Adam(1e-3),
                            "sparse_categorical_crossentropy", ["accuracy"])

    return Workload("digits", "digits MLP 64-128-64-10 (17,226 params), scikit-learn digits", 32,
                    "sparse_categorical_crossentropy", build, batches)


def _bncnn():
    def build(keras):
        layers = keras.layers
        model = _sequential(keras, (32, 32, 3), [
            layers.Conv2D(32, (3, 3), padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(64, (3, 3), padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.GlobalAveragePooling2D(),
            layers.Dense(10, activation="softmax"),
        ], "bn_cnn")
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        return model

    def batches(rng, size, count):
        return [(rng.random((size, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, size=(size,)).astype(np.int32))
                for _ in range(count)]

    return Workload("bncnn", "BatchNorm CNN, 2 x (Conv2D, BatchNormalization, ReLU), 32x32x3 synthetic "
                    "(20,330 params)", 32, "sparse_categorical_crossentropy", build, batches)


#: The transformer at width 1.0: vocabulary, model width, heads, feed-forward width, blocks, sequence length.
TRANSFORMER = {"vocabulary": 8192, "model": 768, "heads": 8, "feed_forward": 3072, "blocks": 5, "sequence": 32}


def transformer_shape(width):
    """The transformer's sizes at scale ``width``: widths rounded to a multiple of the heads (at least one per
    head), the vocabulary to at least 16."""
    if width <= 0:
        raise ValueError("Expected width > 0. Received: width={!r}".format(width))
    shape = dict(TRANSFORMER)
    heads = shape["heads"]
    for key in ("model", "feed_forward"):
        shape[key] = max(heads, heads * int(round(TRANSFORMER[key] * width / heads)))
    shape["vocabulary"] = max(16, int(round(TRANSFORMER["vocabulary"] * width)))
    return shape


def _transformer(width):
    shape = transformer_shape(width)
    vocabulary, units, sequence = shape["vocabulary"], shape["model"], shape["sequence"]

    def build(keras):
        if _keras2(keras):
            raise ValueError("the transformer workload needs Keras 3 (MultiHeadAttention)")
        layers = keras.layers
        tokens = keras.Input(shape=(sequence,), dtype="int32")
        x = layers.Embedding(vocabulary, units, name="tokens")(tokens)  # no positions: memory, not language
        for block in range(shape["blocks"]):
            attended = layers.MultiHeadAttention(shape["heads"], units // shape["heads"], name="attention{}".format(
                block))(x, x)
            x = layers.LayerNormalization(name="norm{}a".format(block))(x + attended)
            hidden = layers.Dense(shape["feed_forward"], activation="relu", name="up{}".format(block))(x)
            x = layers.LayerNormalization(name="norm{}b".format(block))(
                x + layers.Dense(units, name="down{}".format(block))(hidden))
        outputs = layers.Dense(vocabulary, activation="softmax", name="logits")(x)
        model = keras.Model(tokens, outputs, name="transformer")
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
        return model

    def batches(rng, size, count):
        return [(rng.integers(0, vocabulary, size=(size, sequence)).astype(np.int32),
                 rng.integers(0, vocabulary, size=(size, sequence)).astype(np.int32)) for _ in range(count)]

    return Workload("transformer", "transformer, {blocks} blocks of width {model} ({heads} heads, feed-forward "
                    "{feed_forward}), vocabulary {vocabulary}, sequences of {sequence}".format(**shape), 2,
                    "sparse_categorical_crossentropy", build, batches)

def _dense512():
    """Issue 25's held-out model, a shape no benchmark here was tuned on: Dense 512 -> 1024 -> 1024 -> 10."""

    def build(keras):
        layers = [(1024, "relu"), (1024, "relu"), (10, None)]
        return _dense_stack(keras, "dense512", 512, layers, keras.optimizers.Adam(), "sparse_categorical_crossentropy")

    def batches(rng, size, count):
        return [(rng.random((size, 512), dtype=np.float32), rng.integers(0, 10, size=(size,)).astype(np.int32))
                for _ in range(count)]

    return Workload("dense512", "Dense 512-1024-1024-10 (1,585,162 params)", 64, "sparse_categorical_crossentropy",
                    build, batches)


def _shape_sweep(name, inputs, layers, description):
    """A Dense stack of issue 25's compression sweep: ~1.6 M parameters (the held-out model's) laid out as
    ``name`` says, regression on random data (mse, Adam)."""

    outputs = layers[-1][0]

    def build(keras):
        return _dense_stack(keras, name, inputs, layers, keras.optimizers.Adam(), "mse")

    def batches(rng, size, count):
        return [(rng.random((size, inputs), dtype=np.float32), rng.random((size, outputs), dtype=np.float32))
                for _ in range(count)]

    sizes = [inputs] + [units for units, _ in layers]
    params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    return Workload(name, "{} ({:,} params, {} tensors)".format(description, params, 2 * len(layers)), 64, "mse",
                    build, batches)


#: The compression sweep's shapes (with ``dense512``, wide and shallow, and ``mlp``): many mid-size layers, many
#: small tensors, one huge tensor.
SWEEP = {
    "deep": lambda: _shape_sweep("deep", 256, [(256, "relu")] * 24 + [(10, None)], "Dense 256 x 24 layers"),
    "small": lambda: _shape_sweep("small", 64, [(64, "relu")] * 200 + [(10, None)], "Dense 64 x 200 layers"),
    "huge": lambda: _shape_sweep("huge", 1600, [(1000, None)], "one Dense 1600-1000"),
}

#: Workload names, in the order tables list them.
NAMES = ("mlp", "cnn", "digits", "bncnn", "transformer", "dense512") + tuple(SWEEP)


def get(name, width=1.0):
    """The workload called ``name``; ``width`` scales the MLP and the transformer."""
    if name == "mlp":
        return _mlp(width)
    if name == "cnn":
        return _cnn()
    if name == "digits":
        return _digits()
    if name == "bncnn":
        return _bncnn()
    if name == "transformer":
        return _transformer(width)
    if name == "dense512":
        return _dense512()
    if name in SWEEP:
        return SWEEP[name]()
    raise ValueError("Expected a workload in {}. Received: {!r}".format(NAMES, name))
