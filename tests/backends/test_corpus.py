"""The wide real-code corpus (``tests/backends/corpus``): keras-io examples and guides at N=2 against one device.

Each program runs once on one device and once with ``distribute(model, 2)`` at the same global batch, with the
one-device check switched on (``DISTKERAS_VERIFY=raise``) for the distributed run, and must give the same
weights, optimizer state, History, evaluate() and predict() to its tolerance, with 2 replicas seen by the
framework. On PyTorch the program runs on both ranks of a 2-process job (``harness.replicated``), rank 0's
result compared.

The check must leave no trace: where :func:`checks_no_trace` says so (every program on one of its backends by
default, on every backend in the full run), the program runs distributed a second time with the check off, and
every weight, optimizer variable, epoch and batch log, evaluate() and predict() must be bit for bit the run's
with the check on.

A program known not to match one device is a strict xfail with the measured difference: it fails the suite the
day it starts to match, so its entry gets updated. Fast programs run by default, slow ones in the full run
(DISTKERAS_FULL_TESTS=1). Programs whose keras-io source is TensorFlow-only run on TensorFlow only.
"""

import os

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)
from tests.backends import corpus
from tests.backends.test_realcode import assert_same_results
from tests.full import FULL


def differences(expected, got, atol):
    """``"what: max abs diff"`` for every weight, optimizer variable, log, evaluate() and predict() that differs."""
    out = []

    def check(what, e, g):
        e, g = np.asarray(e, dtype="float64"), np.asarray(g, dtype="float64")
        if e.shape != g.shape:
            out.append("{}: shape {} != {}".format(what, g.shape, e.shape))
        elif not np.allclose(g, e, rtol=atol, atol=atol):
            out.append("{}: {:.3g}".format(what, float(np.max(np.abs(g - e)))))

    for path, e, g in zip(expected["paths"], expected["weights"], got["weights"]):
        check(path, e, g)
    for path, e, g in zip(expected["optimizer_paths"], expected["optimizer"], got["optimizer"]):
        check(path, e, g)
    for key, values in expected["history"].items():
        check("history " + key, values, got["history"].get(key, [np.nan] * len(values)))
    for key, value in (expected["evaluate"] or {}).items():
        check("evaluate " + key, value, (got["evaluate"] or {}).get(key, np.nan))
    if expected["predict"] is not None:
        check("predict", expected["predict"], got["predict"])
    return out


def without_noise_steps(expected, got, tolerance):
    """``got`` with one device's values for the weights whose difference their optimizer slots explain, as the
    one-device check explains them (:func:`distkeras.verify.check.explained_by_slots`): a bias that feeds
    BatchNormalization has a gradient of 0 on paper, and Adam makes steps of up to its learning rate of the
    rounding noise, every step, on any summation order; its slots agree, and BatchNormalization removes the bias
    from every output."""
    from distkeras.verify import check as verify

    entries = [(path, "weight", g, e) for path, e, g in zip(got["paths"], expected["weights"], got["weights"])]
    entries += [(path.split(":", 1)[-1], "optimizer", g, e)
                for path, e, g in zip(got["optimizer_paths"], expected["optimizer"], got["optimizer"])]
    found = verify.differences(entries, tolerance, tolerance)
    explained = {d.name for d in verify.explained_by_slots(found, entries, tolerance)}
    if not explained:
        return got
    got = dict(got)
    got["weights"] = [e if path in explained else g for path, e, g in zip(got["paths"], expected["weights"],
                                                                           got["weights"])]
    return got


def _params():
    params = []
    for name in sorted(corpus.PROGRAMS):
        program = corpus.PROGRAMS[name]
        marks = []
        if BACKEND not in program.backends:
            marks.append(pytest.mark.skip(reason="{}: its source is written for {} only".format(
                program.source, ", ".join(program.backends))))
        elif program.speed == "slow" and not FULL:
            marks.append(pytest.mark.skip(reason="full run only (DISTKERAS_FULL_TESTS=1): a slow program"))
        expected = program.expected(BACKEND)
        if expected != "pass":
            marks.append(pytest.mark.xfail(strict=True, reason=expected))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def checks_no_trace(name):
    """Whether the check-off run (:func:`traces`) runs for ``name`` here: on every backend in the full run; by
    default on one of the program's backends, taken in turn along the sorted names (about a third of the corpus a
    backend: the check's replay is the same code for every program, the programs' steps are what differ)."""
    if FULL:
        return True
    backends = corpus.PROGRAMS[name].backends
    return backends[sorted(corpus.PROGRAMS).index(name) % len(backends)] == BACKEND


def traces(off, on):
    """``"what: how"`` for everything the check changed: each weight, optimizer variable, epoch log, batch log,
    evaluate() and predict() of the run with the check on (``on``) that is not exactly the check-off run's."""
    out = []

    def check(what, a, b):
        a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
        if a.shape != b.shape:
            out.append("{}: shape {} with the check, {} without".format(what, b.shape, a.shape))
        elif not np.array_equal(a, b, equal_nan=True):
            out.append("{}: {!r} with the check, {!r} without".format(what, b.ravel()[:3].tolist(), a.ravel()[:3].tolist()))

    def same_keys(what, a, b):
        if sorted(a) != sorted(b):
            out.append("{}: keys {} with the check, {} without".format(what, sorted(b), sorted(a)))
        return sorted(set(a) & set(b))

    for what in ("weights", "optimizer"):
        for path, a, b in zip(off["paths" if what == "weights" else "optimizer_paths"], off[what], on[what]):
            check(path, a, b)
    for key in same_keys("history", off["history"], on["history"]):
        check("history " + key, off["history"][key], on["history"][key])
    for kind in ("train", "test"):
        a, b = off["batches"][kind], on["batches"][kind]
        if len(a) != len(b):
            out.append("{} batches: {} with the check, {} without".format(kind, len(b), len(a)))
        for i, (logs_a, logs_b) in enumerate(zip(a, b)):
            for key in same_keys("{} batch {}".format(kind, i), logs_a, logs_b):
                check("{} batch {} {}".format(kind, i, key), logs_a[key], logs_b[key])
    for key in same_keys("evaluate", off["evaluate"] or {}, on["evaluate"] or {}):
        check("evaluate " + key, off["evaluate"][key], on["evaluate"][key])
    if off["predict"] is not None or on["predict"] is not None:
        check("predict", off["predict"], on["predict"])
    return out


@pytest.mark.parametrize("name", _params())
def test_program_runs_as_on_one_device(name, monkeypatch):
    program = corpus.PROGRAMS[name]
    # The distributed run first: where the one-device check raises at the first step (every strict xfail here
    # does), the one-device run (which only the comparisons below read) is not paid for. It runs with
    # DISTKERAS_VERIFY as it was before the test.
    verify_before = os.environ.get("DISTKERAS_VERIFY")
    monkeypatch.setenv("DISTKERAS_VERIFY", "raise")
    got = replicated(2, corpus.run, name, 2)
    assert got["replicas"] == (2, 2)
    assert got["batches"]["train"], "no train batch's logs were recorded (corpus.RecordedBatches)"
    if checks_no_trace(name):
        monkeypatch.setenv("DISTKERAS_VERIFY", "0")
        off = replicated(2, corpus.run, name, 2, verify="0")
        left = traces(off, got)
        assert not left, "{}: the one-device check left a trace in training: {}".format(name, "; ".join(left[:12]))
    if verify_before is None:
        monkeypatch.delenv("DISTKERAS_VERIFY")
    else:
        monkeypatch.setenv("DISTKERAS_VERIFY", verify_before)
    expected = corpus.run(name, 1)
    got = without_noise_steps(expected, got, program.tolerance)
    differ = differences(expected, got, program.tolerance)
    assert not differ, "{} differs from one device: {}".format(name, "; ".join(differ))
    assert_same_results(expected, got, program.tolerance)


def test_registry_is_complete():
    """Every entry names a keras-io source or one of the second corpus', a known speed and backends, and a reason when it is not expected to pass."""
    for name, program in corpus.PROGRAMS.items():
        assert program.source.startswith(("examples/", "guides/", corpus.KERAS_REPO_PREFIX + "examples/",
                                          corpus.KERAS_REPO_PREFIX + "integration_tests/",
                                          corpus.KERAS_REPO_PREFIX + "keras/src/", "keras-hub:keras_hub/src/",
                                          "tf-tutorials:")), name
        assert program.speed in ("fast", "slow"), name
        assert set(program.backends) <= {"tensorflow", "jax", "torch"} and program.backends, name
        for backend in program.backends:
            expected = program.expected(backend)
            assert expected == "pass" or expected.startswith("not-one-device: "), (name, expected)


def test_the_docs_table_is_the_registrys():
    """docs/corpus.md ends with the table of every program's expectations, as the registry holds them."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "corpus.md")
    with open(path) as f:
        text = f.read()
    assert text.endswith(corpus.table()), "regenerate the table: python -c 'from tests.backends import corpus; print(corpus.table())'"
