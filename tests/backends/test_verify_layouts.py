"""The one-device check (``verify=True``) beyond replicas: pipeline stages (TensorFlow and JAX in one process,
PyTorch over processes: a stage each, and 2 replicas of a 2-stage pipeline over 4), sharded training state
(``shard=``) on JAX and PyTorch (2 processes), and model shards (``strategy="model"``) on JAX.

Each layout's first step is replayed as one device's (the whole state on one device, the model class' own
``train_step``, no distkeras hook) and compared. A correct run raises nothing and trains bit for bit as it does
without the check; a defect of distkeras' own in the layout is caught: the pipeline's loss weighed as a mean for a
``reduction="sum"`` loss (issue 50's defect, its fix reverted), and sharded gradients halved on their way to the
optimizer (JAX) or before their owners apply them (PyTorch). PyTorch's model shards (``strategy="model"``) are
processes: their check is tested in ``test_torch_tensor.py``.
"""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras  # noqa: F401 (skips if the backend is missing)

import distkeras
from tests.full import only_in_full

from tests.backends.pipeline_models import SW, X, Y, reduction_mlp


def train(reduction, verify, devices=2, **options):
    """The pipeline tests' MLP (an MSE of ``reduction``, uneven sample weights), one epoch of batch 8: its weights
    and History, the steps the check compared, or the check's error."""
    model = distkeras.distribute(reduction_mlp(reduction), devices, verify=verify, **options)
    try:
        history = model.fit(X, Y, sample_weight=SW, batch_size=8, epochs=1, verbose=0, shuffle=False)
    except distkeras.VerifyError as error:
        return {"error": str(error)}
    check = model.__dict__.get("_distkeras_check")
    return {"weights": [np.asarray(w) for w in model.get_weights()], "history": history.history,
            "checked": check.checked if check else None, "skipped": check.skipped if check else None}


def train_sum_weighed_as_mean(*args, **options):
    """:func:`train` with issue 50's pipeline defect: every micro-batch's loss weighed by its share of the rows,
    right for a mean only (the fix reverted)."""
    from distkeras.parallel import pipeline

    fixed = pipeline.loss_factors
    pipeline.loss_factors = lambda rule, sizes, weight_sums=None: pipeline.weights(sizes)
    try:
        return train(*args, **options)
    finally:
        pipeline.loss_factors = fixed


def run(fn, *args, processes=2, **options):
    """``fn(*args, **options)`` here (TensorFlow, JAX), or on every rank of a job of ``processes`` (PyTorch: a
    process per stage), where every rank must come to the same verdict; rank 0's result."""
    if BACKEND != "torch":
        return fn(*args, **options)
    from tests.backends.harness import job

    local = 2 if processes > 2 else None
    results = [o.result for o in job(processes, local_size=local).run(fn, *args, devices=local or processes, **options)]
    assert all(("error" in r) == ("error" in results[0]) for r in results), results
    return results[0]


def assert_checked_and_unchanged(reduction, processes=2, **options):
    checked = run(train, reduction, True, processes=processes, **options)
    assert "error" not in checked, checked.get("error")
    assert checked["checked"] == 1 and checked["skipped"] is None, checked
    plain = run(train, reduction, False, processes=processes, **options)
    for got, want in zip(checked["weights"], plain["weights"]):
        np.testing.assert_array_equal(got, want)  # the check left no trace
    assert checked["history"] == plain["history"]


PIPELINE = {"pipeline_stages": 2, "microbatches": 4}


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight", pytest.param(
    "sum_over_batch_size", marks=only_in_full("a mean: the micro-batches' weighing the other two tests cover"))])
def test_a_pipelined_step_is_checked_and_training_unchanged(reduction):
    assert_checked_and_unchanged(reduction, **PIPELINE)


@pytest.mark.skipif(BACKEND != "torch", reason="replicas of a pipeline over processes: PyTorch's")
def test_replicas_of_a_pipeline_over_processes_are_checked_and_training_unchanged():
    """4 processes: 2 replicas of a 2-stage pipeline, each stage's replicas averaging their gradients."""
    assert_checked_and_unchanged("sum", processes=4, **PIPELINE)


def test_a_summed_loss_weighed_as_a_mean_in_the_pipeline_is_caught():
    """Issue 50's defect with its fix reverted: every micro-batch's loss weighed by its share of the rows, right
    for a mean only; a ``sum`` then trains 1/M of one device's gradient."""
    got = run(train_sum_weighed_as_mean, "sum", True, **PIPELINE)
    assert "error" in got, got
    assert "log loss" in got["error"] and "pipeline stages" in got["error"], got["error"]


@pytest.mark.skipif(BACKEND not in ("jax", "torch"), reason="sharded state and model shards: JAX's and PyTorch's")
@pytest.mark.parametrize("options", [
    pytest.param({"shard": "optimizer"}, marks=only_in_full("a part of what shard='all' shards")),
    pytest.param({"shard": "gradients"}, marks=only_in_full("a part of what shard='all' shards")),
    {"shard": "all"}, pytest.param({"strategy": "model"}, marks=pytest.mark.skipif(
        BACKEND == "torch", reason="PyTorch's model shards need a layout map of the MLP's kernels; "
                                   "test_torch_tensor.py checks them (an MLP and a block, 2 and 2 x 2 processes)"))],
    ids=lambda o: "-".join(map(str, o.values())))
def test_sharded_state_and_model_shards_are_checked_and_training_unchanged(options):
    assert_checked_and_unchanged("sum_over_batch_size", **options)


def train_with_owned_gradients_halved(*args, **options):
    """:func:`train` with a defect in PyTorch's sharded update: every averaged gradient halved before the owners
    apply it."""
    from distkeras.backends.torch import shard

    own = shard.Sharding.apply
    shard.Sharding.apply = lambda self, optimizer, keras_apply, grads, variables: own(
        self, optimizer, keras_apply, [g if g is None else g * 0.5 for g in grads], variables)
    try:
        return train(*args, **options)
    finally:
        shard.Sharding.apply = own


@pytest.mark.skipif(BACKEND != "torch", reason="sharded training state over processes: PyTorch's")
def test_a_defect_in_the_update_of_a_state_sharded_over_processes_is_caught():
    got = run(train_with_owned_gradients_halved, "sum_over_batch_size", True, shard="all")
    assert "error" in got, got
    assert "differ beyond" in got["error"] and "weight" in got["error"], got["error"]


@pytest.mark.skipif(BACKEND != "jax", reason="sharded training state: JAX's")
def test_a_defect_in_the_sharded_update_is_caught(monkeypatch):
    from distkeras.backends.jax import shard

    # Which class holds the hook is the adapter's business: patch it wherever it is defined.
    holder = next(c for c in vars(shard).values() if isinstance(c, type) and "constrain_gradients" in vars(c))
    own = holder.constrain_gradients
    monkeypatch.setattr(holder, "constrain_gradients", lambda self, grads: [
        g if g is None else g * 0.5 for g in own(self, grads)])
    got = train("sum_over_batch_size", True, shard="all")
    assert "error" in got, got
    assert "differ beyond" in got["error"] and "weight" in got["error"], got["error"]
