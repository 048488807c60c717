"""The one-device check (``verify=True``) beyond replicas: pipeline stages (TensorFlow and JAX, one process),
sharded training state (``shard=``) and model shards (``strategy="model"``) on JAX.

Each layout's first step is replayed as one device's (the whole state on one device, the model class' own
``train_step``, no distkeras hook) and compared. A correct run raises nothing and trains bit for bit as it does
without the check; a defect of distkeras' own in the layout is caught: the pipeline's loss weighed as a mean for a
``reduction="sum"`` loss (issue 50's defect, its fix reverted), and sharded gradients halved on their way to the
optimizer. PyTorch's model shards and pipeline stages are processes: there the check says it is off (see
``test_torch_tensor.py``).
"""

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras  # noqa: F401 (skips if the backend is missing)

import distkeras
from tests.full import only_in_full

pytestmark = pytest.mark.skipif(BACKEND not in ("tensorflow", "jax"),
                                reason="pipeline stages and sharded state in one process: TensorFlow's and JAX's")

if BACKEND in ("tensorflow", "jax"):
    from tests.backends.pipeline_models import SW, X, Y, reduction_mlp


def train(reduction, verify, **options):
    """The pipeline tests' MLP (an MSE of ``reduction``, uneven sample weights), one epoch of batch 8: its weights
    and History, the steps the check compared, or the check's error."""
    model = distkeras.distribute(reduction_mlp(reduction), 2, verify=verify, **options)
    try:
        history = model.fit(X, Y, sample_weight=SW, batch_size=8, epochs=1, verbose=0, shuffle=False)
    except distkeras.VerifyError as error:
        return {"error": str(error)}
    check = model.__dict__.get("_distkeras_check")
    return {"weights": [np.asarray(w) for w in model.get_weights()], "history": history.history,
            "checked": check.checked if check else None, "skipped": check.skipped if check else None}


def assert_checked_and_unchanged(reduction, **options):
    checked = train(reduction, True, **options)
    assert "error" not in checked, checked.get("error")
    assert checked["checked"] == 1 and checked["skipped"] is None, checked
    plain = train(reduction, False, **options)
    for got, want in zip(checked["weights"], plain["weights"]):
        np.testing.assert_array_equal(got, want)  # the check left no trace
    assert checked["history"] == plain["history"]


PIPELINE = {"pipeline_stages": 2, "microbatches": 4}


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight", pytest.param(
    "sum_over_batch_size", marks=only_in_full("a mean: the micro-batches' weighing the other two tests cover"))])
def test_a_pipelined_step_is_checked_and_training_unchanged(reduction):
    assert_checked_and_unchanged(reduction, **PIPELINE)


def test_a_summed_loss_weighed_as_a_mean_in_the_pipeline_is_caught(monkeypatch):
    """Issue 50's defect with its fix reverted: every micro-batch's loss weighed by its share of the rows, right
    for a mean only; a ``sum`` then trains 1/M of one device's gradient."""
    from distkeras import pipeline

    monkeypatch.setattr(pipeline, "loss_factors", lambda rule, sizes, weight_sums=None: pipeline.weights(sizes))
    got = train("sum", True, **PIPELINE)
    assert "error" in got, got
    assert "log loss" in got["error"] and "pipeline stages" in got["error"], got["error"]


@pytest.mark.skipif(BACKEND != "jax", reason="sharded training state and model shards in one process: JAX's")
@pytest.mark.parametrize("options", [
    pytest.param({"shard": "optimizer"}, marks=only_in_full("a part of what shard='all' shards")),
    pytest.param({"shard": "gradients"}, marks=only_in_full("a part of what shard='all' shards")),
    {"shard": "all"}, {"strategy": "model"}], ids=lambda o: "-".join(map(str, o.values())))
def test_sharded_state_and_model_shards_are_checked_and_training_unchanged(options):
    assert_checked_and_unchanged("sum_over_batch_size", **options)


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
