"""scripts/gpu-check.sh on a machine without an NVIDIA GPU: every path is a SKIP that names the reason, the exit
code is 0, it is quick, and it imports no framework (stand-ins that raise on import shadow them here).

The checks themselves need a GPU; ``DISTKERAS_GPU_CHECK_FAKE_CPU=1 bash scripts/gpu-check.sh`` runs them on CPU
devices (about a minute on 2 cores, so not in this suite)."""

import glob
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = ["tf-mirrored", "jax", "torch-nccl", "torch-shard", "torch-compression", "torch-tensor",
         "torch-pipeline"]
HAS_GPU = shutil.which("nvidia-smi") is not None or bool(glob.glob("/dev/nvidia[0-9]*"))
pytestmark = pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU: run bash scripts/gpu-check.sh itself")


def gpu_check(tmp_path, *args, env=None):
    blockers = tmp_path / "blockers"
    for framework in ("tensorflow", "jax", "torch", "keras"):
        (blockers / framework).mkdir(parents=True, exist_ok=True)
        (blockers / framework / "__init__.py").write_text(
            "raise ImportError('the no-GPU path of the GPU check imported {}')\n".format(framework))
    extra, env = env or {}, {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_GPU_CHECK")}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(blockers), **extra)
    started = time.monotonic()
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-check.sh"), *args], capture_output=True,
                          text=True, env=env, timeout=60, cwd=tmp_path)
    return done, time.monotonic() - started


def test_without_a_gpu_every_path_skips_naming_why(tmp_path):
    done, seconds = gpu_check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert seconds < 30
    lines = done.stdout.splitlines()
    for name in PATHS:
        assert "SKIP {}: no NVIDIA GPU (nvidia-smi not found, no /dev/nvidia* device) [0.0 s]".format(name) in lines
    assert lines[-1].startswith("summary: 0 PASS, 0 FAIL, {} SKIP in ".format(len(PATHS))) and lines[-1].endswith(": OK")
    assert "python {}".format(sys.version.split()[0]) in done.stdout  # the versions, printed first
    assert "ImportError" not in done.stdout + done.stderr


def test_paths_can_be_picked_and_a_misspelt_one_is_refused(tmp_path):
    done, _ = gpu_check(tmp_path, "jax")
    assert done.returncode == 0
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("SKIP")] == ["SKIP jax"]
    done, _ = gpu_check(tmp_path, "jaxx")
    assert done.returncode == 2
    assert "unknown path(s) jaxx; the paths are {}".format(", ".join(PATHS)) in done.stdout


def test_a_framework_that_is_not_installed_is_a_skip_not_a_failure(tmp_path):
    # A GPU image may hold PyTorch and JAX but no TensorFlow: that path has nothing to check. Run in the fake-CPU
    # mode (the paths really start), with every framework shadowed by a stand-in that raises ImportError.
    done, _ = gpu_check(tmp_path, "tf-mirrored", "jax", env={"DISTKERAS_GPU_CHECK_FAKE_CPU": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIP")]
    assert [line.split(":")[0] for line in skips] == ["SKIP tf-mirrored", "SKIP jax"], done.stdout
    assert "SKIP tf-mirrored: tensorflow is not installed in {} (ImportError: ".format(sys.executable) in skips[0]
