"""The wide real-code corpus (``tests/backends/corpus``): keras-io examples and guides at N=2 against one device.

Each program runs once on one device and once with ``distribute(model, 2)`` at the same global batch, with the
one-device check switched on (``DISTKERAS_VERIFY=raise``) for the distributed run, and must give the same
weights, optimizer state, History, evaluate() and predict() to its tolerance, with 2 replicas seen by the
framework. On PyTorch the program runs on both ranks of a 2-process job (``harness.replicated``), rank 0's
result compared.

A program known not to match one device is a strict xfail with the measured difference: it fails the suite the
day it starts to match, so its entry gets updated. Fast programs run by default, slow ones in the full run
(DISTKERAS_FULL_TESTS=1). Programs whose keras-io source is TensorFlow-only run on TensorFlow only.
"""

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
    one-device check explains them (:func:`distkeras.verify.explained_by_slots`): a bias that feeds
    BatchNormalization has a gradient of 0 on paper, and Adam makes steps of up to its learning rate of the
    rounding noise, every step, on any summation order; its slots agree, and BatchNormalization removes the bias
    from every output."""
    from distkeras import verify

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
            marks.append(pytest.mark.skip(reason="{}: its keras-io source is written for {} only".format(
                program.source, ", ".join(program.backends))))
        elif program.speed == "slow" and not FULL:
            marks.append(pytest.mark.skip(reason="full run only (DISTKERAS_FULL_TESTS=1): a slow program"))
        expected = program.expected(BACKEND)
        if expected != "pass":
            marks.append(pytest.mark.xfail(strict=True, reason=expected))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


_single = {}


@pytest.mark.parametrize("name", _params())
def test_program_runs_as_on_one_device(name, monkeypatch):
    program = corpus.PROGRAMS[name]
    expected = corpus.run(name, 1)
    monkeypatch.setenv("DISTKERAS_VERIFY", "raise")
    got = replicated(2, corpus.run, name, 2)
    assert got["replicas"] == (2, 2)
    got = without_noise_steps(expected, got, program.tolerance)
    differ = differences(expected, got, program.tolerance)
    assert not differ, "{} differs from one device: {}".format(name, "; ".join(differ))
    assert_same_results(expected, got, program.tolerance)


def test_registry_is_complete():
    """Every entry names a keras-io source, a known speed and backends, and a reason when it is not expected to pass."""
    for name, program in corpus.PROGRAMS.items():
        assert program.source.startswith(("examples/", "guides/")), name
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
