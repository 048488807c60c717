"""Pipeline parallelism on JAX (pipeline_stages=), in one process over several CPU devices: a Sequential MLP (with a
regularizer, and with Dropout) and a functional convnet with a skip connection inside a stage, cut into 2 stages
(GPipe and 1F1B, uneven micro-batches: batch 8 in 3, and the epoch's last batch smaller) and the MLP into 4 stages,
train what one device trains at the same global batch (weights, History, evaluate, predict); JAX holds each stage's
variables and optimizer slots on its device; the saved model loads in plain Keras; what can't be done is a clear
error before anything runs."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.full import only_in_full

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="pipeline stages over one process' devices: JAX's adapter")

if BACKEND == "jax":
    from tests.backends.jax_pipeline_job import train
    from tests.backends.pipeline_models import (MODELS, assert_backup_resumes, assert_cut_refusals,
                                                 assert_reduction_refusals, assert_same, mlp, refusal,
                                                 train_reduction)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ONE = {}


def one_device(name):
    if name not in _ONE:
        _ONE[name] = train(name)
    return _ONE[name]


@pytest.mark.parametrize("name, schedule, stages", [
    ("mlp", "gpipe", 2), ("mlp-dropout", "1f1b", 2), ("convnet", "1f1b", 2), ("convnet", "gpipe", ["skip"]),
    pytest.param("transformer", "1f1b", 2, marks=only_in_full(
        "the transformer stack trains at 4 stages and at 2 stages x 2 replicas in the default run "
        "(test_four_stages_on_four_devices_train_as_one_device); about a minute"))])
def test_two_stages_train_as_one_device(name, schedule, stages, tmp_path):
    one = one_device(name)
    save = str(tmp_path / "model.keras") if name == "convnet" else None
    two = train(name, stages, microbatches=3, schedule=schedule, save=save)
    assert_same(one, two)
    assert two["placed"] == two["expected"] and two["placed"]  # read from JAX: array.devices()
    assert {tuple(devices) for _, devices in two["placed"]} == {(0,), (1,)}  # both stages hold something
    assert two["describe"]["replicas"] == 1 and two["describe"]["model_shards"] == 2
    first, second = two["stages"]
    assert first and second and not set(first) & set(second)
    if name == "convnet":
        assert ("c2" in first) == ("skip" in first)  # c2 and the Add on one side
    if save is not None:  # the plain model, which loads without distkeras and predicts the same
        script = ("import sys, numpy as np, keras; m = keras.saving.load_model(sys.argv[1]); "
                  "np.save(sys.argv[2], m.predict(np.load(sys.argv[3]), verbose=0)); "
                  "assert 'distkeras' not in sys.modules")
        np.save(tmp_path / "x.npy", MODELS[name][1][:7])
        subprocess.run([sys.executable, "-c", script, save, str(tmp_path / "p.npy"), str(tmp_path / "x.npy")],
                       check=True, env=dict(os.environ, KERAS_BACKEND="jax"), timeout=120)
        np.testing.assert_allclose(np.load(tmp_path / "p.npy"), one["predict"], rtol=1e-4, atol=2e-5)


def test_four_stages_on_four_devices_train_as_one_device():
    """In a process of its own: the suite's processes have 3 CPU devices."""
    done = subprocess.run([sys.executable, "-m", "tests.backends.jax_pipeline_job"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, KERAS_BACKEND="jax"))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]


def test_compile_after_distribute_and_batchnorm_per_micro_batch():
    """compile() after distribute() (the optimizer's slots made then go to their stages' devices) trains as one
    device; BatchNormalization runs on each micro-batch's statistics, its moving statistics on its stage's device."""
    import jax

    build, x, y = MODELS["mlp"]
    model = distkeras.distribute(build(), ["cpu:0", "cpu:1"], pipeline_stages=2, microbatches=3)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])  # a new optimizer
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=True)
    for a, b in zip(one_device("mlp")["weights"], model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    slots = {v.path: v.value.devices() for v in model.optimizer.variables if "d4" in v.path}
    assert slots and set(map(frozenset, slots.values())) == {frozenset([jax.devices("cpu")[1]])}
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(8, name="b"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="c")])
    model.compile(optimizer="sgd", loss="mse")
    model = distkeras.distribute(model, ["cpu:0", "cpu:1"], pipeline_stages=["a"], microbatches=2)
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)  # one batch shape: one trace per stage
    moving = model.get_layer("bn").moving_mean
    assert moving.value.devices() == {jax.devices("cpu")[1]} and np.abs(np.asarray(moving.value)).sum() > 0


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_every_loss_reduction_trains_as_one_device(reduction):
    """A sum's micro-batches add up as they are, a mean_with_sample_weight's by their sample weights (uneven here):
    before, every reduction was weighed as a mean (a sum trained 1/M of one device's gradient)."""
    one = train_reduction(reduction)
    assert_same(one, train_reduction(reduction, 2, pipeline_stages=2, microbatches=3))


def test_what_cannot_be_done_is_a_clear_error_before_anything_runs():
    assert_reduction_refusals()
    assert_cut_refusals()
    said = refusal(mlp, devices=3, pipeline_stages=2)
    assert "2 stages need a multiple of 2 devices" in said and "Received: 3 device(s)" in said
    assert "Give 2 device(s) for one replica" in said
    said = refusal(mlp, pipeline_stages=2, shard="all")
    assert "doesn't combine with shard='all'" in said
    said = refusal(mlp, pipeline_stages=2, strategy="model")
    assert "doesn't combine with strategy='model'" in said
    said = refusal(lambda: mlp(optimizer=keras.optimizers.Adam(use_ema=True)), pipeline_stages=2)
    assert "use_ema=True" in said and "stage by stage" in said


def test_backup_and_restore_resumes_a_pipelined_model_to_the_uninterrupted_run(tmp_path):
    assert_backup_resumes(tmp_path)


def test_global_clipnorm_clips_by_the_norm_over_every_stage():
    """Each stage's gradients scaled by the norm of all of them, as one device's optimizer scales them (SGD, so the
    clipping shows in the weights: an unclipped run ends elsewhere)."""
    def fit(stages, clip=0.05):
        model = mlp(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=clip))
        if stages:
            model = distkeras.distribute(model, ["cpu:0", "cpu:1"], pipeline_stages=stages, microbatches=3)
        model.fit(MODELS["mlp"][1], MODELS["mlp"][2], batch_size=8, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    one, two, unclipped = fit(None), fit(2), fit(None, clip=None)
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, unclipped)) > 1e-2
