"""The examples gallery (examples/, docs/examples.md): every Python example runs, unchanged, as a user runs it
(`python examples/NAME.py`, DISTKERAS_CPU_DEVICES=2, in a fresh process), on little data (fewer epochs and
samples, through the scripts' own options), trains on 2 replicas, prints its result once and saves a model.

The default run runs each script on one backend (the suites' time is shared out: about 2 minutes of CPU for all of
them); DISTKERAS_FULL_TESTS=1 runs every script on every backend it supports. The scripts that hold a step per
backend (custom_train_step.py, custom_training_loop.py) hold the Keras guides' steps, which the compatibility suite
and docs/loops.md run on every backend. digits_mlp.py is run by test_demo.py, the MXNet and CNTK scripts by tests/mxnet and
tests/cntk, examples/slurm/train.py on a Slurm cluster by tests/clusters/test_slurm.py; the Kubernetes Job and
the Slurm batch script are checked by tests/core/test_examples.py.
"""

import os
import resource
import subprocess
import sys
import time

import pytest

from tests.backends.harness import BACKEND
from tests.full import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVERY = ("tensorflow", "jax", "torch")
#: script -> (backends of the default run, backends it runs on, its options for little data, a line rank 0 prints,
#: the model it saves or None)
EXAMPLES = {
    "image_classification.py": (("tensorflow",), EVERY, ["--epochs", "1"], "test accuracy:",
                                "image_classification.keras"),
    "text_classification.py": (("jax",), EVERY, ["--epochs", "1", "--samples", "256"], "test accuracy:",
                               "text_classification.keras"),
    "keras_hub_finetune.py": (("tensorflow",), EVERY, ["--epochs", "1", "--samples", "128"], "test accuracy:",
                              "keras_hub_finetune.keras"),
    "custom_train_step.py": (("torch",), EVERY, ["--epochs", "1"], "test accuracy:", "custom_train_step.keras"),
    "custom_training_loop.py": (("jax",), EVERY, ["--epochs", "1"], "training accuracy:", None),
    "sharded_training.py": (("jax",), ("jax", "torch"), ["--epochs", "1"], "test accuracy:",
                            "sharded_training.keras"),
}
TIMEOUT = 300
#: (script, backend) -> why it fails there today: a strict xfail, so the fix shows (remove the entry then).
KNOWN_FAILURES = {}


def cases():
    params = []
    for name, (default, supported, _, _, _) in sorted(EXAMPLES.items()):
        if BACKEND not in supported:
            why = "{} runs on {} only".format(name, ", ".join(supported))
        elif BACKEND not in default and not FULL:
            why = ("full run only (DISTKERAS_FULL_TESTS=1): the default run runs this backend-neutral script on {}, "
                   "its cheapest backend".format(", ".join(default)))
        else:
            why = None
        if why:
            marks = pytest.mark.skip(reason=why)
        elif (name, BACKEND) in KNOWN_FAILURES:
            marks = pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name, BACKEND])
        else:
            marks = ()
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def run_example(name, args, tmp_path, env=None, cpu_devices=2):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    full_env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=os.path.join(ROOT, "src"), **(env or {}))
    if cpu_devices:
        full_env["DISTKERAS_CPU_DEVICES"] = str(cpu_devices)
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)] + args, capture_output=True,
                          text=True, env=full_env, cwd=str(tmp_path), timeout=TIMEOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print("examples/{} on {}: {:.1f} s, {:.1f} s of CPU".format(name, BACKEND, time.monotonic() - started, cpu))
    return done


@pytest.mark.parametrize("name", cases())
def test_example_runs_on_two_replicas(name, tmp_path):
    _, _, args, result_line, saved = EXAMPLES[name]
    done = run_example(name, args, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    assert "{} backend, 2 replica(s)".format(BACKEND) in done.stderr, done.stderr[-3000:]
    assert done.stdout.count(result_line) == 1, done.stdout[-3000:]  # rank 0 alone prints
    if saved:
        assert os.path.exists(os.path.join(str(tmp_path), saved)), os.listdir(str(tmp_path))


@pytest.mark.skipif(not FULL or BACKEND != "torch", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1), on PyTorch: examples/ray_train.py starts a local Ray instance and 2 "
    "workers (30 s to 2 minutes on 2 cores, with the load); in the default run tests/clusters/test_ray.py runs train loops of the same "
    "shape (TorchTrainer, TensorflowTrainer, a JAX DataParallelTrainer with prepare_jax) on a two-node Ray cluster"))
def test_ray_example_trains_under_ray_train(tmp_path):
    pytest.importorskip("ray.train", reason="ray[train] is not installed")
    store = str(tmp_path / "store")
    done = run_example("ray_train.py", ["--epochs", "1", "--storage", store], tmp_path,
                       env={"RAY_USAGE_STATS_ENABLED": "0"}, cpu_devices=None)  # a Ray worker is one device
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    assert "trained on 2 worker(s)" in done.stdout + done.stderr
    assert os.path.exists(os.path.join(store, "model.keras"))
