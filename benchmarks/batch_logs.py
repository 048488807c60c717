"""What one device's per-batch logs cost on PyTorch: ``batch_logs="global"`` against ``"local"``.

    DISTKERAS_CPU_DEVICES=2 python -m benchmarks.batch_logs --width 64 --batch 64

With ``batch_logs="global"`` (the default) every train or test step whose logs something reads (a callback
with a batch-end method, Keras' progress bar at ``verbose=1``) sums the metric states over the ranks in one
small all-reduce and reads them; ``"local"`` returns this rank's own running values. Three loops are timed,
their windows alternated, every rank training at once: a fit() with a callback reading each batch's logs under
``"global"`` and under ``"local"``, and a fit() nothing reads per batch (``verbose=0``, no callback: the
all-reduce is skipped). Then the per-step addition alone: the global logs of one step, called in a loop.
Rank 0 prints a markdown table of medians (ms per step).
"""

import argparse
import statistics
import time

import numpy as np


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_logs", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64, help="units of the MLP's two hidden layers (default 64)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="steps per timed window (default 40)")
    parser.add_argument("--windows", type=int, default=9, help="timed windows per loop (default 9)")
    parser.add_argument("--calls", type=int, default=300, help="calls of the per-step addition timed alone")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    import keras

    import distkeras

    class Reader(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.logs = logs

    def model(batch_logs):
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((32,)), keras.layers.Dense(args.width, activation="relu"),
                                  keras.layers.Dense(args.width, activation="relu"), keras.layers.Dense(10)])
        built.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return distkeras.distribute(built, devices=2, batch_logs=batch_logs)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, 32)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch * args.steps,)).astype("int32")
    global_model, local_model = model("global"), model("local")
    loops = {
        "global, a callback reads each batch": (global_model, lambda: [Reader()]),
        "local, a callback reads each batch": (local_model, lambda: [Reader()]),
        "global, nothing reads each batch": (global_model, lambda: []),
    }
    times = {name: [] for name in loops}
    for window in range(args.windows + 1):
        for name, (fitted, callbacks) in loops.items():
            start = time.perf_counter()
            fitted.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks())
            if window:  # the first round warms up
                times[name].append((time.perf_counter() - start) * 1000 / args.steps)
    logs = global_model.train_on_batch(x[: args.batch], y[: args.batch], return_dict=True)
    alone = []
    for _ in range(args.calls):  # the step's metric states summed over the ranks and read: what "global" adds
        start = time.perf_counter()
        global_model._get_metrics_result_or_logs(logs)
        alone.append((time.perf_counter() - start) * 1000)
    if distkeras.describe(global_model)["rank"] == 0:
        print("MLP 32-{0}-{0}-10, global batch {1}, 2 processes, {2} windows of {3} steps\n".format(
            args.width, args.batch, args.windows, args.steps))
        print("| loop | ms per step (median) | min | max |\n|---|---|---|---|")
        for name, values in times.items():
            print("| {} | {:.3f} | {:.3f} | {:.3f} |".format(name, statistics.median(values), min(values), max(values)))
        print("| the per-step addition alone | {:.3f} | {:.3f} | {:.3f} |".format(
            statistics.median(alone), min(alone), max(alone)))


if __name__ == "__main__":
    main()
