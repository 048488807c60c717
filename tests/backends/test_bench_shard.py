"""``python -m benchmarks memory`` and ``shard-cost`` end to end on a tiny model: the shape of what they write,
never their figures (those are the benchmark's, benchmarks/results-shard/)."""

import json
import os
import subprocess
import sys

import pytest

from tests.backends.harness import BACKEND
from tests.full import FULL, only_in_full

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if BACKEND not in ("torch", "jax"):
    pytest.skip("sharded training state (shard=) is built on PyTorch and JAX only", allow_module_level=True)
if not FULL:
    pytest.skip("full run only (DISTKERAS_FULL_TESTS=1): the memory and step-time harnesses of benchmarks/ end to end "
                "(about a minute a backend); they measure, they don't train anything users run, and the sharded "
                "training they drive is tested in test_jax_shard.py and test_torch_shard*.py", allow_module_level=True)


def bench(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=os.path.join(ROOT, "src"))
    done = subprocess.run([sys.executable, "-m", "benchmarks"] + [str(a) for a in args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def test_memory_reads_every_rank_and_writes_table_and_plot(tmp_path):
    bench("memory", "--backends", BACKEND, "--workloads", "mlp", "--width", "0.01", "--devices", "1,2", "--modes",
          "none,optimizer", "--steps", "2", "--out", tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"command", "machine", "settings", "runs"} <= set(results)
    runs = {(r["devices"], r["mode"]): r for r in results["runs"]}
    assert set(runs) == {(1, "none"), (2, "none"), (2, "optimizer")}  # N=1: unsharded only
    for key, run in runs.items():
        if "not_built" in run:
            continue
        assert not run.get("error"), run.get("error")
        assert [r["rank"] for r in run["ranks"]] == list(range(key[0]))
        summary = run["summary"]
        assert summary["weights_bytes"] > 0 and summary["optimizer_bytes"] > 0 and summary["peak_process_bytes"] > 0
        assert summary["total_fraction"] > 0
        if BACKEND == "torch":
            assert summary["gradients_bytes"] > 0 and summary["live_tensor_bytes_at_apply"] > 0
        else:  # JAX's gradients: not an array; XLA's analysis of the compiled step stands in for them
            assert summary["gradients_bytes"] is None and run["ranks"][0]["gradients_note"]
            # Pins benchmarks.memory.JaxStepCapture's reach into keras.src.backend.jax.trainer.jit: where Keras
            # moves it, the analysis is missing and this says why.
            assert summary["step_temp_bytes"], run["ranks"][0]["gradients_note"]
    assert runs[(1, "none")]["summary"]["total_fraction"] == 1.0
    assert "| {} | mlp | 2 | optimizer |".format(BACKEND) in (tmp_path / "results.md").read_text()
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@only_in_full("the cost harness times benchmarks.hosts' job (a minute and more here); the default run keeps the memory harness's check")
def test_shard_cost_on_one_host_times_every_mode_against_unsharded(tmp_path):
    bench("shard-cost", "--backends", BACKEND, "--places", "one host", "--modes", "none,optimizer", "--width", "0.01",
          "--batch", "8", "--steps", "2", "--windows", "2", "--out", tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    [run] = results["runs"]
    assert run["place"] == "one host" and not run.get("error"), run.get("error")
    assert set(run["modes"]) == {"none", "optimizer"}
    assert run["modes"]["none"]["over_none"] == 1.0
    optimizer = run["modes"]["optimizer"]
    if "not_built" not in optimizer:
        assert len(optimizer["step_s"]["values"]) == 2 and optimizer["over_none"] > 0
    assert "| {} | one host | optimizer |".format(BACKEND) in (tmp_path / "results.md").read_text()
    assert (tmp_path / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
