"""Pipeline parallelism on PyTorch (pipeline_stages=): a Sequential MLP and a functional model cut into stages
over real processes (gloo) train what one device trains at the same global batch (weights, History, evaluate,
predict), with GPipe and 1F1B, uneven micro-batches, Dropout and a regularizer; every stage computes only its
own layers (read from torch's autograd: only its variables get gradients); the saved model is the plain one;
2 stages x 2 replicas on 4 processes; cuts that can't be made are clear errors."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, job, keras
from tests.backends.pipeline_models import (MODELS, X, Y, assert_cut_refusals, assert_reduction_refusals,
                                             assert_same, mlp, refusal, train_reduction)

import distkeras
import distkeras.callbacks
from distkeras.errors import ModelError

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="pipeline stages by process groups: PyTorch's adapter")




# A LossScaleOptimizer (float32 here): every stage's backward starts from the scaled loss, as Keras' train_step's.
MODELS = dict(MODELS, **{"mlp-loss-scaled": (lambda: mlp(optimizer=keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 10)), MODELS["mlp"][1], MODELS["mlp"][2])})


def train(name, stages=None, processes=2, save=None, epochs=2, shuffle=True, backup=None, stop_at=None, **options):
    build, x, y = MODELS[name]
    model = build()
    if stages is not None:
        model = distkeras.distribute(model, processes, pipeline_stages=stages, **options)
    callbacks = []
    if backup is not None:
        callbacks.append(distkeras.callbacks.BackupAndRestore(backup, delete_checkpoint=False))
    if stop_at is not None:
        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: (_ for _ in ()).throw(KeyboardInterrupt) if epoch == stop_at else None))
    try:
        history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=shuffle, callbacks=callbacks).history
    except KeyboardInterrupt:
        return None
    result = {"weights": model.get_weights(), "history": history, "evaluate": model.evaluate(x, y, verbose=0),
              "predict": model.predict(x[:7], verbose=0),
              "describe": distkeras.describe(model) if stages is not None else None}
    if stages is not None:
        plan = model.__dict__["_distkeras_pipeline"]
        result["stage"] = [layer.name for layer in plan.parts[plan.index].layers]
        # What torch's autograd filled in the last step: the stage's own variables' gradients, no other.
        result["grads"] = sorted(v.path for v in model.trainable_variables if v.value.grad is not None)
        result["own"] = sorted(v.path for layer in plan.parts[plan.index].layers for v in layer.trainable_variables)
        # The storage torch holds (Keras' private _value): this stage's weights and Adam/momentum slots only.
        result["held"] = sorted(v.path for v in model.trainable_variables if v._value.numel())
        result["slots"] = sum(v._value.numel() for v in model.optimizer.variables if len(v.shape))
        result["all_slots"] = sum(int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape))
        try:  # a hand-written loop can't drive the stages: a clear error, not a shape error at its first step
            distkeras.distribute_step(lambda batch: batch, model)
        except ModelError as exc:
            result["loop"] = str(exc)
    if save is not None:
        model.save(save)
    return result


@pytest.mark.parametrize("name, schedule, microbatches", [("mlp", "gpipe", 3), ("mlp-dropout", "1f1b", 3),
                                                          ("convnet", "1f1b", 4), ("transformer", "gpipe", 3),
                                                          ("mlp-loss-scaled", "1f1b", 2)])
def test_two_stages_train_as_one_device(name, schedule, microbatches, tmp_path):
    one = train(name)
    outcomes = job(2).run(train, name, 2, microbatches=microbatches, schedule=schedule,
                          save=str(tmp_path / "model.keras"))
    for outcome in outcomes:
        assert_same(one, outcome.result)
        assert outcome.result["describe"]["replicas"] == 1 and outcome.result["describe"]["model_shards"] == 2
    for outcome in outcomes:
        assert outcome.result["grads"] == outcome.result["own"] == outcome.result["held"] and outcome.result["grads"]
        assert "don't drive pipeline stages" in outcome.result["loop"] and "Use fit()" in outcome.result["loop"]
    assert sum(o.result["slots"] for o in outcomes) == outcomes[0].result["all_slots"]  # split, not copied
    first, second = (o.result["stage"] for o in outcomes)
    assert first and second and not set(first) & set(second)
    if name == "convnet":
        assert "c2" in first + second and ("c2" in first) == ("skip" in first)  # c2 and the Add on one side
    script = ("import sys, numpy as np, keras; m = keras.saving.load_model(sys.argv[1]); "
              "np.save(sys.argv[2], m.predict(np.load(sys.argv[3]), verbose=0)); assert 'distkeras' not in sys.modules")
    np.save(tmp_path / "x.npy", MODELS[name][1][:7])
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.keras"), str(tmp_path / "p.npy"),
                    str(tmp_path / "x.npy")], check=True, env=dict(os.environ, KERAS_BACKEND="torch"), timeout=120)
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), one["predict"], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name, stages", [("mlp-dropout", ["d1", "d2", "d3"]), ("transformer", 4)])
def test_four_stages_train_as_one_device(name, stages):
    """4 processes on 2 simulated hosts of 2 (distribute(model, 2) on each), one stage each: the MLP cut after each
    Dense, the transformer balanced by parameters."""
    one = train(name)
    outcomes = job(4, local_size=2).run(train, name, stages, 2, microbatches=2, schedule="1f1b")
    if name == "mlp-dropout":
        assert [o.result["stage"] for o in outcomes] == [["d1"], ["d2"], ["drop", "d3"], ["d4"]]
    for outcome in outcomes:
        assert_same(one, outcome.result)
        assert outcome.result["describe"]["replicas"] == 1 and outcome.result["describe"]["model_shards"] == 4
        assert outcome.result["grads"] == outcome.result["own"] == outcome.result["held"]


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_two_stages_times_two_replicas_train_as_one_device(name):
    """Processes 0-1 and 2-3 each a pipeline of 2 stages, each on half of the global batch; the stages' replicas
    (processes 0 and 2, 1 and 3) all-reduce their gradients."""
    one = train(name)
    outcomes = job(4, local_size=2).run(train, name, 2, 2, microbatches=2)
    for outcome in outcomes:
        assert_same(one, outcome.result)
        assert outcome.result["describe"]["replicas"] == 2 and outcome.result["describe"]["model_shards"] == 2


def test_backup_and_restore_resumes_a_pipelined_model_to_the_uninterrupted_run(tmp_path):
    # Unshuffled: an epoch-end checkpoint keeps no random state (Keras' BackupAndRestore neither).
    one = train("mlp", epochs=3, shuffle=False)
    backup = str(tmp_path / "backup")
    assert job(2).run(train, "mlp", 2, epochs=3, shuffle=False, backup=backup, stop_at=2)[0].result is None
    resumed = job(2).run(train, "mlp", 2, epochs=3, shuffle=False, backup=backup)
    for outcome in resumed:
        for a, b in zip(one["weights"], outcome.result["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
        assert len(outcome.result["history"]["loss"]) == 1  # only the epoch left ran


def test_a_scalar_weight_trains_and_is_gathered_for_get_weights():
    """A weight of shape () on the other stage: release() freed its one element and gather() made storage again
    only for weights with a shape, so get_weights() aborted in gloo ("Received data size doesn't match")."""
    one = train("mlp-scalar")
    outcomes = job(2).run(train, "mlp-scalar", 2, microbatches=2)
    for outcome in outcomes:
        assert_same(one, outcome.result)
    # held by its stage's process only (the other freed it between the gathers)
    assert sum(any("scale" in path for path in o.result["held"]) for o in outcomes) == 1, [o.result["held"] for o in outcomes]


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_every_loss_reduction_trains_as_one_device(reduction):
    """A sum's micro-batches add up as they are, a mean_with_sample_weight's by their sample weights (uneven here):
    before, every reduction was weighed as a mean (a sum trained 1/M of one device's gradient). 2 stages, and 2
    stages x 2 replicas (each replica's share of the global batch weighed as the data-parallel gradient is)."""
    one = train_reduction(reduction)
    for outcome in job(2).run(train_reduction, reduction, 2, pipeline_stages=2, microbatches=3):
        assert_same(one, outcome.result)
    for outcome in job(4, local_size=2).run(train_reduction, reduction, 2, pipeline_stages=2, microbatches=2):
        assert_same(one, outcome.result)


def test_what_cannot_be_cut_is_a_clear_error_before_any_process_starts():
    assert_reduction_refusals()
    assert_cut_refusals()
    said = refusal(mlp, devices=3, pipeline_stages=2)
    assert "doesn't divide the job's 3 processes" in said
    said = refusal(mlp, pipeline_stages=2, shard="all")
    assert "doesn't combine with shard='all'" in said
    # Each stage applies the optimizer to its own variables: a global norm would be each stage's norm.
    said = refusal(lambda: mlp(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0)), pipeline_stages=2)
    assert "global_clipnorm=1.0" in said and "each stage's norm" in said


def test_the_keras_privates_the_pipeline_reads_are_there():
    """Pinned: what backends/torch/pipeline.py reads from Keras that Keras doesn't publish."""
    model = mlp(0.3)
    y_pred = model(X[:4])
    loss = model._compile_loss(Y[:4], y_pred, None)  # the compiled loss alone
    assert float(loss) > 0 and callable(model._aggregate_additional_loss)
    assert hasattr(model._loss_tracker, "update_state")
    drop = model.get_layer("drop")
    assert drop.seed_generator in drop._seed_generators  # a layer's seed generators, restored per micro-batch
    from keras.src.backend.common import global_state

    assert callable(global_state.get_global_attribute)
    assert model.get_layer("d1").kernel._value.numel() == 6 * 8  # the storage a stage frees and gathers
