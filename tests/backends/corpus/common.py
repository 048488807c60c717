"""What the corpus' programs share: generated data, the one distribute() line, and the result they return.

The programs reuse :func:`tests.backends.realcode.result` (every weight, every optimizer's variables, the
History, evaluate() and predict(), the replicas the framework reports) so the two suites compare the same things.
"""

import os
import shutil
import tempfile
import types

import numpy as np

from tests.backends.realcode import BATCH, result  # noqa: F401 (re-exported for the area modules)

ALL = ("tensorflow", "jax", "torch")
TF_ONLY = ("tensorflow",)
#: A bias that feeds a BatchNormalization (or an attention key bias) has an exact gradient of 0; Adam normalises the
#: rounding noise on it (1e-9 against 1e-9) into steps of up to its learning rate, so such weights differ from one
#: device's by a few 1e-5 on any other summation order: a looser tolerance, not a defect.
BN_ADAM = 1e-4


def keras():
    import keras as k

    return k


def backend():
    return keras().backend.backend()


def rng(seed):
    return np.random.default_rng(seed)


def images(samples, seed, side=8, channels=1, classes=None):
    """``samples`` images in [0, 1) (and integer labels when ``classes`` is given)."""
    r = rng(seed)
    x = r.uniform(size=(samples, side, side, channels)).astype("float32")
    if classes is None:
        return x
    return x, r.integers(0, classes, size=(samples,))


def normal(seed, *shape):
    return rng(seed).normal(size=shape).astype("float32")


def tokens(seed, samples, length, vocab, low=0):
    return rng(seed).integers(low, vocab, size=(samples, length)).astype("int32")


def labels(seed, samples, classes):
    return rng(seed).integers(0, classes, size=(samples,))


def distribute(model, devices):
    """The one line a user adds (``devices`` > 1)."""
    import distkeras

    if devices > 1:
        model = distkeras.distribute(model, devices)
    return model


def merged(*histories):
    """One History-like object holding several fit() calls' logs: the second fit's keys as ``fit2/<key>``."""
    logs = {}
    for i, history in enumerate(histories):
        prefix = "" if i == 0 else "fit{}/".format(i + 1)
        for key, values in history.history.items():
            logs[prefix + key] = values
    return types.SimpleNamespace(history=logs)


def fit(model, x, y=None, epochs=2, **kwargs):
    """``model.fit`` at the global batch, unshuffled (one order on every run), quiet."""
    kwargs.setdefault("batch_size", BATCH)
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, epochs=epochs, **kwargs)


def evaluate(model, x, y=None, **kwargs):
    kwargs.setdefault("batch_size", BATCH)
    return model.evaluate(x, y, verbose=0, return_dict=True, **kwargs)


def predict(model, x, **kwargs):
    kwargs.setdefault("batch_size", BATCH)
    return model.predict(x, verbose=0, **kwargs)


class shared_folder:
    """A scratch folder with the same path on every rank of a job (``with shared_folder(devices) as folder``): the
    ranks of a job of processes share their parent, so a checkpoint path is one path, as in a user's script. Rank 0
    removes it on the way out (after fit(), a collective: every rank is done with it)."""

    def __init__(self, devices, name="scratch"):
        self.path = os.path.join(tempfile.gettempdir(), "corpus-{}-{}-{}".format(name, os.getppid(), devices))

    def __enter__(self):
        os.makedirs(self.path, exist_ok=True)
        return self.path

    def __exit__(self, *exc):
        if os.environ.get("RANK", "0") == "0":
            shutil.rmtree(self.path, ignore_errors=True)
