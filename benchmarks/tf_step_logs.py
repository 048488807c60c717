"""What one device's per-batch logs cost on TensorFlow: every metric's result read in a step as the global batch's.

    KERAS_BACKEND=tensorflow DISTKERAS_CPU_DEVICES=2 python -m benchmarks.tf_step_logs --width 64 --batch 64

distkeras makes each metric's ``result()`` read inside a replica step the global batch's: one all-reduce of the
metric's variables in the step's graph (AUC's 4 x 200 thresholds, a Mean's total and count). Without it, Keras
averages each replica's own result, which is not one device's for a ratio or a count. Two models, identical but
for that hook (the second has distkeras' step hooks taken off after ``distribute()``: Keras' own per-replica
logs), trained in alternated windows on 2 replicas, with accuracy and AUC as metrics. Prints a markdown table of
medians (ms per step) and their ratio.
"""

import argparse
import statistics
import time

import numpy as np


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tf_step_logs", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64, help="units of the MLP's two hidden layers (default 64)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="steps per timed window (default 40)")
    parser.add_argument("--windows", type=int, default=9, help="timed windows per model (default 9)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    import distkeras

    distkeras.use_cpu_devices(2)
    import keras

    from distkeras.backends import keras_model

    def model(global_logs):
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((32,)), keras.layers.Dense(args.width, activation="relu"),
                                  keras.layers.Dense(args.width, activation="relu"), keras.layers.Dense(1)])
        built.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=["accuracy", keras.metrics.AUC(from_logits=True)])
        built = distkeras.distribute(built, devices=2)
        if not global_logs:
            keras_model.unhook(built, "train_step", "test_step")
        return built

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, 32)).astype("float32")
    y = (rng.random(size=(args.batch * args.steps, 1)) > 0.5).astype("float32")
    models = {"global batch's results (distkeras)": model(True), "each replica's own, averaged (Keras)": model(False)}
    times = {name: [] for name in models}
    for window in range(args.windows + 1):
        for name, fitted in models.items():
            start = time.perf_counter()
            fitted.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
            if window:  # the first round builds and warms up
                times[name].append((time.perf_counter() - start) * 1000 / args.steps)
    print("MLP 32-{0}-{0}-1, accuracy and AUC, global batch {1}, 2 replicas, {2} windows of {3} steps\n".format(
        args.width, args.batch, args.windows, args.steps))
    print("| per-batch logs | ms per step (median) | min | max |\n|---|---|---|---|")
    for name, values in times.items():
        print("| {} | {:.3f} | {:.3f} | {:.3f} |".format(name, statistics.median(values), min(values), max(values)))
    medians = [statistics.median(values) for values in times.values()]
    print("\nratio (distkeras / Keras' own): {:.2f}".format(medians[0] / medians[1]))


if __name__ == "__main__":
    main()
