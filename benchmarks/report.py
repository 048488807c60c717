"""Results as files: ``results.json`` (every figure), ``results.md`` (tables), ``throughput.png`` (plot)."""

import json
import os

from .variants import ALTERNATIVE, KEYS, LABELS, LETTERS

#: Plot style per variant (the ideal line is dashed grey).
STYLES = {"plain": ("k", "s"), "distkeras": ("tab:blue", "o"), "native": ("tab:orange", "^"),
          "make_parallel": ("tab:green", "v"), ALTERNATIVE: ("tab:purple", "D")}
#: Horizontal offsets (in devices) that keep the variants' markers at one N apart.
OFFSETS = dict(zip(KEYS, (-0.09, -0.03, 0.03, 0.09)), **{ALTERNATIVE: 0.0})


def write(results, out_dir):
    """Write the three files into ``out_dir`` (created if needed); return their paths."""
    return write_files(results, out_dir, markdown(results), plot, "throughput.png")


def write_files(results, out_dir, table, plot_to, png):
    """``results.json``, ``results.md`` (``table``) and ``png`` (drawn by ``plot_to(results, path)``) into
    ``out_dir`` (created if needed); return their paths. Shared by every command that writes results."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("results.json", "results.md", png)]
    with open(paths[0], "w") as handle:
        json.dump(results, handle, indent=1)
    with open(paths[1], "w") as handle:
        handle.write(table)
    plot_to(results, paths[2])
    return paths


def merge(sources):
    """One results object from several ``run`` results, e.g. a Keras 3 run and a keras-mxnet one (each
    needs its own Python environment): runs, set-up figures and skipped backends added up, each
    source's command, machine and settings kept in ``sources`` (the tables list every one's). A
    backend skipped in one source and measured in another is not listed as skipped."""
    keys = ("command", "started", "finished", "machine", "settings")
    merged = {"schema": 1, "sources": [{k: s.get(k) for k in keys} for s in sources],
              "settings": dict(sources[0]["settings"]), "runs": [], "setup": [], "skipped": []}
    for source in sources:
        merged["runs"] += source["runs"]
        merged["setup"] += source["setup"]
    measured = {r["backend"] for r in merged["runs"]}
    merged["skipped"] = [s for source in sources for s in source["skipped"] if s["backend"] not in measured]
    windows = sorted({s["settings"]["windows"] for s in sources})
    merged["settings"]["windows"] = windows[0] if len(windows) == 1 else "/".join(str(w) for w in windows)
    return merged


def _ok(runs):
    return [r for r in runs if not r.get("error")]


def add_scaling_against_one_device(results):
    """Give every run on N > 1 devices ``scaling_efficiency_vs_one_device_run``: each variant's samples/s
    ÷ (N × a's in the one-device run of the same backend and workload), where there is one.

    The worker's own ``scaling_efficiency`` divides by a measured in the same process instead: the same
    conditions, but on JAX's virtual CPU devices a then runs on one device's share of the cores.
    """
    ones = {(r["backend"], r["workload"]): r for r in _ok(results["runs"]) if r["devices"] == 1}
    for run in _ok(results["runs"]):
        one = ones.get((run["backend"], run["workload"]))
        if run["devices"] == 1 or one is None:
            continue
        base = run["devices"] * one["variants"]["plain"]["samples_per_s"]["median"]
        run["scaling_efficiency_vs_one_device_run"] = {
            key: figures["samples_per_s"]["median"] / base for key, figures in run["variants"].items()}
    return results


def _rate(figures):
    s = figures["samples_per_s"]
    return "{:,.0f} ({:,.0f}–{:,.0f})".format(s["median"], s["min"], s["max"])


def _ratio(ratios, key):
    if key not in ratios:
        return "—"
    r = ratios[key]
    return "{:.3f} [{:.2f}–{:.2f}]".format(r["of_medians"], r["paired"]["min"], r["paired"]["max"])


def _mb(value):
    return "—" if value is None else "{:,.1f}".format(value / 2 ** 20)


def _machine_lines(results):
    m = results["machine"]
    versions = ", ".join("{} {}".format(k, v) for k, v in sorted(m["versions"].items()))
    load = m["load_average"]
    return [
        "Machine: {} — {} logical CPUs ({} usable), {:.0f} GiB RAM{}; {}; Python {}.".format(
            m["cpu_model"], m["cpu_count"], m["cpus_usable"], m["memory_bytes"] / 2 ** 30,
            "; GPUs: " + ", ".join(m["gpus"]) if m["gpus"] else "; no GPU", m["system"], m["python"]),
        "Load average (1/5/15 min): {} before, {} after.".format(load.get("before"), load.get("after")),
        "Versions: {}; source {}.".format(versions, m.get("revision")),
        "Command: `{}` (platform: {}).".format(results["command"], results["settings"]["platform"]),
    ]


def throughput_table(results):
    lines = [
        "| backend | workload | N | a: plain, 1 device | b: distkeras | c: native | d: make_parallel | b/c | b/d "
        "| scaling efficiency b / c / d: vs N=1 run (vs a, same process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        head = "| {} | {} | {} ".format(run["backend"], run["workload"], run["devices"])
        if run.get("error"):
            lines.append(head + "| failed: {} |".format(run["error"].splitlines()[0]) + " |" * 7)
            continue
        cells = [_rate(run["variants"][k]) if k in run["variants"] else "—" for k in KEYS]
        eff = "{} ({})".format(_efficiencies(run.get("scaling_efficiency_vs_one_device_run", {})),
                               _efficiencies(run["scaling_efficiency"]))
        lines.append(head + "| " + " | ".join(cells + [_ratio(run["ratios"], "distkeras/native"),
                                                       _ratio(run["ratios"], "distkeras/make_parallel"),
                                                       eff if run["devices"] > 1 else "—"]) + " |")
    return lines


def alternative_table(results):
    """b against b2 (b with other ``distribute()`` options), where a run has b2; else no lines."""
    runs = [r for r in _ok(results["runs"]) if ALTERNATIVE in r["variants"]]
    if not runs:
        return []
    settings = results["settings"]
    lines = ["b: `distribute()` options {}; b2: {} added.".format(
        json.dumps(settings.get("distribute_options") or {}), json.dumps(settings.get("alt_distribute_options"))), "",
        "| backend | workload | N | b: distkeras | b2: distkeras, other options | c: native | b/b2 | b2/c |",
        "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        variants = run["variants"]
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            run["backend"], run["workload"], run["devices"], _rate(variants["distkeras"]),
            _rate(variants[ALTERNATIVE]), _rate(variants["native"]) if "native" in variants else "—",
            _ratio(run["ratios"], "distkeras/" + ALTERNATIVE), _ratio(run["ratios"], ALTERNATIVE + "/native")))
    return lines


def _efficiencies(efficiency):
    return " / ".join("{:.2f}".format(efficiency[k]) if k in efficiency else "—" for k in KEYS[1:])


def setup_table(results):
    lines = ["| backend | workload | N | variant | set-up → first step (s) | distribute() → first step (s) "
             "| peak RSS growth (MiB) | device peak (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for entry in results["setup"]:
        head = "| {} | {} | {} | {} {} ".format(entry["backend"], entry["workload"], entry["devices"],
                                                LETTERS[entry["variant"]], entry["variant"])
        if entry.get("error") or entry.get("not_run"):
            lines.append(head + "| {} | | | |".format("failed" if entry.get("error") else "not run: " + entry["not_run"]))
            continue
        first, memory = entry["first_step_s"], entry["memory"]
        device = memory.get("device_peak_bytes")
        lines.append(head + "| {:.2f} | {} | {} | {} |".format(
            first["setup"], "{:.2f}".format(first["distribute"]) if "distribute" in first else "—",
            _mb(memory["growth_bytes"]), _mb(sum(device)) if device else "—"))
    return lines


def communication_table(results):
    lines = ["| backend | workload | N | parameters (MiB) | copy bandwidth (GB/s) | ring bound (ms) "
             "| all-reduce measured (ms) | measured / bound | b step (ms) | all-reduce / b step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in _ok(results["runs"]):
        comm = run.get("communication")
        if not comm:
            continue
        lines.append("| {} | {} | {} | {} | {:.2f} | {:.3f} | {:.3f} | {:.1f} | {} | {} |".format(
            run["backend"], run["workload"], run["devices"], _mb(comm["parameter_bytes"]),
            comm["copy_bandwidth_bytes_per_s"] / 1e9, comm["ring_bound_s"] * 1e3, comm["allreduce_s"]["median"] * 1e3,
            comm["allreduce_over_bound"],
            "{:.1f}".format(comm["distkeras_step_s"] * 1e3) if "distkeras_step_s" in comm else "—",
            "{:.0%}".format(comm["allreduce_share_of_step"]) if "allreduce_share_of_step" in comm else "—"))
    return lines


def markdown(results):
    windows = results["settings"]["windows"]
    parts = []
    for source in results.get("sources", [results]):  # several after merge()
        parts += ([""] if parts else []) + _machine_lines(source)
    parts += ["", "### Throughput (samples/s)", "",
              "Median of {} timed windows (min–max), the variants' windows alternated in one process per N. "
              "b/c, b/d: ratio of the medians [range of the per-round ratios]. Scaling efficiency: samples/s ÷ "
              "(N × a's samples/s), a from the N=1 run and, in brackets, a measured alongside in the same "
              "process.".format(windows), ""]
    parts += throughput_table(results)
    alternative = alternative_table(results)
    if alternative:
        parts += ["", "### b with other distribute() options (b2), interleaved with the others", ""] + alternative
    parts += ["", "### Start-up and memory (each variant in a fresh process)", ""]
    parts += setup_table(results)
    parts += ["", "### Communication per step", "",
              "One all-reduce of the model's variables by the backend's data-parallel mechanism, against the ring "
              "bound 2(N−1)/N × parameter bytes ÷ the device-0-to-device-1 copy bandwidth.", ""]
    parts += communication_table(results)
    for skipped in results["skipped"]:
        parts += ["", "Skipped {}: {}.".format(skipped["backend"], skipped["reason"])]
    return "\n".join(parts) + "\n"


def plot(results, path):
    """Samples/s against devices, one panel per backend and workload; dashed: N × a on one device.

    a is drawn at every N: it is measured in every process, alongside the others (on one device).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _ok(results["runs"])
    rows = sorted({r["backend"] for r in runs}) or ["no results"]
    columns = sorted({r["workload"] for r in runs}) or [""]
    figure, axes = plt.subplots(len(rows), len(columns), figsize=(4.0 * len(columns), 3.0 * len(rows)),
                                squeeze=False)
    for axis, (backend, workload) in zip(axes.flat, [(b, w) for b in rows for w in columns]):
        mine = sorted((r for r in runs if (r["backend"], r["workload"]) == (backend, workload)),
                      key=lambda r: r["devices"])
        for key in KEYS + (ALTERNATIVE,):
            points = [(r["devices"], r["variants"][key]["samples_per_s"]) for r in mine if key in r["variants"]]
            if not points:
                continue
            colour, marker = STYLES[key]
            xs = [n + OFFSETS[key] for n, _ in points]
            ys = [s["median"] for _, s in points]
            spread = [[s["median"] - s["min"] for _, s in points], [s["max"] - s["median"] for _, s in points]]
            axis.errorbar(xs, ys, yerr=spread, color=colour, marker=marker, capsize=3,
                          linestyle="none" if key == "plain" else "-",
                          label="{}: {}".format(LETTERS[key], LABELS[key]))
        if mine and "plain" in mine[0]["variants"]:
            one = mine[0]["variants"]["plain"]["samples_per_s"]["median"]
            xs = [r["devices"] for r in mine]
            axis.plot(xs, [one * n for n in xs], color="grey", linestyle="--", label="ideal: N × a")
        axis.set_title("{} — {}".format(backend, workload), fontsize=10)
        axis.set_xlabel("devices")
        axis.set_xticks([r["devices"] for r in mine] or [1])
        axis.set_ylabel("samples/s")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
