"""Pipeline parallelism on TensorFlow (pipeline_stages=), in one process over several CPU devices: a Sequential MLP
(with a regularizer, and with Dropout) and a functional convnet with a skip connection inside a stage, cut into 2
stages (GPipe and 1F1B, uneven micro-batches: batch 8 in 3, and the epoch's last batch smaller) and the MLP into 4
stages, train what one device trains at the same global batch (weights, History, evaluate, predict); TensorFlow
holds each stage's variables and optimizer slots on its device and runs each stage's ops there (the device of its
output); the saved model loads in plain Keras; what can't be done is a clear error before anything runs."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.full import only_in_full

import distkeras
from distkeras.errors import OptionError

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow",
                                reason="pipeline stages over one process' devices: TensorFlow's adapter")

if BACKEND == "tensorflow":
    from tests.backends.pipeline_models import (MODELS, X, Y, assert_backup_resumes,
                                                 assert_cut_refusals, assert_reduction_refusals, assert_same, mlp,
                                                 refusal, train_reduction)
    from tests.backends.tensorflow_pipeline_job import cpu_index, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ONE = {}


def one_device(name):
    if name not in _ONE:
        _ONE[name] = train(name)
    return _ONE[name]


@pytest.mark.parametrize("name, schedule, stages, eager", [
    ("mlp", "gpipe", 2, False), ("mlp-dropout", "1f1b", 2, False), ("mlp-dropout", "gpipe", 2, True),
    ("convnet", "1f1b", 2, False), ("convnet", "gpipe", ["skip"], True),
    pytest.param("transformer", "1f1b", 2, False, marks=only_in_full(
        "the transformer stack trains traced at 4 stages and at 2 stages x 2 replicas (1F1B, each stage's outputs "
        "read from its devices) in the default run (test_four_stages_on_four_devices_train_as_one_device), and "
        "2-stage 1F1B traced steps on the MLP and the convnet here"))])
def test_two_stages_train_as_one_device(name, schedule, stages, eager, tmp_path):
    """Traced steps (a tf.function per batch shape) and eager ones (run_eagerly=True), where each stage's output
    is read from the device it ran on."""
    one = one_device(name)
    save = str(tmp_path / "model.keras") if name == "convnet" else None
    two = train(name, stages, microbatches=3, schedule=schedule, save=save, eager=eager)
    assert_same(one, two)
    assert two["placed"] == two["expected"] and two["placed"]  # read from TensorFlow: variable.value.device
    assert {device for _, device in two["placed"]} == {0, 1}  # both stages hold something
    assert two["outputs"] == [0, 1]  # each stage's output computed on its device (TensorFlow's tensor.device)
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
                       check=True, env=dict(os.environ, KERAS_BACKEND="tensorflow"), timeout=120)
        np.testing.assert_allclose(np.load(tmp_path / "p.npy"), one["predict"], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_every_loss_reduction_trains_as_one_device(reduction):
    """A sum's micro-batches add up as they are, a mean_with_sample_weight's by their sample weights (uneven here):
    before, every reduction was weighed as a mean (a sum trained 1/M of one device's gradient)."""
    one = train_reduction(reduction)
    assert_same(one, train_reduction(reduction, 2, pipeline_stages=2, microbatches=3))


def test_four_stages_on_four_devices_train_as_one_device():
    """In a process of its own: the suite's processes have 3 CPU devices."""
    done = subprocess.run([sys.executable, "-m", "tests.backends.tensorflow_pipeline_job"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, KERAS_BACKEND="tensorflow"))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")  # the plain model's, unbuilt
def test_compile_after_distribute_global_clipnorm_and_save_weights(tmp_path):
    """compile() after distribute() trains as one device, with an optimizer that reads every gradient at once
    (global_clipnorm: one apply over every stage's gradients) and validation data; its slots, made then, sit on
    their stages' devices; the step is traced once per batch shape; save_weights() writes the plain model's
    weights."""

    def run(distributed):
        model = mlp()
        if distributed:
            model = distkeras.distribute(model, ["cpu:0", "cpu:1"], pipeline_stages=2, microbatches=3)
        model.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.05), loss="mse", metrics=["mae"])
        history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=True,
                            validation_data=(X[:10], Y[:10])).history
        return model, history

    one, one_history = run(False)
    two, two_history = run(True)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(one_history[key], two_history[key], rtol=1e-5, atol=1e-6)
    slots = {v.path: cpu_index(v.value.device) for v in two.optimizer.variables if "d4" in v.path}
    assert slots and set(slots.values()) == {1}, slots
    path = str(tmp_path / "w.weights.h5")
    two.save_weights(path)
    plain = mlp()
    plain.load_weights(path)
    for a, b in zip(plain.get_weights(), two.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Traced per batch shape (8 rows, the last 6; TensorFlow traces a function's first call twice), not per epoch
    # nor per fit(); evaluate() (its own function) leaves the train step's traces alone.
    traces = two.__dict__["_distkeras_pipeline"].traced["train_step"].experimental_get_tracing_count
    assert traces() <= 3
    before = traces()
    two.fit(X, Y, batch_size=8, epochs=2, verbose=0, validation_data=(X[:10], Y[:10]))
    assert traces() == before


def test_what_cannot_be_done_is_a_clear_error_before_anything_runs():
    assert_reduction_refusals()
    assert_cut_refusals()
    said = refusal(mlp, devices=3, pipeline_stages=2)
    assert "2 stages need a multiple of 2 devices" in said and "Received: 3 device(s)" in said
    assert "Give 2 device(s) for one replica" in said
    said = refusal(mlp, pipeline_stages=2, compression="bf16")
    assert "doesn't combine with compression='bf16'" in said
    said = refusal(mlp, pipeline_stages=[])
    assert "gives one stage" in said
    model = mlp()  # a refused distribute() leaves the model as it was: plain Keras still trains it
    assert refusal(lambda: model, pipeline_stages=2, schedule="zigzag")
    assert "_distkeras_pipeline" not in model.__dict__ and "train_step" not in model.__dict__


def test_several_workers_are_refused():
    from distkeras.backends.tensorflow.adapter import TensorFlowAdapter
    from distkeras.cluster import Cluster
    from distkeras.devices import Device

    worker = Cluster(rank=1, world_size=2, local_rank=0, local_world_size=1, coordinator="127.0.0.1:1234",
                     source="test", workers=None, variables=None)
    assert worker.is_multi_worker
    with pytest.raises(OptionError, match="one process in this version; this process is worker 1 of 2"):
        TensorFlowAdapter().distribute(mlp(), [Device("cpu", 0), Device("cpu", 1)], worker, pipeline_stages=2)


def test_backup_and_restore_resumes_a_pipelined_model_to_the_uninterrupted_run(tmp_path):
    assert_backup_resumes(tmp_path)
