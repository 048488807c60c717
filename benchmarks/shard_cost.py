"""``python -m benchmarks shard-cost``: the step time of each ``shard=`` mode against unsharded training.

    python -m benchmarks shard-cost --backends torch,jax --replicas 2 --rate 100mbit --width 0.2 --batch 64 \\
        --out benchmarks/results-shard/cost
    python -m benchmarks shard-cost report benchmarks/results-shard/cost/results.json   # table and plot again

For each backend the same job, :func:`benchmarks.hosts.job`, runs twice: on this host (``--replicas`` processes
over loopback on PyTorch, that many CPU devices of one process on JAX) and across ``--replicas``
network-namespace hosts whose links are shaped to ``--rate`` (tests/netns.py; root and iproute2). In each, the
workload's model is built once per mode from the same weights and distributed with ``shard=`` that mode; the
modes' timed windows (one ``fit()`` of ``--steps`` steps each, timed from the end of its first step) alternate,
the order rotating every round, so every mode meets the same machine noise. Reported per mode: the median
seconds per step, the ratio of its median to unsharded's, and the median and range of the per-round ratios.

The bar (issue 24): ``optimizer`` and ``gradients`` within 1.10x of unsharded across hosts (ZeRO 1 and 2 move
the same bytes as an all-reduce: a reduce-scatter and an all-gather). ``all`` gathers the weights again in the
backward pass, 1.5x the bytes, and has no bar.

Writes ``results.json`` (every window, the machine, the command), ``results.md`` and ``cost.png``.
"""

import argparse
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "optimizer", "gradients", "all")
#: The modes held to the 1.10x bar across hosts.
BAR = {"optimizer": 1.10, "gradients": 1.10}
PLACES = ("one host", "across hosts")


def setting(mode):
    """The :mod:`benchmarks.hosts` setting name of a mode."""
    return "none" if mode == "none" else "none+shard-" + mode


def add_arguments(parser):
    parser.add_argument("--backends", default="torch,jax", help="comma-separated (default torch,jax)")
    parser.add_argument("--replicas", type=int, default=2, help="replicas: processes, devices or hosts (default 2)")
    parser.add_argument("--rate", default="100mbit", help="each namespace host's link, tc syntax (default 100mbit)")
    parser.add_argument("--places", default="one host,across hosts",
                        help="where to measure: 'one host', 'across hosts' or both (default both)")
    parser.add_argument("--modes", default=",".join(MODES), help="shard modes; none is shard=None (default all four)")
    parser.add_argument("--workload", default="mlp", help="benchmarks workload (default mlp)")
    parser.add_argument("--width", type=float, default=0.2, help="MLP width scale (default 0.2: 1.6 M parameters)")
    parser.add_argument("--batch", type=int, default=64, help="samples per replica per step (default 64)")
    parser.add_argument("--steps", type=int, default=4, help="steps per window; the first is not timed (default 4)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per mode (default 5)")
    parser.add_argument("--out", default="benchmarks/results-shard/cost", help="folder for the results")


def _job_args(args, modes):
    """The arguments :mod:`benchmarks.hosts`' runners take, for these modes."""
    return argparse.Namespace(workload=args.workload, width=args.width, batch=args.batch, steps=args.steps,
                              windows=args.windows, hosts=args.replicas, loss_epochs=0,
                              compression=",".join(setting(m) for m in modes))


def figures(seconds, modes, not_built):
    """Per mode: median seconds per step, its ratio to unsharded's median, and the per-round ratios; a mode
    the backend hasn't built yet gets its reason."""
    from benchmarks import measure

    base = seconds.get(setting("none"))
    out = {}
    for mode in modes:
        if setting(mode) in not_built:
            out[mode] = {"not_built": not_built[setting(mode)]}
            continue
        values = seconds[setting(mode)]
        entry = {"step_s": measure.summary(values)}
        if base:
            entry["over_none"] = entry["step_s"]["median"] / measure.summary(base)["median"]
            entry["paired_over_none"] = measure.summary([v / b for v, b in zip(values, base)])
        out[mode] = entry
    return out


def measure_all(args):
    from benchmarks import hosts, machine

    if args.steps < 2:
        raise SystemExit("--steps must be 2 or more: a window is timed from the end of its first step")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    places = [p.strip() for p in args.places.split(",") if p.strip()]
    if unknown or not set(places) <= set(PLACES):
        raise SystemExit("expected modes of {} and places of {}. Received: --modes {} --places {}".format(
            MODES, PLACES, args.modes, args.places))
    results = {"command": args.command_line, "machine": machine.describe(ROOT), "rate": args.rate,
               "replicas": args.replicas, "workload": args.workload, "width": args.width, "runs": []}
    job = _job_args(args, modes)
    for backend in [b for b in args.backends.split(",") if b]:
        for place in places:
            entry = {"backend": backend, "place": place}
            try:
                raw = hosts.run_one_host(backend, job) if place == "one host" else hosts.run_hosts(backend, job, args.rate)
                entry.update(parameters=raw["parameters"], seconds_per_step=raw["seconds_per_step"],
                             modes=figures(raw["seconds_per_step"], modes, raw.get("not_built", {})))
            except Exception as exc:  # a mode not built yet, a missing namespace tool: recorded, the others go on
                entry["error"] = "{}: {}".format(type(exc).__name__, str(exc)[-3000:])
            results["runs"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "seconds_per_step"}), flush=True)
    results["machine"]["load_average_after"] = machine.load_average()
    write(results, args.out)
    print(table(results))
    return 0


def table(results):
    lines = ["{} replicas; across hosts: network-namespace hosts, each link {} (tc tbf); workload {} (width {}); `{}`"
             .format(results["replicas"], results["rate"], results["workload"], results["width"], results["command"]),
             "", "Median seconds per step; ratio to unsharded: of the medians, and the per-round ratios' median "
             "[min, max] (the windows alternate, so each round is a paired comparison). Bar: optimizer and "
             "gradients <= 1.10x across hosts.", "",
             "| backend | where | shard | step (s) | / unsharded | per-round | bar | met |", "|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        if "error" in run:
            lines.append("| {} | {} | | error: {} | | | | |".format(run["backend"], run["place"], run["error"].replace(
                "\n", " ").replace("|", "/")[:300]))
            continue
        for mode, entry in run["modes"].items():
            if "not_built" in entry:
                lines.append("| {} | {} | {} | not built yet: {} | | | | |".format(
                    run["backend"], run["place"], mode, entry["not_built"].replace("|", "/")))
                continue
            bar = BAR.get(mode) if run["place"] == "across hosts" else None
            ratio = entry.get("over_none")
            paired = entry.get("paired_over_none")
            lines.append("| {} | {} | {} | {:.4f} | {} | {} | {} | {} |".format(
                run["backend"], run["place"], mode, entry["step_s"]["median"],
                "" if ratio is None else "{:.3f}x".format(ratio),
                "" if paired is None else "{:.3f} [{:.3f}, {:.3f}]".format(paired["median"], paired["min"], paired["max"]),
                "" if bar is None else "<= {:.2f}x".format(bar),
                "" if bar is None or ratio is None else ("yes" if ratio <= bar else "**no**")))
    return "\n".join(lines) + "\n"


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if "modes" in r]
    figure, axis = plt.subplots(figsize=(max(5, 1.6 * len(runs) + 2) + 2, 4))
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        heights = [r["modes"].get(mode, {}).get("over_none", float("nan")) for r in runs]
        axis.bar([i + (index - 1.5) * width for i in range(len(runs))], heights, width, label="shard={}".format(
            None if mode == "none" else mode))
    axis.axhline(1.10, color="k", linestyle=":", label="bar: 1.10x (optimizer, gradients, across hosts)")
    axis.set_xticks(list(range(len(runs))))
    axis.set_xticklabels(["{}\n{}".format(r["backend"], r["place"]) for r in runs])
    axis.set_ylabel("step time / unsharded (medians)")
    axis.set_title("Cost of sharding, {} replicas, hosts linked at {}".format(results["replicas"], results["rate"]))
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(results, out):
    from benchmarks import report

    for path in report.write_files(results, out, table(results), plot, "cost.png"):
        print("wrote " + path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        parser = argparse.ArgumentParser(prog="python -m benchmarks shard-cost report")
        parser.add_argument("results", help="a results.json written by `python -m benchmarks shard-cost`")
        parser.add_argument("--out", default=None, help="folder (default: the results file's)")
        args = parser.parse_args(argv[1:])
        with open(args.results) as handle:
            write(json.load(handle), args.out or os.path.dirname(os.path.abspath(args.results)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks shard-cost", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m benchmarks shard-cost"] + [shlex.quote(a) for a in argv])
    return measure_all(args)


if __name__ == "__main__":
    sys.exit(main())
