"""``benchmarks.torch_gap`` end to end in a 2-process job on a tiny workload: its table and JSON, never its
timings."""

import json
import os
import subprocess
import sys

import pytest

from tests.backends.harness import BACKEND
from tests.full import only_in_full

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's b/c decomposition (KERAS_BACKEND=torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOPS = ["keras", "distkeras", "distkeras, overlap off", "distkeras, no all-reduce", "ddp loop", "ddp loop, no all-reduce"]


@pytest.mark.parametrize("feed", [
    pytest.param("pydataset", marks=only_in_full("the arrays feed runs the same seven loops and the same split")),
    pytest.param("arrays", marks=only_in_full(
        "a benchmark's harness (benchmarks/torch_gap.py), not distkeras: seven 2-process loops, over a minute here; "
        "test_refuses_to_run_as_one_process keeps its entry point in the default run"))])
def test_seven_loops_timed_and_the_gap_split(tmp_path, feed):
    out = tmp_path / "gap.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND="torch")
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "-m", "benchmarks.torch_gap",
               "--workload", "digits", "--steps", "2", "--windows", "2", "--warmup", "0", "--feed", feed, "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("[rank 0] | ")]
    loops = LOOPS + ["distkeras, whole batch read"]
    assert [row.split(" | ")[1] for row in rows[1:1 + len(loops)]] == loops
    assert "Keras fit() over a bare torch loop" in done.stdout and "communication in distkeras" in done.stdout
    assert "[rank 1] |" not in done.stdout  # rank 0 alone reports
    figures = json.loads(out.read_text())
    assert list(figures["seconds_per_step"]) == loops and figures["processes"] == 2 and figures["feed"] == feed
    assert all(len(values) == 2 and min(values) > 0 for values in figures["seconds_per_step"].values())


def test_refuses_to_run_as_one_process():
    env = dict(os.environ, PYTHONPATH=ROOT, KERAS_BACKEND="torch", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.torch_gap"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "distkeras launch --nproc-per-node 2 -m benchmarks.torch_gap" in done.stderr
