"""examples/cifar10_cnn_mxnet.py (scenario 2) runs, on two CPU contexts, and saves a plain model."""

import os
import subprocess
import sys

from tests.mxnet.harness import ROOT, keras  # noqa: F401 (skips without keras-mxnet)


def test_cifar10_example_runs_and_saves_a_plain_model(tmp_path):
    env = dict(os.environ, DISTKERAS_CPU_DEVICES="2")
    out = str(tmp_path / "cnn.h5")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "cifar10_cnn_mxnet.py"), "--quick", "--epochs", "1", "--out", out],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, env=env, timeout=300, cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 replica(s) on cpu:0, cpu:1" in done.stdout and "test loss" in done.stdout
    loaded = keras.models.load_model(out)
    assert type(loaded).__name__ == "Sequential" and len(loaded.layers) == 12
