"""The main job, end to end on the active backend: `distkeras demo`, the README's demo command exactly as
written, and the unchanged example script."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.backends.harness import BACKEND, PROCESS_BACKENDS
from tests.full import FULL, only_in_full

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, tmp_path, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    full_env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=os.path.join(ROOT, "src"), **env)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, cwd=tmp_path,
                          timeout=600)


@only_in_full("the README's demo command (test_the_readme_demo_command_runs_and_exits) runs this demo and checks "
              "the same output; this adds only --out")
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


#: Seconds the README's demo command may take (set-up of an existing .venv, 30 epochs, the reload); a hang fails.
README_DEMO_TIMEOUT = 300
#: Launcher variables this test process may hold: a user's shell has none of them.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
                  "XLA_FLAGS", "PYTHONPATH", "PYTEST_CURRENT_TEST", "KERAS_BACKEND")


def readme_demo_command():
    """The demo command of the README's "The two commands" table, with the backend picked the way the README
    tells users to (`KERAS_BACKEND=jax bash scripts/demo.sh` runs the demo on another backend)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    rows = [line for line in readme.splitlines() if line.startswith("| set up and run the demo")]
    assert len(rows) == 1, "README.md: expected one table row for the demo, found {}".format(rows)
    command = re.findall(r"`([^`]+)`", rows[0])[-1]
    other = re.search(r"`KERAS_BACKEND=\w+ ([^`]+)` runs the demo on another backend", readme)
    assert other and other.group(1) == command, "README.md: the per-backend demo command differs from {!r}".format(command)
    return "KERAS_BACKEND={} {}".format(BACKEND, command)


def session_processes(session):
    """The live processes (zombies aside) of session ``session``."""
    import psutil

    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getsid(process.pid) == session and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


@pytest.mark.skipif(not FULL and BACKEND == "jax", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): the default run runs the README's demo command on TensorFlow (the "
    "README's backend: one process over its devices, as JAX's demo is) and on PyTorch (a job of a process per "
    "device); about 90 s a backend"))
def test_the_readme_demo_command_runs_and_exits(tmp_path):
    """The README's command, run as a user runs it (from the repository, in a shell with no launcher
    variables): it ends by itself within the time limit, says "demo OK" once, leaves no process behind, and
    only the folder it names as the output (temporary folders go to TMPDIR, here ``tmp_path``)."""
    command = readme_demo_command()
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("DISTKERAS_")}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Returns once every process holding the output pipes is gone: the demo and any worker it started.
        stdout, stderr = proc.communicate(timeout=README_DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("`{}` did not end within {} s (killed):\n{}\n{}".format(
            command, README_DEMO_TIMEOUT, stdout[-2000:], stderr[-3000:]))
    deadline = time.monotonic() + 10
    left = session_processes(proc.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_processes(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert proc.returncode == 0, "`{}` exited {}:\n{}\n{}".format(command, proc.returncode, stdout[-2000:], stderr[-3000:])
    assert not left, "`{}` left processes behind: {}".format(command, [" ".join(p.cmdline()[:4]) for p in left])
    assert stdout.count("demo OK") == 1, stdout[-2000:]
    workers = 2 if BACKEND in PROCESS_BACKENDS else 1  # on torch the demo is a job of one process per device
    assert "devices: cpu:0, cpu:1 | replicas: 2 | backend: {} | rank 0 of {} worker(s)".format(BACKEND, workers) in stdout
    assert "Epoch 30/30" in stdout  # Keras' own progress output
    assert float(re.search(r"test accuracy: ([0-9.]+)", stdout).group(1)) >= 0.9
    assert "distkeras imported: False" in stdout
    saved = re.search(r"saved (\S+)/digits_mlp.keras -> reloaded", stdout).group(1)
    assert os.path.dirname(saved) == str(tmp_path) and os.path.exists(os.path.join(saved, "digits_mlp.keras"))
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("distkeras")) == [os.path.basename(saved)]


@only_in_full("the example is the backend-neutral script of the README demo command's model, which the default run "
              "runs on TensorFlow and PyTorch through `distkeras demo`; the gallery's examples run in test_examples.py")
def test_example_script_runs_unchanged(tmp_path):
    done = run([os.path.join(ROOT, "examples", "digits_mlp.py"), "--epochs", "20"], tmp_path, DISTKERAS_CPU_DEVICES="2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "2 replica(s) on cpu:0, cpu:1" in done.stderr
    assert float(re.search(r"test accuracy: ([0-9.]+)", done.stdout).group(1)) >= 0.9
    assert os.path.exists(os.path.join(str(tmp_path), "digits_mlp.keras"))
