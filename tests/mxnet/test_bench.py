"""The benchmark harness on keras-mxnet (Keras 2): a tiny run end to end, the shape of what it writes (never
its timings), where variants c and d place their replicas, and merging its results with another run's."""

import json
import os
import subprocess
import sys

import pytest

from tests.mxnet.harness import ROOT, keras  # noqa: F401 (skips without keras-mxnet)

from benchmarks import variants, workloads
from benchmarks.backends import mxnet as plan


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND="mxnet", PYTHONPATH=os.path.join(ROOT, "src"))
    return env


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "benchmarks", "run", "--backends", "mxnet", "--devices", "1,2", "--workloads",
               "digits", "--steps", "2", "--windows", "5", "--warmup", "0", "--platform", "cpu", "--out", str(folder)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with open(os.path.join(str(folder), "results.json")) as handle:
        return folder, json.load(handle)


def test_every_variant_and_figure_is_there(out):
    _, results = out
    assert results["machine"]["versions"]["keras-mxnet"] == "2.2.4.3" and not results["skipped"]
    runs = {run["devices"]: run for run in results["runs"]}
    assert sorted(runs) == [1, 2] and not any(run.get("error") for run in runs.values())
    assert list(runs[1]["variants"]) == ["plain"]
    two = runs[2]
    assert set(two["variants"]) == set(variants.KEYS) and not two["not_run"]
    for figures in two["variants"].values():
        assert len(figures["samples_per_s"]["values"]) == 5 and len(figures["window_wall_s"]) == 5
    assert {"distkeras/native", "distkeras/make_parallel"} == set(two["ratios"])
    assert two["device_info"]["names"] == ["cpu(0)", "cpu(1)"]
    comm = two["communication"]
    assert comm["copy_bandwidth_bytes_per_s"] > 0 and len(comm["allreduce_s"]["values"]) == 5
    setup = {(entry["variant"], entry["devices"]): entry for entry in results["setup"]}
    assert set(setup) == {("plain", 1), ("distkeras", 2), ("native", 2), ("make_parallel", 2)}
    assert not any(entry.get("error") or entry.get("not_run") for entry in setup.values())


def test_report_merges_several_results_files(out, tmp_path):
    folder, results = out
    other = dict(results, runs=[dict(run, backend="other") for run in results["runs"]], command="the other run")
    with open(str(tmp_path / "other.json"), "w") as handle:
        json.dump(other, handle)
    merged = tmp_path / "merged"
    command = [sys.executable, "-m", "benchmarks", "report", os.path.join(str(folder), "results.json"),
               str(tmp_path / "other.json"), "--out", str(merged)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    text = (merged / "results.md").read_text()
    assert text.count("Machine: ") == 2 and "Command: `the other run`" in text
    for backend in ("mxnet", "other"):
        assert any(line.startswith("| {} | digits | 2 | ".format(backend)) for line in text.splitlines())
    assert (merged / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    # Without --out the merged files would overwrite one of the inputs' folders.
    refused = subprocess.run(command[:-2], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             universal_newlines=True, timeout=300)
    assert refused.returncode == 2 and "needs --out" in refused.stdout


def test_native_trains_on_every_context_and_make_parallel_on_the_first():
    import mxnet as mx

    workload = workloads.get("digits")
    native = variants.setup("native", workload, 2, plan)
    assert native.model._context == [mx.cpu(0), mx.cpu(1)] and native.global_batch == 64
    parallel = variants.setup("make_parallel", workload, 2, plan)
    assert parallel.model._context == [mx.cpu(0)] and parallel.global_batch == 64
    # One replica of the template per slice, concatenated: the template's weights, once.
    assert len(parallel.model.trainable_weights) == len(native.model.trainable_weights)
    assert parallel.model.output_shape == (None, 10)
