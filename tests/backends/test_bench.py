"""The benchmark harness end to end on a tiny workload: the shape of what it writes, never its timings."""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import backends as bench_backends
from benchmarks.variants import KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Before the harness: it sets up distkeras for the backend, which fails where distkeras lacks the adapter.
_ACTIVE = os.environ.get("KERAS_BACKEND", "tensorflow")
if not bench_backends.covered(_ACTIVE):
    pytest.skip("the benchmark has no module for {} yet: {}".format(_ACTIVE, bench_backends.uncovered_reason(_ACTIVE)),
                allow_module_level=True)

from tests.full import FULL  # noqa: E402

if not FULL:
    pytest.skip("full run only (DISTKERAS_FULL_TESTS=1): the benchmark harness end to end and the shape of what it "
                "writes (about 80 s a backend); it measures, it trains nothing users run", allow_module_level=True)

from tests.backends.harness import BACKEND, keras  # noqa: E402,F401 - skips where the framework is missing


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=os.path.join(ROOT, "src"))
    command = [sys.executable, "-m", "benchmarks", "run", "--backends", BACKEND, "--devices", "1,2",
               "--workloads", "digits", "--steps", "2", "--windows", "5", "--warmup", "0", "--platform", "cpu",
               "--out", str(folder)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return folder


def test_json_holds_every_figure_and_the_machine(out):
    with open(os.path.join(str(out), "results.json")) as handle:
        results = json.load(handle)
    assert {"command", "machine", "settings", "runs", "setup", "skipped"} <= set(results)
    machine = results["machine"]
    assert {"cpu_model", "cpu_count", "memory_bytes", "versions", "load_average"} <= set(machine)
    assert len(machine["load_average"]["before"]) == 3 and len(machine["load_average"]["after"]) == 3
    assert machine["versions"]["keras"]

    runs = {run["devices"]: run for run in results["runs"]}
    assert sorted(runs) == [1, 2] and not any(run.get("error") for run in runs.values())
    assert list(runs[1]["variants"]) == ["plain"]
    two = runs[2]
    assert set(two["variants"]) == set(KEYS)
    for figures in two["variants"].values():
        rate = figures["samples_per_s"]
        assert {"median", "min", "max", "p25", "p75"} <= set(rate) and len(rate["values"]) == 5
        assert len(figures["window_wall_s"]) == 5 and "setup" in figures["first_step_s"]
    assert two["variants"]["distkeras"]["first_step_s"]["distribute"] > 0
    assert {"distkeras/native", "distkeras/make_parallel"} == set(two["ratios"])
    assert set(two["scaling_efficiency"]) == set(KEYS)
    comm = two["communication"]
    assert {"parameter_bytes", "copy_bandwidth_bytes_per_s", "ring_bound_s", "allreduce_s", "allreduce_over_bound"} <= set(comm)
    assert len(two["load_average"]["before"]) == 3

    setup = {(entry["variant"], entry["devices"]): entry for entry in results["setup"]}
    assert set(setup) == {("plain", 1), ("distkeras", 2), ("native", 2), ("make_parallel", 2)}
    for entry in setup.values():
        assert not entry.get("error")
        assert entry["memory"]["peak_rss_bytes"] >= entry["memory"]["baseline_rss_bytes"]
        assert entry["first_step_s"]["setup"] > 0


def test_plot_is_a_png(out):
    with open(os.path.join(str(out), "throughput.png"), "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_markdown_table_has_a_row_per_run_and_variant(out):
    with open(os.path.join(str(out), "results.md")) as handle:
        text = handle.read()
    rows = [line for line in text.splitlines() if line.startswith("| {} | digits |".format(BACKEND))]
    throughput = [r for r in rows if re.match(r"\| \w+ \| digits \| [12] \| [\d,]+ \(", r)]
    assert len(throughput) == 2
    assert "—" not in throughput[1].split("|")[5]  # N=2 has b, c and d figures
    for letter, key in zip("abcd", KEYS):
        assert any("| {} {} |".format(letter, key) in r for r in rows), key
    assert any(re.match(r"\| \w+ \| digits \| 2 \| 0\.1 \|", r) for r in rows)  # communication
    assert "Load average" in text and "Command: `python -m benchmarks run" in text
