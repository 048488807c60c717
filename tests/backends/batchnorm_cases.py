"""BatchNormalization subclasses as users write them, and the bodies of tests/backends/test_batchnorm_rule.py,
which run where the backend keeps its replicas (``harness.replicated``: in the test process, or on every rank
of a PyTorch job). Keras is imported inside the functions: the module loads on any backend."""

import logging

import numpy as np

SAMPLES, BATCH, EPOCHS = 48, 12, 2
#: How many times (traced or eager) OwnMoments._moments ran in this process.
OWN_CALLS = []


def classes():
    """The subclasses, made once per process (Keras must be imported first)."""
    import keras

    if "classes" in _made:
        return _made["classes"]

    class ConfiguredNorm(keras.layers.BatchNormalization):
        """Adds an argument and its config: synchronized like its parent."""

        def __init__(self, note="", **kwargs):
            super().__init__(**kwargs)
            self.note = note

        def get_config(self):
            return dict(super().get_config(), note=self.note)

    class WrappedCall(keras.layers.BatchNormalization):
        """Overrides ``call`` around ``super().call()``: still reaches ``_moments``, so synchronized."""

        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=training, mask=mask) * 1.0

    class OwnMoments(keras.layers.BatchNormalization):
        """Computes its statistics in a ``_moments`` of its own: left alone, with a warning."""

        def _moments(self, inputs, mask):
            OWN_CALLS.append(1)
            return super()._moments(inputs, mask)

    class InheritsOwnMoments(OwnMoments):
        """Inherits OwnMoments' ``_moments``: left alone too, named by the class that defines it."""

    _made["classes"] = (ConfiguredNorm, WrappedCall, OwnMoments, InheritsOwnMoments)
    return _made["classes"]


_made = {}


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    y = rng.normal(size=(SAMPLES, 3)).astype("float32")
    return x, y


def model(norms=("configured",), seed=0):
    """Dense -> norms... -> Dense, the norms given by name, one block nested in a Sequential inside a Functional
    model (the rule reaches nested layers)."""
    import keras

    configured, wrapped, own, inherits = classes()
    make = {"keras": keras.layers.BatchNormalization, "configured": configured, "wrapped": wrapped, "own": own,
            "inherits": inherits}
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    x = inputs
    for name in norms:
        inner = keras.Sequential([keras.layers.Dense(8, use_bias=False), make[name](name=name + "_norm")],
                                 name=name + "_block")
        x = keras.layers.Activation("tanh")(inner(x))
    net = keras.Model(inputs, keras.layers.Dense(3)(x))
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return net


def norm_layers(net):
    import keras

    from distkeras.backends import keras_model

    return {layer.name: layer for layer in keras_model.layers_of(net) if isinstance(layer, keras.layers.BatchNormalization)}


def train(norms, devices, **options):
    """Fit the model on ``devices`` (1: plain Keras); the weights, which layers carry distkeras' ``_moments``,
    what distkeras logged, and whether OwnMoments' own code ran."""
    import distkeras

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("distkeras")
    logger.addHandler(handler)
    try:
        net = model(norms)
        if devices > 1:
            net = distkeras.distribute(net, devices=devices, **options)
        hooked = sorted(name for name, layer in norm_layers(net).items() if "_moments" in layer.__dict__)
        del OWN_CALLS[:]
        x, y = data()
        net.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        logger.removeHandler(handler)
    return {"weights": [np.asarray(w) for w in net.get_weights()], "hooked": hooked,
            "warnings": [r for r in records if "BatchNormalization" in r], "own_ran": len(OWN_CALLS) > 0}


def redistributed():
    """distribute(sync_batchnorm="all"), then distribute() again: which layers carry distkeras' _moments after each."""
    import distkeras

    net = model(("own",))
    distkeras.distribute(net, devices=2, sync_batchnorm="all")
    first = sorted(n for n, layer in norm_layers(net).items() if "_moments" in layer.__dict__)
    distkeras.distribute(net, devices=2)
    second = sorted(n for n, layer in norm_layers(net).items() if "_moments" in layer.__dict__)
    return {"first": first, "second": second}


def train_masked(devices, **options):
    """Masking -> BatchNormalization on sequences with padded steps: the mask weighs the statistics."""
    import keras

    import distkeras

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4, 3)), keras.layers.Masking(0.0), keras.layers.Dense(6, use_bias=False),
                            keras.layers.BatchNormalization(), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if devices > 1:
        net = distkeras.distribute(net, devices=devices, **options)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(SAMPLES, 4, 3)).astype("float32")
    padded = rng.random((SAMPLES, 4)) < 0.4
    padded[:, 0] = False  # every sequence keeps a step (a wholly masked one would average nothing: NaN)
    x[padded] = 0.0
    y = rng.normal(size=(SAMPLES, 2)).astype("float32")
    net.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [np.asarray(w) for w in net.get_weights()]
