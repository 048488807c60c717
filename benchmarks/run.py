"""``python -m benchmarks run``: start one worker process per backend, workload, device count and mode,
then write the results (JSON), a table (markdown) and a plot (PNG).

Keras fixes its backend when it is imported, and TensorFlow and JAX fix their device count when they
start, so every (backend, device count) pair is a process of its own. For each pair:

- one ``throughput`` worker: every variant set up in one process, their timed windows alternated;
- one ``setup`` worker per variant: time to the first step and peak memory, each in a fresh process.
"""

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

from . import backends, machine, report, variants, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_LINE = re.compile(r"^(?:\[rank 0\] )?bench: (.*)")
FRAMEWORKS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def add_arguments(parser):
    parser.add_argument("--backends", default=None,
                        help="comma-separated Keras backends (default: the active one, from KERAS_BACKEND)")
    parser.add_argument("--devices", default="1,2", help="comma-separated device counts (default 1,2)")
    parser.add_argument("--workloads", default="mlp", help="comma-separated, of: " + ", ".join(workloads.NAMES))
    parser.add_argument("--width", type=float, default=1.0, help="MLP width scale (0.1 = 800-400-200-50-30-1)")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per device per step (default: the workload's: mlp 2048, cnn, digits, bncnn 32)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window (>= 2; default 20)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (>= 5; default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed windows first (default 1)")
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                        help="cpu: virtual CPU devices (DISTKERAS_CPU_DEVICES=N); gpu: the GPUs; auto: gpu when "
                             "nvidia-smi lists one")
    parser.add_argument("--split-gpu", type=int, default=None, metavar="MB",
                        help="TensorFlow only: split GPU 0 into N logical GPUs of MB MiB each")
    parser.add_argument("--distribute-options", default=None, metavar="JSON",
                        help='keyword arguments for distkeras.distribute in b, e.g. \'{"exact_loss_scaling": false}\'')
    parser.add_argument("--alt-distribute-options", default=None, metavar="JSON",
                        help="adds variant b2: b with these keyword arguments added to (or replacing) "
                             "--distribute-options, its windows interleaved with the others', e.g. "
                             '\'{"sync_batchnorm": false}\'')
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one worker may take (default 3600)")
    parser.add_argument("--out", default="bench-results", help="folder for results.json, results.md, throughput.png")


def _csv(value):
    return [item.strip() for item in value.split(",") if item.strip()]


def check(args):
    """Reject settings the figures can't be honest with. Returns an error message or None."""
    if args.windows < 5:
        return "--windows must be >= 5: medians and spreads from fewer windows say little"
    if args.steps < 2:
        return "--steps must be >= 2: a window is timed from the end of its first step to the end of its last"
    counts = _csv(args.devices)
    if not counts or not all(c.isdigit() and int(c) >= 1 for c in counts):
        return "--devices must be comma-separated positive ints, e.g. 1,2,4. Received: {!r}".format(args.devices)
    for flag, value in (("--distribute-options", args.distribute_options),
                        ("--alt-distribute-options", args.alt_distribute_options)):
        if value is None:
            continue
        try:
            if not isinstance(json.loads(value), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return "{} must be a JSON object ({}). Received: {!r}".format(flag, exc, value)
    unknown = [w for w in _csv(args.workloads) if w not in workloads.NAMES]
    if unknown:
        return "unknown workload(s) {}; expected some of {}".format(", ".join(unknown), ", ".join(workloads.NAMES))
    return None


def _environment(backend, devices, platform):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env["KERAS_BACKEND"] = backend
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT] + _csv(env.get("PYTHONPATH", "")))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if platform == "cpu":
        env.update(DISTKERAS_CPU_DEVICES=str(devices), CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    return env


def _run_worker(label, worker_args, env, timeout, backend, devices, variant=None):
    """Run one worker; return (its JSON result, or None, and the tail of its output on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = backends.worker_command(sys.executable, backend, devices, variant) + [*worker_args, "--out", out]
        started = time.time()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        timer = threading.Timer(timeout, process.kill)
        timer.start()
        lines = []
        for line in process.stdout:
            lines.append(line.rstrip())
            said = BENCH_LINE.match(line)  # a worker's own line, or rank 0's under distkeras launch
            if said:
                print("  [{}] {}".format(label, said.group(1).rstrip()), file=sys.stderr, flush=True)
        code = process.wait()
        timer.cancel()
        if code == 0 and os.path.exists(out):
            with open(out) as handle:
                return json.load(handle), None
        reason = "killed after {:.0f}s (--timeout)".format(time.time() - started) if code < 0 else "exit {}".format(code)
        print("  [{}] failed ({}); its output ends:\n{}".format(label, reason, "\n".join(lines[-15:])), file=sys.stderr)
        return None, "{}:\n{}".format(reason, "\n".join(lines[-25:]))


def _platform(args):
    if args.platform != "auto":
        return args.platform
    return "gpu" if machine.describe(ROOT)["gpus"] else "cpu"


def main(args):
    problem = check(args)
    if problem:
        print("benchmarks: error: " + problem, file=sys.stderr)
        return 2
    from distkeras import backends as distkeras_backends

    chosen = _csv(args.backends) if args.backends else [distkeras_backends.active_name()]
    counts = sorted({int(c) for c in _csv(args.devices)})
    platform = _platform(args)
    results = {
        "schema": 1,
        "command": args.command_line,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(machine.describe(ROOT), load_average={"before": machine.load_average()}),
        "settings": {"backends": chosen, "devices": counts, "workloads": _csv(args.workloads), "width": args.width,
                     "batch": args.batch, "steps": args.steps, "windows": args.windows, "warmup": args.warmup,
                     "platform": platform, "split_gpu_mb": args.split_gpu,
                     "distribute_options": json.loads(args.distribute_options or "{}"),
                     "alt_distribute_options": json.loads(args.alt_distribute_options)
                     if args.alt_distribute_options is not None else None},
        "runs": [], "setup": [], "skipped": [],
    }
    started = time.time()
    for backend in chosen:
        if not backends.covered(backend):
            results["skipped"].append({"backend": backend, "reason": backends.uncovered_reason(backend)})
            continue
        if not distkeras_backends.is_installed(FRAMEWORKS.get(backend, backend)):
            results["skipped"].append({"backend": backend, "reason": "{} is not installed".format(backend)})
            continue
        for name in _csv(args.workloads):
            _measure(results, backend, name, counts, platform, args)
    results["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results["seconds"] = time.time() - started
    results["machine"]["load_average"]["after"] = machine.load_average()
    report.add_scaling_against_one_device(results)
    paths = report.write(results, args.out)
    for problem in results["skipped"]:
        print("benchmarks: skipped {}: {}".format(problem["backend"], problem["reason"]), file=sys.stderr)
    print("\n".join(["wrote " + p for p in paths]))
    failed = [r for r in results["runs"] + results["setup"] if r.get("error")]
    return 1 if failed or not results["runs"] else 0


def _measure(results, backend, name, counts, platform, args):
    common = ["--workload", name, "--width", str(args.width), "--steps", str(args.steps)]
    common += ["--batch", str(args.batch)] if args.batch else []
    common += ["--split-gpu-mb", str(args.split_gpu)] if args.split_gpu else []
    common += ["--distribute-options", args.distribute_options] if args.distribute_options else []
    alternative = args.alt_distribute_options is not None
    common += ["--alt-distribute-options", args.alt_distribute_options] if alternative else []
    for devices in counts:
        label = "{} {} N={}".format(backend, name, devices)
        print("benchmarks: {}: throughput".format(label), file=sys.stderr, flush=True)
        worker = common + ["--mode", "throughput", "--devices", str(devices), "--windows", str(args.windows),
                           "--warmup", str(args.warmup)]
        result, error = _run_worker(label, worker, _environment(backend, devices, platform), args.timeout, backend,
                                    devices)
        results["runs"].append(result or {"backend": backend, "workload": name, "devices": devices, "error": error})
        # Set-up figures, each variant in a fresh process: a once (on one device), b, c, d per N > 1.
        keys = ["plain"] if devices == counts[0] else []
        keys += [k for k in variants.KEYS if k != "plain"] if devices > 1 else []
        if devices > 1 and alternative:
            keys.insert(keys.index("distkeras") + 1, variants.ALTERNATIVE)
        for key in keys:
            count = 1 if key == "plain" else devices
            worker = common + ["--mode", "setup", "--variant", key, "--devices", str(count)]
            result, error = _run_worker("{} {}".format(label, key), worker, _environment(backend, count, platform),
                                        args.timeout, backend, count, key)
            results["setup"].append(dict(result or {"variant": key, "error": error}, backend=backend, workload=name,
                                         devices=count))
