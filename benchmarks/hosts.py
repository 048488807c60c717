"""Across hosts: step time over a bandwidth-limited link, against the ring all-reduce bound, with and without
gradient compression.

    python -m benchmarks hosts measure --backends torch,tensorflow --hosts 2 --rate 100mbit --width 0.2 \\
        --compression none,bf16 --out benchmarks/results-hosts

For each backend it makes ``--hosts`` network-namespace hosts (tests/netns.py; root and iproute2), starts one
``distkeras launch`` per host (one process each), and runs :func:`job` there: the workload's model is built
once per compression setting from the same weights, each copy distributed with its ``compression``, and
their timed windows (one ``fit()`` of ``--steps`` steps, timed from the end of its first step) are
interleaved (A B A B ...), so every setting meets the same machine noise. The job runs twice: over links
shaped to ``--rate`` (``tc ... tbf`` on every host's link, both ways) and over unshaped links; the difference of the medians is the step's communication time. The
ring all-reduce bound is ``2 (N-1)/N * bytes / rate`` with the gradient bytes of the wire dtype.

Then the digits model (the demo's) is trained for ``--loss-epochs`` epochs at each setting, unshaped, and
its final training loss is reported: what compression does to the result.

Writes ``results.json`` (every window, the machine, the command) and ``results.md`` (the table).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29500
_WIRE_BYTES = {"none": 4, "bf16": 2, "fp16": 2}


def add_arguments(parser):
    parser.add_argument("--backends", default=None, help="comma-separated (default: KERAS_BACKEND)")
    parser.add_argument("--hosts", type=int, default=2, help="namespace hosts, one worker each (default 2)")
    parser.add_argument("--rate", default="100mbit", help="each host's link rate, tc syntax (default 100mbit)")
    parser.add_argument("--workload", default="mlp", help="benchmarks workload (default mlp)")
    parser.add_argument("--width", type=float, default=0.2, help="MLP width scale (default 0.2: 1.6 M parameters)")
    parser.add_argument("--batch", type=int, default=64, help="samples per worker per step (default 64)")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps per window, one fit() call; the first is not timed (default 5)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per setting (default 5)")
    parser.add_argument("--compression", default="none,bf16",
                        help="settings, of none, bf16, fp16, each optionally +overlap or +no-overlap (PyTorch) (default none,bf16)")
    parser.add_argument("--loss-epochs", type=int, default=10, help="digits epochs for the loss check (0: skip)")
    parser.add_argument("--out", default="bench-hosts", help="folder for results.json and results.md")


def _rate_bits(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError("Expected a rate like 100mbit. Received: {!r}".format(rate))


def _setting(name):
    """distribute()'s options for a setting: ``none``, ``bf16`` or ``fp16`` (compression), then any of ``+overlap``
    or ``+no-overlap`` (PyTorch: its all-reduce during or after the backward pass) and ``+shard-optimizer``,
    ``+shard-gradients`` or ``+shard-all`` (sharded training state, ``shard=``)."""
    compression, *extras = name.split("+")
    options = {"compression": None if compression == "none" else compression}
    for extra in extras:
        if extra in ("overlap", "no-overlap"):
            options["overlap"] = extra == "overlap"
        elif extra.startswith("shard-"):
            options["shard"] = extra[len("shard-"):]
        else:
            raise SystemExit("unknown setting {!r}: expected none, bf16 or fp16, optionally +overlap or +no-overlap "
                             "and +shard-optimizer, +shard-gradients or +shard-all".format(name))
    return options


def job(args):
    """One worker: time the settings' windows interleaved; rank 0 prints one JSON line."""
    import distkeras  # first: the engine starts at import

    import keras
    import numpy as np

    from benchmarks import workloads

    rank = distkeras.cluster.from_env().rank
    settings = args.compression.split(",")
    if args.workload == "digits":
        from distkeras import demo

        (x, y), _ = demo.load_digits()
        results = {}
        for name in settings:
            keras.utils.set_random_seed(0)
            model = distkeras.distribute(demo.build_model(keras), **_setting(name))
            history = model.fit(x, y, batch_size=32 * args.hosts, epochs=args.loss_epochs, shuffle=False, verbose=0)
            results[name] = {"final_loss": float(history.history["loss"][-1])}
        if rank == 0:
            print("RESULT " + json.dumps(results), flush=True)
        return
    workload = workloads.get(args.workload, args.width)
    keras.utils.set_random_seed(0)
    first = workload.build(keras)
    models, not_built = {}, {}
    for name in settings:
        model = workload.build(keras)
        model.set_weights(first.get_weights())
        try:
            models[name] = distkeras.distribute(model, **_setting(name))
        except distkeras.errors.OptionError as exc:
            if "not built yet" not in str(exc):
                raise
            not_built[name] = str(exc)  # an option that exists, its implementation not yet: the others go on
    settings = [name for name in settings if name in models]
    global_batch = args.batch * args.hosts
    batches = workload.batches(np.random.default_rng(0), global_batch * args.steps, 1)[0]
    seconds = {name: [] for name in settings}
    clock = _step_clock(keras)
    for window in range(args.windows + 1):  # window 0 warms up (tracing, compilation)
        for name in settings[window % len(settings):] + settings[: window % len(settings)]:
            models[name].fit(batches[0], batches[1], batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                             callbacks=[clock])
            if window:
                seconds[name].append(clock.seconds_per_step())
    if rank == 0:
        params = sum(int(np.prod(w.shape)) for w in first.weights if w.trainable)
        print("RESULT " + json.dumps({"seconds_per_step": seconds, "parameters": params, "not_built": not_built}),
              flush=True)


def _step_clock(keras):
    """A callback that times the steps of one ``fit()`` from the end of its first step to the end of its last:
    the steady state, without what ``fit()`` itself costs to start (iterators, a distributed dataset), which a
    user pays once per call, not per step (TensorFlow's is seconds across hosts, and larger with compression)."""

    class StepClock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def seconds_per_step(self):
            return (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1)

    return StepClock()


def _job_environment(backend):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=backend)
    return env


def _job_arguments(args):
    return ["-m", "benchmarks.hosts", "job", "--workload", args.workload, "--width", str(args.width), "--batch",
            str(args.batch), "--steps", str(args.steps), "--windows", str(args.windows), "--compression",
            args.compression, "--hosts", str(args.hosts), "--loss-epochs", str(args.loss_epochs)]


def _job_result(backend, processes, outputs):
    """Rank 0's RESULT line of a job whose ``processes`` gave ``outputs`` ((stdout, stderr) each)."""
    for p, (_, err) in zip(processes, outputs):
        if p.returncode != 0:
            raise RuntimeError("{} job failed ({}):\n{}".format(backend, p.returncode, err[-3000:]))
    line = [text for text in outputs[0][0].splitlines() if "RESULT " in text][0]
    return json.loads(line.split("RESULT ", 1)[1])


def run_hosts(backend, args, rate):
    """:func:`job` on ``args.hosts`` network-namespace hosts, one process each, links shaped to ``rate`` (None:
    unshaped); rank 0's result."""
    from tests import netns

    with netns.Hosts(args.hosts) as hosts:
        if rate:
            for host in range(args.hosts):
                hosts.limit(host, rate)
        launchers = []
        for host in range(args.hosts):
            command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "1", "--nnodes",
                       str(args.hosts), "--node-rank", str(host), "--coordinator",
                       "{}:{}".format(hosts.addresses[0], PORT), "--backend", backend] + _job_arguments(args)
            launchers.append(hosts.popen(host, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         cwd=ROOT, env=_job_environment(backend)))
        outputs = [p.communicate(timeout=3600) for p in launchers]
        return _job_result(backend, launchers, outputs)


def run_one_host(backend, args):
    """:func:`job` with ``args.hosts`` replicas on this host, over loopback: PyTorch as that many processes
    (``distkeras launch --nproc-per-node``), JAX and TensorFlow as that many CPU devices of one process."""
    env = _job_environment(backend)
    if backend == "torch":
        command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", str(args.hosts), "--backend",
                   backend] + _job_arguments(args)
    else:
        env["DISTKERAS_CPU_DEVICES"] = str(args.hosts)
        command = [sys.executable] + _job_arguments(args)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        outputs = [process.communicate(timeout=3600)]
    finally:
        if process.poll() is None:
            process.kill()
    return _job_result(backend, [process], outputs)


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def measure(args):
    from benchmarks import machine

    if args.steps < 2:
        raise SystemExit("--steps must be 2 or more: a window is timed from the end of its first step")
    backends = (args.backends or os.environ.get("KERAS_BACKEND", "tensorflow")).split(",")
    report = {"command": args.command_line, "machine": machine.describe(ROOT),
              "rate": args.rate, "hosts": args.hosts, "runs": {}}
    bits = _rate_bits(args.rate)
    for backend in backends:
        shaped = run_hosts(backend, args, args.rate)
        free = run_hosts(backend, args, None)
        entry = {"shaped": shaped, "unshaped": free, "settings": {}}
        n = args.hosts
        for name in args.compression.split(","):
            step = _median(shaped["seconds_per_step"][name])
            compute = _median(free["seconds_per_step"][name])
            wire = shaped["parameters"] * _WIRE_BYTES[name.partition("+")[0]]
            bound = 2.0 * (n - 1) / n * wire * 8 / bits
            entry["settings"][name] = {"step_s": step, "unshaped_step_s": compute, "communication_s": step - compute,
                                       "ring_bound_s": bound, "communication_over_bound": (step - compute) / bound}
        base = entry["settings"].get("none")
        for setting in entry["settings"].values():
            if base:
                setting["speedup_over_none"] = base["step_s"] / setting["step_s"]
        if args.loss_epochs:
            digits = argparse.Namespace(**dict(vars(args), workload="digits"))
            entry["digits_loss"] = run_hosts(backend, digits, None)
        report["runs"][backend] = entry
        print(json.dumps({backend: entry["settings"], "digits": entry.get("digits_loss")}, indent=1), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table(report))
    print(table(report))
    return 0


def table(report):
    lines = ["{} hosts, each link {} (tc tbf); `{}`".format(report["hosts"], report["rate"], report["command"]), "",
             "| backend | compression | step (s) | unshaped step (s) | communication (s) | ring bound (s) | "
             "communication / bound | speed-up over none | digits loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for backend, entry in report["runs"].items():
        for name, s in entry["settings"].items():
            loss = (entry.get("digits_loss") or {}).get(name, {}).get("final_loss")
            lines.append("| {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {} | {} |".format(
                backend, name, s["step_s"], s["unshaped_step_s"], s["communication_s"], s["ring_bound_s"],
                s["communication_over_bound"], "{:.2f}x".format(s["speedup_over_none"]) if "speedup_over_none" in s
                else "", "{:.4f}".format(loss) if loss is not None else ""))
    return "\n".join(lines) + "\n"


def summary(paths, out):
    """One table (every run of every results file: backend, hosts, setting) and one plot, ``hosts.png``: per
    backend and host count, the step time of each setting split into compute (unshaped) and communication,
    with the ring bound of each setting marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = []
    for path in paths:
        with open(path) as handle:
            reports.append(json.load(handle))
    rows = []
    for report in reports:
        for backend, entry in report["runs"].items():
            for name, s in entry["settings"].items():
                loss = (entry.get("digits_loss") or {}).get(name, {}).get("final_loss")
                rows.append((backend, report["hosts"], report["rate"], name, s, loss, report["command"]))
    lines = ["| backend | hosts | link | setting | step (s) | compute (s) | communication (s) | ring bound (s) | "
             "communication / bound | speed-up over none | digits loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for backend, hosts, rate, name, s, loss, _ in rows:
        lines.append("| {} | {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {} | {} |".format(
            backend, hosts, rate, name, s["step_s"], s["unshaped_step_s"], s["communication_s"], s["ring_bound_s"],
            s["communication_over_bound"], "{:.2f}x".format(s["speedup_over_none"]) if "speedup_over_none" in s
            else "", "{:.4f}".format(loss) if loss is not None else ""))
    lines += ["", "Commands:", ""] + sorted({"    " + command for *_, command in rows})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    figure, axis = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    labels = ["{}\n{} hosts\n{}".format(backend, hosts, name.replace("+", "\n+")) for backend, hosts, _, name, *_ in rows]
    compute = [r[4]["unshaped_step_s"] for r in rows]
    communication = [r[4]["step_s"] - r[4]["unshaped_step_s"] for r in rows]
    positions = range(len(rows))
    axis.bar(positions, compute, color="#9bb8d3", label="compute (unshaped step)")
    axis.bar(positions, communication, bottom=compute, color="#e07b39", label="communication (shaped - unshaped)")
    axis.scatter(positions, [c + r[4]["ring_bound_s"] for c, r in zip(compute, rows)], marker="_", s=400, color="k",
                 label="compute + ring all-reduce bound", zorder=3)
    axis.set_xticks(list(positions))
    axis.set_xticklabels(labels, fontsize=7)
    axis.set_ylabel("seconds per step (median)")
    axis.set_title("Step time across namespace hosts, links shaped to {}".format(
        ", ".join(sorted({r[2] for r in rows}))))
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(out, "hosts.png"), dpi=120)
    print("\n".join(lines))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["summary"]:
        parser = argparse.ArgumentParser(prog="python -m benchmarks hosts summary")
        parser.add_argument("results", nargs="+", help="results.json files written by `measure`")
        parser.add_argument("--out", required=True, help="folder for results.md and hosts.png")
        args = parser.parse_args(argv[1:])
        return summary(args.results, args.out)
    parser = argparse.ArgumentParser(prog="python -m benchmarks hosts")
    parser.add_argument("mode", choices=("measure", "job"))
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m benchmarks hosts"] + [shlex.quote(a) for a in argv])
    return job(args) if args.mode == "job" else measure(args)


if __name__ == "__main__":
    sys.exit(main())
