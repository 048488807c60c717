"""A wider real-code corpus: keras-io examples and guides, and a second corpus from outside keras-io: the Keras
repository's own examples, integration tests and trainer tests (``kerasrepo``, ``kerastrainer``, sources
``keras:...``), KerasHub's task tests (``kerashub``, ``keras-hub:...``) and TensorFlow's Keras tutorials
(``tftutorials``, ``tf-tutorials:...``), each shrunk to generated data and a few steps.

One module per area (``vision``, ``nlp``, ``structured``, ``timeseries``, ``generative``, ``audio``, ``guides``;
``kerasrepo``, ``kerastrainer``, ``kerashub``, ``tftutorials``).
A program is ``name(devices)``: it seeds Keras, builds its model the way its keras-io source does (same layers,
same custom steps, same ``compile()`` arguments, callbacks and fit/evaluate/predict calls), adds the one line
``model = distkeras.distribute(model, devices)`` when ``devices > 1``, trains, and returns
:func:`tests.backends.realcode.result`. Each area's ``PROGRAMS`` maps a name to
``(keras-io source, tolerance, backends, speed, expected)``: ``speed`` is ``"fast"`` (the default run) or
``"slow"`` (the full run); ``expected`` is ``"pass"`` or ``"not-one-device: <the difference and its cause>"``,
or a dict of those by backend.
"""

import os

from tests.backends.corpus import (audio, generative, guides, kerashub, kerasrepo, kerastrainer, nlp, structured,
                                   tftutorials, timeseries, vision)

AREAS = {"vision": vision, "nlp": nlp, "structured": structured, "timeseries": timeseries,
         "generative": generative, "audio": audio, "guides": guides, "kerasrepo": kerasrepo,
         "kerastrainer": kerastrainer, "kerashub": kerashub, "tftutorials": tftutorials}
#: A source in the Keras repository (not keras-io) starts with this.
KERAS_REPO_PREFIX = "keras:"
#: Where the Keras repository's sources are.
KERAS_REPO = "https://github.com/keras-team/keras/blob/master/"
#: The second corpus' sources: a prefix of a registry entry's source, and where the rest of it is.
OUTSIDE = {KERAS_REPO_PREFIX: KERAS_REPO,
           "keras-hub:": "https://github.com/keras-team/keras-hub/blob/master/",
           "tf-tutorials:": "https://github.com/tensorflow/docs/blob/master/site/en/tutorials/keras/"}


def outside(source):
    """The second corpus' prefix that ``source`` starts with, or ``None`` (a keras-io source)."""
    return next((prefix for prefix in OUTSIDE if source.startswith(prefix)), None)


class Program:
    """One registry entry, with its area and function."""

    def __init__(self, area, name, entry):
        self.area, self.name = area, name
        self.source, self.tolerance, self.backends, self.speed, self._expected = entry
        self.fn = getattr(AREAS[area], name)

    def expected(self, backend):
        """``"pass"`` or ``"not-one-device: ..."`` on ``backend``."""
        if isinstance(self._expected, dict):
            return self._expected.get(backend, "pass")
        return self._expected


PROGRAMS = {}
for _area, _module in AREAS.items():
    for _name, _entry in _module.PROGRAMS.items():
        assert _name not in PROGRAMS, _name
        PROGRAMS[_name] = Program(_area, _name, _entry)


class RecordedBatches:
    """Every train and test batch's logs, as callbacks see them, for the ``with`` block, in the order of the batches:
    read where Keras' ``CallbackList.on_train_batch_end``/``on_test_batch_end`` take them, before JAX's and
    torch's trainers hand them to a thread pool (which may call the callbacks out of order). The test asserts
    that some were seen, so a Keras that stops calling these fails loudly."""

    def __init__(self):
        self.train, self.test = [], []

    def __enter__(self):
        from keras.callbacks import CallbackList

        self._saved = CallbackList.on_train_batch_end, CallbackList.on_test_batch_end
        train, test = self._saved

        def on_train(callbacks, batch, logs=None):
            self.train.append(_plain(logs))
            return train(callbacks, batch, logs)

        def on_test(callbacks, batch, logs=None):
            self.test.append(_plain(logs))
            return test(callbacks, batch, logs)

        CallbackList.on_train_batch_end, CallbackList.on_test_batch_end = on_train, on_test
        return self

    def __exit__(self, *exc):
        from keras.callbacks import CallbackList

        CallbackList.on_train_batch_end, CallbackList.on_test_batch_end = self._saved


def _plain(logs):
    import keras
    import numpy as np

    out = {}
    for key, value in sorted((logs or {}).items()):
        try:
            out[key] = np.asarray(keras.ops.convert_to_numpy(value), dtype="float64")
        except Exception:  # noqa: BLE001 - a log that is no number: not compared
            pass
    return out


def run(name, devices, verify="raise"):
    """Run program ``name`` on ``devices`` (1: plain Keras); its result, with every batch's logs (``"batches"``:
    ``{"train": [...], "test": [...]}``). A distributed run sets ``DISTKERAS_VERIFY`` (the one-device check) to
    ``verify`` where it runs, worker processes included (``"0"``: off)."""
    return recorded(PROGRAMS[name].fn, devices, verify)


def recorded(fn, devices, verify="raise"):
    """:func:`run` for any program ``fn(devices)`` that returns :func:`tests.backends.realcode.result`."""
    previous = os.environ.get("DISTKERAS_VERIFY")
    if devices > 1 and verify:
        os.environ["DISTKERAS_VERIFY"] = verify
    try:
        with RecordedBatches() as batches:
            out = fn(devices)
        out["batches"] = {"train": batches.train, "test": batches.test}
        return out
    finally:
        if previous is None:
            os.environ.pop("DISTKERAS_VERIFY", None)
        else:
            os.environ["DISTKERAS_VERIFY"] = previous


#: The docs' names of the backends, in the table's order.
BACKEND_NAMES = (("tensorflow", "TensorFlow"), ("jax", "JAX"), ("torch", "PyTorch"))
#: Where the keras-io sources are.
KERAS_IO = "https://github.com/keras-team/keras-io/blob/master/"
_FALSE_ALARM = "not-one-device: a false alarm of the one-device check: "


def _cell(program, backend):
    if backend not in program.backends:
        names = dict(BACKEND_NAMES)
        return "not run: the example fails on one device here, or is written for {} only".format(
            " and ".join(names[b] for b in program.backends))
    expected = program.expected(backend)
    if expected == "pass":
        return "pass"
    if expected.startswith(_FALSE_ALARM):
        return "**check false alarm**: " + expected[len(_FALSE_ALARM):]
    return "**differs**: " + expected[len("not-one-device: "):]


def _rows(programs, source_label):
    rows = ["| program | area | {} | speed | {} |".format(source_label, " | ".join(n for _, n in BACKEND_NAMES)),
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for area in AREAS:
        for name, program in sorted(programs.items()):
            if program.area != area:
                continue
            prefix = outside(program.source)
            source, url = (program.source[len(prefix):], OUTSIDE[prefix]) if prefix else (program.source, KERAS_IO)
            rows.append("| `{}` | {} | [{}]({}) | {} | {} |".format(
                name, area, source.rsplit("/", 1)[-1], url + source, program.speed,
                " | ".join(_cell(program, backend) for backend, _ in BACKEND_NAMES)))
    return "\n".join(rows) + "\n"


#: What docs/corpus.md says of the second corpus, above its table (generated with it).
KERAS_REPO_TEXT = (
    "## The second corpus: the Keras repository, KerasHub, TensorFlow's tutorials\n\n"
    "Sources nobody here wrote, none of them keras-io: the Keras repository's own `examples/`, `integration_tests/` "
    "and trainer tests (`kerasrepo`, `kerastrainer`), KerasHub's task tests (`kerashub`: tiny backbones built from "
    "arguments, a vocabulary written in code, no preset) and TensorFlow's Keras tutorials (`tftutorials`), in "
    "`tests/backends/corpus/`, run by the same test under the same rules (the one-device check on, no trace, one "
    "device's results). The backend-specific custom-fit tests run on their own backend only, as their files are "
    "written; the three are one program, keras-io's custom fit again, and count as one pattern.\n\n")


def table():
    """The docs' tables of every program (docs/corpus.md, "The programs" and "The second corpus"), from the
    registry."""
    io = {n: p for n, p in PROGRAMS.items() if not outside(p.source)}
    second = {n: p for n, p in PROGRAMS.items() if outside(p.source)}
    return _rows(io, "keras-io source") + "\n" + KERAS_REPO_TEXT + _rows(second, "source")
