"""The four ways to train a workload that the benchmark compares, behind one small interface.

    a  plain          plain Keras on one device
    b  distkeras      ``distkeras.distribute(model, devices=N)``
    c  native         the hand-written equivalent on N devices, per backend (``benchmarks.backends``)
    d  make_parallel  the old tutorials' recipe: split the batch, one replica per device, concatenate
                      the outputs on one device, one loss (per backend, where it can be written)
    b2 distkeras_alt  b again with other ``distribute()`` options (``--alt-distribute-options``), only when
                      asked: two settings of distkeras side by side, e.g. with and without synchronized
                      BatchNormalization

Each is set up into a :class:`Variant`: a trainer that runs ``steps`` training steps and returns when
they are done, the global batch it takes, and time stamps taken while it was set up (so the worker
can report the time from each stamp to the first finished step).

A window of ``steps`` steps is timed from the end of its first step to the end of its last, so it
measures ``steps - 1`` steps of steady training: what ``fit()`` does once per call (making and
distributing the dataset, starting its iterator) stays out, and is seen in the time to the first step
and in each window's wall time, which the results keep too.
"""

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict

#: Variant keys in table order, with the letter of the issue and a label for tables and plots.
KEYS = ("plain", "distkeras", "native", "make_parallel")
#: b2: variant b with other ``distribute()`` options; set up only when they are given.
ALTERNATIVE = "distkeras_alt"
LETTERS = dict(zip(KEYS, "abcd"), **{ALTERNATIVE: "b2"})
LABELS = {
    "plain": "plain Keras, 1 device",
    "distkeras": "distkeras.distribute",
    "native": "native (hand-written)",
    "make_parallel": "make_parallel (split/concat)",
    ALTERNATIVE: "distkeras.distribute, other options",
}


@dataclass
class Variant:
    """A model set up to train, as the worker drives it.

    Attributes:
        key: one of :data:`KEYS`.
        devices: how many devices it trains on.
        global_batch: samples per step, over all devices.
        train: ``train(pool, steps)`` runs ``steps`` steps on batches cycled from ``pool`` (a list of
            (x, y) pairs of ``global_batch`` samples), returns once they have finished, and returns the
            seconds from the end of the first step to the end of the last.
        marks: ``{name: time.perf_counter()}`` stamps taken during set-up; ``"setup"`` (its start) always.
        model: the Keras model it trains, where there is one.
    """

    key: str
    devices: int
    global_batch: int
    train: Callable
    marks: Dict[str, float] = field(default_factory=dict)
    model: object = None


def keras_batches(keras, pool, steps):
    """A ``keras.utils.PyDataset`` of ``steps`` batches cycled from ``pool``: the same feeding path
    (``model.fit`` on a PyDataset) on every backend, with memory bounded by the pool."""

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return steps

        def __getitem__(self, index):
            return pool[index % len(pool)]

    return Batches()


def _step_clock(keras):
    class StepClock(keras.callbacks.Callback):
        """When each step's results were ready. ``async_safe``: Keras keeps dispatching steps while a
        thread of its own waits for the results and calls this, as it does with no callback at all."""

        async_safe = True

        def __init__(self):
            super().__init__()
            self.done = {}

        def on_train_batch_end(self, batch, logs=None):
            self.done[batch] = time.perf_counter()

    return StepClock()


def fit_variant(key, model, devices, global_batch, marks, scope=None):
    """A :class:`Variant` that trains with ``model.fit``, one epoch per call, inside ``scope()`` if given."""
    import keras

    def train(pool, steps):
        clock = _step_clock(keras)
        with scope() if scope is not None else contextlib.nullcontext():
            model.fit(keras_batches(keras, pool, steps), epochs=1, shuffle=False, verbose=0, callbacks=[clock])
        return clock.done[steps - 1] - clock.done[0]

    return Variant(key, devices, global_batch, train, marks, model)


def array_fit_variant(key, model, devices, global_batch, marks, scope=None):
    """:func:`fit_variant`, fed NumPy arrays (``model.fit(x, y, batch_size=...)``: Keras' array data
    adapter) instead of a PyDataset; the arrays of a window are ``pool`` cycled, concatenated once per step
    count."""
    import keras
    import numpy as np

    arrays = {}

    def train(pool, steps):
        if (id(pool), steps) not in arrays:
            picks = [pool[i % len(pool)] for i in range(steps)]
            arrays[id(pool), steps] = tuple(np.concatenate([pick[j] for pick in picks]) for j in range(2))
        x, y = arrays[id(pool), steps]
        clock = _step_clock(keras)
        with scope() if scope is not None else contextlib.nullcontext():
            model.fit(x, y, batch_size=len(pool[0][0]), epochs=1, shuffle=False, verbose=0, callbacks=[clock])
        return clock.done[steps - 1] - clock.done[0]

    return Variant(key, devices, global_batch, train, marks, model)


def plain(workload, devices, fit=fit_variant):
    """a: the workload's model on the backend's default device, at the per-device batch."""
    import keras

    marks = {"setup": time.perf_counter()}
    model = workload.build(keras)
    return fit("plain", model, 1, workload.per_device_batch, marks)


def distributed(workload, devices, options=None, fit=fit_variant, key="distkeras"):
    """b (or b2, ``key``): the plain model handed to ``distkeras.distribute`` (with ``options``, the adapter's
    keyword arguments); ``marks["distribute"]`` is the call. ``fit``: as :func:`fit_variant`."""
    import distkeras
    import keras

    marks = {"setup": time.perf_counter()}
    model = workload.build(keras)
    marks["distribute"] = time.perf_counter()
    model = distkeras.distribute(model, devices=devices, **(options or {}))
    return fit(key, model, devices, workload.per_device_batch * devices, marks)


def split_concat(workload, devices, replicas, scope=None):
    """d, the make_parallel recipe, as a Keras 3 functional model: the template's layers as an uncompiled
    replica model (a compiled one inside would bring its own metrics along), ``replicas(replica)`` (the
    backend's layer that runs it on each slice of the batch and concatenates the outputs), one loss.
    Built inside ``scope()`` if given."""
    import keras

    marks = {"setup": time.perf_counter()}
    with scope() if scope is not None else contextlib.nullcontext():
        template = workload.build(keras)
        replica = keras.Model(template.inputs, template.outputs, name="replica")
        inputs = keras.Input(shape=template.input_shape[1:])
        model = keras.Model(inputs, replicas(replica)(inputs), name="make_parallel")
        model.compile(optimizer=template.optimizer, loss=workload.loss)
    return fit_variant("make_parallel", model, devices, workload.per_device_batch * devices, marks)


def setup(key, workload, devices, plan, options=None):
    """Set up variant ``key`` with the backend module ``plan`` (see :mod:`benchmarks.backends`);
    ``options`` go to ``distkeras.distribute`` (variants b and b2: each gets its own).

    Raises:
        NotImplementedError: the backend has no way to build this variant (its reason as the message).
    """
    fit = getattr(plan, "fit_variant", fit_variant)  # a plan may feed and time fit() its own way (Keras 2)

    def build():
        if key == "plain":
            return plain(workload, devices, fit)
        if key in ("distkeras", ALTERNATIVE):
            return distributed(workload, devices, options, fit, key)
        make = getattr(plan, key, None)
        if make is None:
            raise NotImplementedError(getattr(plan, "MISSING", {}).get(key, "not written for this backend"))
        return make(workload, devices)

    # A backend of one process per device decides which of its processes set a variant up and train it.
    hook = getattr(plan, "setup_variant", None)
    return hook(key, workload, devices, build) if hook is not None else build()
