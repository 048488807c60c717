"""``python -m benchmarks hosts``: its settings, and its summary's table and plots (pure Python: the job itself
needs namespace hosts and runs as a benchmark)."""

import json
import os

import pytest

from benchmarks import hosts


def test_settings_map_to_distribute_options():
    assert hosts._setting("none") == {"compression": None}
    assert hosts._setting("bf16+always") == {"compression": "bf16", "compression_fallback": False}
    assert hosts._setting("fp16+no-overlap+shard-gradients") == {"compression": "fp16", "overlap": False,
                                                                 "shard": "gradients"}
    with pytest.raises(SystemExit, match="unknown setting 'bf16\\+sometimes'"):
        hosts._setting("bf16+sometimes")


def _report(hosts_count, workers, step, fell_back=False):
    settings = {"none": {"step_s": step, "unshaped_step_s": 0.1, "communication_s": step - 0.1,
                         "ring_bound_s": 0.5, "communication_over_bound": (step - 0.1) / 0.5,
                         "speedup_over_none": 1.0},
                "bf16": {"step_s": step, "unshaped_step_s": 0.1, "communication_s": step - 0.1, "ring_bound_s": 0.25,
                         "communication_over_bound": (step - 0.1) / 0.25, "speedup_over_none": 1.0}}
    runs = {"shaped": {"fell_back": {}}, "unshaped": {"fell_back": {"bf16": "slower here"} if fell_back else {}}}
    return {"command": "python -m benchmarks hosts measure --hosts {} --workers-per-host {} --workload deep".format(
        hosts_count, workers), "rate": "100mbit", "hosts": hosts_count, "workers_per_host": workers,
        "runs": {"jax": dict(runs, settings=settings)}}


def test_summary_tables_every_run_and_draws_both_plots(tmp_path):
    paths = []
    for i, report in enumerate([_report(2, 1, 0.6), _report(4, 1, 0.8), _report(4, 2, 0.9, True)]):
        paths.append(str(tmp_path / "r{}.json".format(i)))
        with open(paths[-1], "w") as handle:
            json.dump(report, handle)
    hosts.summary(paths, str(tmp_path / "out"))
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| jax | deep | 2 | 100mbit | none |  | 0.600 | 0.100 | 0.500 | 0.500 | 1.00 | 1.00x |  |" in text
    assert "| jax | deep | 2 | 100mbit | bf16 | kept / kept | 0.600 |" in text
    assert "| jax | deep | 4x2 | 100mbit | bf16 | kept / fell back | 0.900 | 0.100 | 0.800 | 0.250 | 3.20 | 1.00x |  |" in text
    for plot in ("hosts.png", "scaling.png"):
        assert os.path.getsize(str(tmp_path / "out" / plot)) > 1000
