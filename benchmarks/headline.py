"""The headline chart of docs/benchmarks.md, drawn from the committed results of ``python -m benchmarks run``.

    python -m benchmarks.headline            # writes benchmarks/headline.png

One row per backend and workload at N = 2: distkeras against the hand-written native code (b/c) and against the
make_parallel recipe (b/d), the ratio of the medians with the range of the per-round ratios. All measured on CPU.
"""

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
#: The runs drawn, in the order of the rows (top to bottom): Keras 3 (TensorFlow, JAX), PyTorch, keras-mxnet.
SOURCES = ("results/results.json", "results-torch/results.json", "results-mxnet/results.json")
PANELS = (("distkeras/native", "b/c: distkeras ÷ hand-written native code"),
          ("distkeras/make_parallel", "b/d: distkeras ÷ the make_parallel recipe"))
TICKS = (0.5, 0.7, 1.0, 1.4, 2.0, 3.0)


def rows(sources=SOURCES, devices=2):
    """``[(label, {ratio key: (of medians, per-round min, per-round max)})]`` of every run on ``devices``."""
    out = []
    for source in sources:
        with open(os.path.join(HERE, source)) as handle:
            results = json.load(handle)
        for run in results["runs"]:
            if run["devices"] != devices or run.get("error"):
                continue
            ratios = {key: (r["of_medians"], r["paired"]["min"], r["paired"]["max"]) for key, r in run["ratios"].items()}
            out.append(("{} {}".format(run["backend"], run["workload"]), ratios))
    return out


def plot(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in data]
    ys = list(range(len(data)))[::-1]
    figure, axes = plt.subplots(1, len(PANELS), figsize=(9.0, 0.32 * len(data) + 1.5), sharey=True)
    for axis, (key, title) in zip(axes, PANELS):
        axis.axvline(1.0, color="grey", linewidth=1)
        for y, (_, ratios) in zip(ys, data):
            if key not in ratios:
                continue
            median, low, high = ratios[key]
            axis.errorbar([median], [y], xerr=[[median - low], [high - median]], fmt="o", color="tab:blue", capsize=3)
        axis.set_xscale("log")
        axis.set_xticks(TICKS)
        axis.set_xticklabels([str(t) for t in TICKS])
        axis.minorticks_off()
        axis.set_xlim(0.4, 3.2)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(labels)
    figure.suptitle("Measured on CPU (2-core machines), N = 2 CPU devices or processes; > 1: distkeras faster\n"
                    "dot: ratio of the medians; bar: range of the per-round ratios", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "headline.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    plot(rows(), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
