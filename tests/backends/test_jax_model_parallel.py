"""Model parallelism on JAX (strategy="model"): in one process and across processes, equal to one device.

The models and the worker are in :mod:`tests.backends.model_parallel_job`: an MLP (Megatron's column-then-row
pair), a transformer block (attention split by heads, a feed-forward pair) and tiny KerasHub causal LMs (Gemma,
Llama) laid out by their backbone's own ``get_layout_map``. The jobs run side by side while the one-process
cases run here: 2 processes x 1 CPU device (the "model" axis across processes), 2 processes x 2 devices (2x2
"batch" x "model", and 1x4) and, in the full run only, one process of 4 devices (FULL_ONLY: the cases the
default run leaves to the others). Each is compared with the same model trained on one
device here (weights, History losses, evaluate, predict, and the optimizer's state through the saved file, which a
fresh process loads without distkeras).
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.full import FULL, only_in_full

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="strategy='model' across processes is the JAX adapter's "
                                 "(Keras' ModelParallel); PyTorch's tensor parallelism is tested in its own module")

from tests.backends import model_parallel_job as job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL, ATOL = 1e-4, 5e-5
HUB = importlib.util.find_spec("keras_hub") is not None
NO_HUB = "keras-hub is not installed here: the KerasHub cases (Gemma, Llama) need it"
#: job -> (CPU devices per process, processes, cases)
JOBS = {
    "1x2proc": (1, 2, ["mlp-2", "block-2", "gemma-2", "resume-2"]),  # the "model" axis spans the processes
    "2x2proc": (2, 2, ["mlp-2", "llama-2", "block-4"]),  # 2x2: "batch" across processes; 1x4: "model" across
    "4dev": (4, 1, ["gemma-4"]),  # one process, 4 devices
}
#: (job, case) -> why the default run doesn't need it: the full run (DISTKERAS_FULL_TESTS=1) runs these too.
FULL_ONLY = {
    ("1x2proc", "block-2"): "the transformer block's layout runs at 2 model shards in one process "
    "(test_model_shards_2_in_one_process_equals_one_device[block]) and with the 'model' axis across the processes "
    "at 4 shards (2x2proc-block-4); the 'model' axis across 2 processes of 1 device: 1x2proc-mlp-2 and -gemma-2",
    ("4dev", "gemma-4"): "one process of several devices runs Gemma's own layout map at 2 model shards "
    "(test_model_shards_2_in_one_process_equals_one_device[gemma]), 4 model shards run over 2x2 devices "
    "(2x2proc-block-4) and Gemma across processes on 1x2proc-gemma-2",
}
if HUB:  # without keras-hub, the MLP is 2x2proc's only model and runs by default
    FULL_ONLY["2x2proc", "mlp-2"] = (
        "the 2x2 mesh ('batch' across the processes, 'model' within each) trains Llama by its own layout map "
        "(2x2proc-llama-2, whose saved file is loaded too); the MLP's layout runs across processes on 1x2proc-mlp-2 "
        "and in one process")
ALL_JOBS = JOBS
if not HUB:
    JOBS = {key: (d, p, [c for c in cases if not c.startswith(("gemma", "llama"))]) for key, (d, p, cases) in
            JOBS.items()}
if not FULL:
    JOBS = {key: (d, p, [c for c in cases if (key, c) not in FULL_ONLY]) for key, (d, p, cases) in JOBS.items()}
JOBS = {key: value for key, value in JOBS.items() if value[2]}
_references = {}


def reference(name):
    """``name`` trained on one device: results as the job writes them, and the optimizer's variables."""
    if name not in _references:
        model = job.build(name)
        found = job.results(model, name, job.train(model, name))
        found["optimizer"] = [np.asarray(v) for v in model.optimizer.variables]
        _references[name] = found
    return _references[name]


def close(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg="{} {}".format(what, i))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Start the three jobs at once; ``jobs(key)`` waits for one and gives its folder."""
    started = {}
    for key, (devices, processes, cases) in JOBS.items():
        out = tmp_path_factory.mktemp(key)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
        env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=BACKEND,
                   DISTKERAS_CPU_DEVICES=str(devices))
        worker = ["-m", "tests.backends.model_parallel_job", str(out)] + cases
        command = [sys.executable] + (["-m", "distkeras", "launch", "--nproc-per-node", str(processes), "--backend",
                                       BACKEND] if processes > 1 else []) + worker
        log = open(out / "log.txt", "w")
        started[key] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), out, log)

    def finished(key):
        proc, out, log = started[key]
        try:
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        assert proc.returncode == 0, (out / "log.txt").read_text()[-5000:]
        return out

    yield finished
    for proc, _, log in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def rank_results(out, case, rank):
    saved = np.load(str(out / "{}-rank{}.npz".format(case, rank)))
    weights = [saved["arr_{}".format(i)] for i in range(len(saved.files) - 3)]
    with open(str(out / "{}-rank{}.json".format(case, rank))) as f:
        info = json.load(f)
    return dict(weights=weights, loss=saved["loss"], evaluate=saved["evaluate"], predict=saved["predict"], **info)


# ---- one process (this one: 3 CPU devices)


@pytest.mark.parametrize("name", ["mlp", "block", pytest.param("gemma", marks=pytest.mark.skipif(not HUB, reason=NO_HUB))])
def test_model_shards_2_in_one_process_equals_one_device(name):
    expected = reference(name)
    model = job.distributed(name, 2, devices=2)
    found = job.results(model, name, job.train(model, name))
    close(found["weights"], expected["weights"], "weight")
    close([np.asarray(v) for v in model.optimizer.variables], expected["optimizer"], "optimizer variable")
    for key in ("loss", "evaluate", "predict"):
        close([found[key]], [expected[key]], key)
    described = distkeras.describe(model)
    assert (described["replicas"], described["model_shards"]) == (1, 2)


def test_describe_reports_replicas_and_model_shards(caplog):
    x = keras.Input((6,))
    build = lambda: keras.Model(x, keras.layers.Dense(4)(keras.layers.Dense(6)(x)))  # noqa: E731
    with caplog.at_level("INFO", logger="distkeras"):
        shards2 = distkeras.distribute(build(), devices=2, strategy="model", model_shards=2)
    assert "1 replica(s) x 2 model shard(s) on cpu:0, cpu:1" in caplog.text
    # every shard runs the whole batch (it said "split evenly")
    assert "fit()'s batch_size is the global batch, run whole by every model shard" in caplog.text, caplog.text
    expected = {"backend": "jax", "devices": ["cpu:0", "cpu:1"], "replicas": 1, "model_shards": 2, "rank": 0,
                "workers": 1, "distributed": True, "shard": None}
    assert distkeras.describe(shards2) == expected
    batch_only = distkeras.distribute(build(), devices=2, strategy="model", model_shards=1)
    assert distkeras.describe(batch_only) == dict(expected, replicas=2, model_shards=1)
    data = distkeras.distribute(build(), devices=3)
    assert distkeras.describe(data)["replicas"] == 3 and distkeras.describe(data)["model_shards"] == 1
    assert distkeras.describe(build())["model_shards"] == 1  # never distributed


@pytest.mark.parametrize("options, message", [
    ({"shard": "all"}, r"shard='all' applies to strategy='data' on JAX.*\('batch', 'model'\)"),
    ({"compression": "bf16"}, "compression applies to strategy='data'.*XLA places the collectives"),
])
def test_shard_and_compression_are_refused_saying_why(options, message):
    with pytest.raises(distkeras.OptionError, match=message):
        distkeras.distribute(job.mlp(), devices=2, strategy="model", **options)


# ---- across processes, and one process of 4 devices


#: Saved models loaded without distkeras: a Sequential split across processes, a functional block over 4 devices of 2
#: processes (1x4) and a KerasHub model on 2x2, its embeddings split over both axes (Llama's own layout).
SAVED = [(key, case) for key, case in [("1x2proc", "mlp-2"), ("2x2proc", "block-4"), ("2x2proc", "llama-2")]
         if key in JOBS and case in JOBS[key][2]]
CASES = [pytest.param(key, case, id="{}-{}".format(key, case), marks=[
    only_in_full(FULL_ONLY[key, case])] if (key, case) in FULL_ONLY else [])
    for key, (_, _, cases) in ALL_JOBS.items() for case in cases if not case.startswith("resume")
    if HUB or not case.startswith(("gemma", "llama"))]


@pytest.mark.parametrize("key, case", CASES)
def test_across_processes_equals_one_device(jobs, key, case):
    out = jobs(key)
    devices, processes, _ = JOBS[key]
    name, _, shards = case.rpartition("-")
    expected = reference(name)
    ranks = [rank_results(out, case, rank) for rank in range(processes)]
    for found in ranks:
        close(found["weights"], expected["weights"], "weight")
        for what in ("loss", "evaluate", "predict"):
            close([found[what]], [expected[what]], what)
        described = found["describe"]
        assert (described["replicas"], described["model_shards"], described["workers"]) == (
            devices * processes // int(shards), int(shards), processes)


def test_backup_and_restore_resumes_across_processes(jobs):
    """Stopped after epoch 1 (its checkpoint written), a new model with other weights resumes at epoch 2 from
    the checkpoint and ends where one device's uninterrupted run ends."""
    out = jobs("1x2proc")
    expected = reference("mlp")
    for rank in range(2):
        found = rank_results(out, "resume-2", rank)
        assert found["history"]["restored_epoch"] == [1]
        close(found["weights"], expected["weights"], "weight")
        close([found["loss"]], [expected["loss"][1:]], "loss")


def test_saved_model_is_plain_keras_and_loads_without_distkeras(jobs):
    """Every rank called save(); the file rank 0 wrote loads in a process that never imports distkeras, as the
    plain Keras (KerasHub) class, with one device's optimizer state, and predicts as the job did."""
    prefixes = []
    for key, case in SAVED:
        out = jobs(key)
        x, _ = job.data(case.rpartition("-")[0])
        np.savez(str(out / (case + "-inputs.npz")), **(x if isinstance(x, dict) else {"x": x}))
        prefixes.append((out, case))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=ROOT, KERAS_BACKEND=BACKEND)  # the loader asserts it never imported distkeras
    done = subprocess.run([sys.executable, "-m", "tests.backends.model_parallel_load"] + [str(out / case) for out, case
                                                                                         in prefixes],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    classes = {"mlp": "Sequential", "block": "Functional", "llama": "LlamaCausalLM"}
    for out, case in prefixes:
        name = case.rpartition("-")[0]
        loaded = np.load(str(out / (case + "-loaded.npz")))
        assert str(loaded["cls"]) == classes[name], case
        close([loaded["predict"]], [rank_results(out, case, 0)["predict"]], case + " predict")
        expected = reference(name)["optimizer"]
        close([loaded["opt_{}".format(i)] for i in range(len(expected))], expected, case + " optimizer variable")
