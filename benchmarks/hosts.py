"""Across hosts: step time over a bandwidth-limited link, against the ring all-reduce bound, with and without
gradient compression.

    python -m benchmarks hosts measure --backends torch,tensorflow --hosts 2 --rate 100mbit --width 0.2 \\
        --compression none,bf16 --out benchmarks/results-hosts

For each backend it makes ``--hosts`` network-namespace hosts (tests/netns.py; root and iproute2), starts one
``distkeras launch`` per host (one process each), and runs :func:`job` there: the workload's model is built
once per compression setting from the same weights, each copy distributed with its ``compression``, and
their timed windows (one ``fit()`` of ``--steps`` steps, timed from the end of its first step) are
interleaved (A B A B ...), so every setting meets the same machine noise (the first window, not timed, runs at least
:data:`WARM_UP_STEPS` steps: JAX compression's trial ends there). The job runs twice: over links shaped to ``--rate``
(``tc ... tbf`` on every host's link, both ways) and over unshaped links; the difference of the medians is the step's
communication time. The ring all-reduce bound is ``2 (H-1)/H * bytes / rate`` for H hosts, with the gradient bytes of
the wire dtype: what each host's link must carry at least. With ``--workers-per-host`` W > 1 that is the bound of a
hierarchical all-reduce (sum within the host first); a flat ring over all H*W workers carries ``2 (HW-1)/HW * bytes``
over each host's link (``flat_ring_bound_s``).

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
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29500
_WIRE_BYTES = {"none": 4, "bf16": 2, "fp16": 2}
#: Steps the warm-up window runs at least: JAX compression's trial (12 steps) ends there, before the timed windows.
WARM_UP_STEPS = 12


def add_arguments(parser):
    parser.add_argument("--backends", default=None, help="comma-separated (default: KERAS_BACKEND)")
    parser.add_argument("--hosts", type=int, default=2, help="namespace hosts (default 2)")
    parser.add_argument("--workers-per-host", type=int, default=1,
                        help="worker processes per host, one device each (default 1)")
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
    or ``+no-overlap`` (PyTorch: its all-reduce during or after the backward pass), ``+always`` (JAX:
    ``compression_fallback=False``, the 16-bit step without its trial) and ``+shard-optimizer``,
    ``+shard-gradients`` or ``+shard-all`` (sharded training state, ``shard=``)."""
    compression, *extras = name.split("+")
    options = {"compression": None if compression == "none" else compression}
    for extra in extras:
        if extra in ("overlap", "no-overlap"):
            options["overlap"] = extra == "overlap"
        elif extra == "always":
            options["compression_fallback"] = False
        elif extra.startswith("shard-"):
            options["shard"] = extra[len("shard-"):]
        else:
            raise SystemExit("unknown setting {!r}: expected none, bf16 or fp16, optionally +overlap or +no-overlap, "
                             "+always (JAX: no trial against the uncompressed step) and +shard-optimizer, "
                             "+shard-gradients or +shard-all".format(name))
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
    global_batch = args.batch * args.hosts  # job's --hosts: every worker of the job
    batches = workload.batches(np.random.default_rng(0), global_batch * args.steps, 1)[0]
    seconds = {name: [] for name in settings}
    fell_back = {}
    clock = _step_clock(keras)
    for window in range(args.windows + 1):  # window 0 warms up (tracing, compilation, JAX compression's trial)
        for name in settings[window % len(settings):] + settings[: window % len(settings)]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                models[name].fit(batches[0], batches[1], batch_size=global_batch,
                                 epochs=1 if window else -(-WARM_UP_STEPS // args.steps), shuffle=False, verbose=0,
                                 callbacks=[clock])
            said = [str(w.message) for w in caught if "made this model's training step slower" in str(w.message)]
            if said:
                fell_back[name] = said[0]
            if window:
                seconds[name].append(clock.seconds_per_step())
    if rank == 0:
        params = sum(int(np.prod(w.shape)) for w in first.weights if w.trainable)
        print("RESULT " + json.dumps({"seconds_per_step": seconds, "parameters": params, "not_built": not_built,
                                      "fell_back": fell_back}), flush=True)


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
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]), KERAS_BACKEND=backend)
    return env


def _job_arguments(args):
    return ["-m", "benchmarks.hosts", "job", "--workload", args.workload, "--width", str(args.width), "--batch",
            str(args.batch), "--steps", str(args.steps), "--windows", str(args.windows), "--compression",
            args.compression, "--hosts", str(args.hosts * getattr(args, "workers_per_host", 1)), "--loss-epochs",
            str(args.loss_epochs)]


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
            command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", str(args.workers_per_host), "--nnodes",
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
              "rate": args.rate, "hosts": args.hosts, "workers_per_host": args.workers_per_host, "runs": {}}
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
            workers = n * args.workers_per_host
            entry["settings"][name] = {"step_s": step, "unshaped_step_s": compute, "communication_s": step - compute,
                                       "ring_bound_s": bound, "communication_over_bound": (step - compute) / bound,
                                       "flat_ring_bound_s": 2.0 * (workers - 1) / workers * wire * 8 / bits}
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


def _hosts_label(report):
    workers = report.get("workers_per_host", 1)
    return str(report["hosts"]) if workers == 1 else "{}x{}".format(report["hosts"], workers)


def _trial(backend, name, entry):
    """What JAX compression's trial kept over shaped and unshaped links ("" where no trial ran)."""
    if backend != "jax" or name.partition("+")[0] == "none" or "+always" in name:
        return ""
    return " / ".join("fell back" if name in entry.get(run, {}).get("fell_back", {}) else "kept"
                      for run in ("shaped", "unshaped"))


def _workload(report):
    """The workload a results file measured, from its command (older files: the MLP)."""
    words = report["command"].split()
    return words[words.index("--workload") + 1] if "--workload" in words else "mlp"


def summary(paths, out):
    """One table (every run of every results file: backend, workload, hosts, setting) and two plots:
    ``hosts.png``, per run the step time of each setting split into compute (unshaped) and communication, with
    the ring bound marked; ``scaling.png``, communication over the ring bound against the workers N, a line per
    backend and setting (hosts x workers marked apart)."""
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
                s = dict(s, trial=_trial(backend, name, entry))
                rows.append((backend, _hosts_label(report), report["rate"], name, s, loss, report["command"],
                             _workload(report), report["hosts"] * report.get("workers_per_host", 1)))
    lines = ["| backend | workload | hosts | link | setting | trial (shaped / unshaped) | step (s) | compute (s) | "
             "communication (s) | ring bound (s) | communication / bound | speed-up over none | digits loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for backend, hosts, rate, name, s, loss, _, workload, _ in rows:
        lines.append("| {} | {} | {} | {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {} | {} |".format(
            backend, workload, hosts, rate, name, s["trial"], s["step_s"],
            s["unshaped_step_s"], s["communication_s"], s["ring_bound_s"], s["communication_over_bound"],
            "{:.2f}x".format(s["speedup_over_none"]) if "speedup_over_none" in s else "",
            "{:.4f}".format(loss) if loss is not None else ""))
    lines += ["", "Commands:", ""] + sorted({"    " + row[6] for row in rows})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    figure, axis = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    labels = ["{}\n{}\n{} hosts\n{}".format(backend, workload, hosts, name.replace("+", "\n+"))
              for backend, hosts, _, name, _, _, _, workload, _ in rows]
    compute = [r[4]["unshaped_step_s"] for r in rows]
    communication = [r[4]["step_s"] - r[4]["unshaped_step_s"] for r in rows]
    positions = range(len(rows))
    axis.bar(positions, compute, color="#9bb8d3", label="compute (unshaped step)")
    axis.bar(positions, communication, bottom=compute, color="#e07b39", label="communication (shaped - unshaped)")
    axis.scatter(positions, [c + r[4]["ring_bound_s"] for c, r in zip(compute, rows)], marker="_", s=400, color="k",
                 label="compute + ring all-reduce bound", zorder=3)
    axis.set_xticks(list(positions))
    axis.set_xticklabels(labels, fontsize=6)
    axis.set_ylabel("seconds per step (median)")
    axis.set_title("Step time across namespace hosts, links shaped to {}".format(
        ", ".join(sorted({r[2] for r in rows}))))
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(out, "hosts.png"), dpi=120)
    plt.close(figure)
    _scaling_plot(rows, os.path.join(out, "scaling.png"), plt)
    print("\n".join(lines))
    return 0


def _scaling_plot(rows, path, plt):
    """Communication / ring bound against the workers N, and the step time against N: a line per backend,
    workload and setting over the one-worker-per-host runs; hosts x workers runs as separate markers."""
    figure, (ratio_axis, step_axis) = plt.subplots(1, 2, figsize=(10, 4))
    lines = {}
    for backend, hosts, _, name, s, _, _, workload, workers in rows:
        lines.setdefault((backend, workload, name, "x" in hosts), []).append((workers, s))
    colors = {"jax": "tab:blue", "tensorflow": "tab:orange", "torch": "tab:green"}
    dashes = {"none": "-", "bf16": "--", "fp16": "--"}
    for (backend, workload, name, stacked), points in sorted(lines.items()):
        points.sort(key=lambda point: point[0])
        label = "{} {} {}{}".format(backend, workload, name, " (hosts x workers)" if stacked else "")
        style = dict(marker="s" if stacked else "o", color=colors.get(backend), label=label, markersize=5,
                     linestyle="none" if stacked else dashes.get(name, ":"),
                     fillstyle="full" if name == "none" else "none")
        ratio_axis.plot([n for n, _ in points], [s["communication_over_bound"] for _, s in points], **style)
        step_axis.plot([n for n, _ in points], [s["step_s"] for _, s in points], **style)
    ratio_axis.axhline(1.10, color="k", linestyle=":", label="target 1.10")
    ratio_axis.set_xlabel("workers N")
    ratio_axis.set_ylabel("communication / ring bound")
    step_axis.set_xlabel("workers N")
    step_axis.set_ylabel("seconds per step (median, shaped links)")
    handles, labels = ratio_axis.get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


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
