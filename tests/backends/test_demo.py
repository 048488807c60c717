"""The main job, end to end on the active backend: `distkeras demo` and the unchanged example script."""

import os
import re
import subprocess
import sys

from tests.backends.harness import BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, tmp_path, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    full_env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=os.path.join(ROOT, "src"), **env)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, cwd=tmp_path,
                          timeout=600)


def test_demo_trains_on_two_devices_reaches_90_percent_and_reloads(tmp_path):
    done = run(["-m", "distkeras", "demo", "--devices", "2", "--out", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "devices: cpu:0, cpu:1 | replicas: 2 | backend: {}".format(BACKEND) in out
    assert "Epoch 30/30" in out  # Keras' own progress output
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9
    assert "distkeras imported: False" in out and "demo OK" in out
    assert os.path.exists(os.path.join(str(tmp_path), "digits_mlp.keras"))


def test_example_script_runs_unchanged(tmp_path):
    done = run([os.path.join(ROOT, "examples", "digits_mlp.py"), "--epochs", "20"], tmp_path, DISTKERAS_CPU_DEVICES="2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "2 replica(s) on cpu:0, cpu:1" in done.stderr
    assert float(re.search(r"test accuracy: ([0-9.]+)", done.stdout).group(1)) >= 0.9
    assert os.path.exists(os.path.join(str(tmp_path), "digits_mlp.keras"))
