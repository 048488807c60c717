"""``python -m benchmarks.startup``: ``distribute()`` start-up time and peak memory of two source trees,
measured alternately, each run in a fresh process.

    git worktree add /tmp/dk-old 15e6e5e
    python -m benchmarks.startup --trees /tmp/dk-old . --backends tensorflow,jax --workload mlp --width 0.2

Made to compare two designs of ``distribute()`` (rebuilding the model against distributing it in place)
under the same conditions: the runs go old, new, new, old, old, new, ... (each pair in turn, the order
flipped every repeat), so a machine that slows down during the call slows both alike, and each pair gives a
ratio. One run is one process with ``PYTHONPATH=<tree>/src`` (its ``distkeras``; the workload comes from
this checkout's ``benchmarks``), on ``--devices`` virtual CPU devices (or the GPUs, ``--platform gpu``). It
builds and compiles the workload's model, then times and watches the memory of::

    model = distkeras.distribute(model, devices=N)
    model.fit(one global batch)

- ``distribute_s``: the ``distribute()`` call alone;
- ``first_step_s``: from the ``distribute()`` call to the end of the first training step (a callback notes
  when the step's results are ready, as in ``benchmarks.run``; what ``fit()`` does after the step, e.g.
  TensorFlow tearing down its dataset iterator, is left out, and is in ``fit_return_s``);
- ``growth_mib``: peak resident memory above what the process held once the model was built (sampled, plus
  the kernel's high-water mark), over the ``distribute()`` call and the first step;
- ``growth_with_build_mib``: the same from before the model was built (what ``benchmarks.run`` reports).

Prints a markdown table (medians, min–max, the median of the per-pair ratios new/old) and writes
``--out`` as JSON with every run, and the table beside it (``.md``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "startup-result: "
FIGURES = ("distribute_s", "first_step_s", "fit_return_s", "growth_mib", "growth_with_build_mib")


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two source checkouts (each with src/)")
    parser.add_argument("--backends", default="tensorflow,jax", help="comma-separated (default tensorflow,jax)")
    parser.add_argument("--workload", default="mlp", help="a benchmarks workload (default mlp)")
    parser.add_argument("--width", type=float, default=0.2, help="the MLP's width scale (default 0.2)")
    parser.add_argument("--devices", type=int, default=2, help="devices to distribute over (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each tree per backend (default 5)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: virtual CPU devices (default); gpu: the GPUs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    parser.add_argument("--out", default=None, help="write every run and the summary to this JSON file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def child(args):
    """One run, in this process: the figures as one line of JSON on stdout."""
    import distkeras  # first: applies DISTKERAS_CPU_DEVICES before the framework starts
    import keras
    import numpy as np

    from . import measure, variants, workloads

    keras.utils.set_random_seed(0)
    workload = workloads.get(args.workload, args.width)
    global_batch = workload.per_device_batch * args.devices
    pool = workload.batches(np.random.default_rng(0), global_batch, 1)
    ready = {}

    class FirstStep(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_end(self, batch, logs=None):
            ready.setdefault(batch, time.perf_counter())

    with measure.PeakMemory() as with_build:
        model = workload.build(keras)
        with measure.PeakMemory() as memory:
            started = time.perf_counter()
            model = distkeras.distribute(model, devices=args.devices)
            distributed = time.perf_counter()
            model.fit(variants.keras_batches(keras, pool, 1), epochs=1, shuffle=False, verbose=0,
                      callbacks=[FirstStep()])
            returned = time.perf_counter()
    figures = {
        "distribute_s": distributed - started,
        "first_step_s": ready[0] - started,
        "fit_return_s": returned - started,
        "growth_mib": memory.result()["growth_bytes"] / 2 ** 20,
        "growth_with_build_mib": with_build.result()["growth_bytes"] / 2 ** 20,
        "distkeras": os.path.dirname(distkeras.__file__),
    }
    print(RESULT + json.dumps(figures), flush=True)
    return 0


def _environment(tree, backend, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(KERAS_BACKEND=backend, PYTHONPATH=os.pathsep.join([os.path.join(tree, "src"), ROOT]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.platform == "cpu":
        env.update(DISTKERAS_CPU_DEVICES=str(args.devices), CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    return env


def _run(tree, backend, args):
    command = [sys.executable, "-m", "benchmarks.startup", "--child", "--workload", args.workload,
               "--width", str(args.width), "--devices", str(args.devices)]
    done = subprocess.run(command, cwd=ROOT, env=_environment(tree, backend, args), capture_output=True, text=True,
                          timeout=args.timeout)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            figures = json.loads(line[len(RESULT):])
            expected = os.path.join(os.path.abspath(tree), "src", "distkeras")
            if os.path.realpath(figures["distkeras"]) != os.path.realpath(expected):
                raise RuntimeError("the run imported distkeras from {}, not {}".format(figures["distkeras"], expected))
            return figures
    raise RuntimeError("run failed (exit {}):\n{}".format(done.returncode, (done.stdout + done.stderr)[-3000:]))


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        return child(args)
    if not args.trees:
        print("benchmarks.startup: error: --trees OLD NEW is required", file=sys.stderr)
        return 2
    trees = [os.path.abspath(t) for t in args.trees]
    revisions = [subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() for t in trees]
    results = {"command": "python -m benchmarks.startup " + " ".join(argv if argv is not None else sys.argv[1:]),
               "trees": dict(zip(("old", "new"), trees)), "revisions": dict(zip(("old", "new"), revisions)),
               "settings": {k: getattr(args, k) for k in ("workload", "width", "devices", "repeats", "platform")},
               "load_average": {"before": list(os.getloadavg())}, "backends": {}}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        runs = {"old": [], "new": []}
        for repeat in range(args.repeats):
            order = ("old", "new") if repeat % 2 == 0 else ("new", "old")
            for name in order:
                figures = _run(trees[0 if name == "old" else 1], backend, args)
                runs[name].append(figures)
                print("startup: {} {} run {}: distribute {:.2f}s, first step {:.2f}s, memory +{:.0f} MiB".format(
                    backend, name, repeat + 1, figures["distribute_s"], figures["first_step_s"],
                    figures["growth_mib"]), file=sys.stderr, flush=True)
        summary = {}
        for figure in FIGURES:
            old = [r[figure] for r in runs["old"]]
            new = [r[figure] for r in runs["new"]]
            summary[figure] = {"old": _summary(old), "new": _summary(new),
                               "new/old": _summary([n / o for n, o in zip(new, old)])}
        results["backends"][backend] = {"runs": runs, "summary": summary}
    results["load_average"]["after"] = list(os.getloadavg())
    table = markdown(results)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as handle:
            handle.write("Command: `{}`; old {}, new {}; load average (1/5/15 min) {} before, {} after.\n\n".format(
                results["command"], results["revisions"]["old"], results["revisions"]["new"],
                results["load_average"]["before"], results["load_average"]["after"]) + table + "\n")
    return 0


def markdown(results):
    """Medians (min–max) per tree and the median [range] of the per-pair ratios new/old."""
    old, new = results["revisions"]["old"], results["revisions"]["new"]
    lines = ["| backend | figure | old ({}) | new ({}) | new/old, per pair |".format(old, new),
             "|---|---|---|---|---|"]
    for backend, entry in results["backends"].items():
        for figure in FIGURES:
            s = entry["summary"][figure]
            cell = "{:.2f} ({:.2f}–{:.2f})"
            lines.append("| {} | {} | {} | {} | {:.2f} [{:.2f}–{:.2f}] |".format(
                backend, figure, cell.format(s["old"]["median"], s["old"]["min"], s["old"]["max"]),
                cell.format(s["new"]["median"], s["new"]["min"], s["new"]["max"]),
                s["new/old"]["median"], s["new/old"]["min"], s["new/old"]["max"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
