"""What the one-device check costs: the first step of fit() with ``verify=True`` against without it.

Run: ``KERAS_BACKEND=jax python -m benchmarks.verify`` (or tensorflow). In one process, side by side and
interleaved, each round distributes a fresh model (an MLP of about 0.4 M parameters, global batch 64, 2 virtual
CPU devices) and times ``fit()`` over ``STEPS`` steps, checked and unchecked. Prints the medians, their ratio, the
checked step's extra time (the difference of medians: the one-device step, the state copies and the comparison),
and the bytes of training state the check copies (twice on TensorFlow and PyTorch: before and after the step).
"""

import os
import statistics
import time

ROUNDS = int(os.environ.get("VERIFY_BENCH_ROUNDS", "5"))
STEPS = 8


def main():
    import distkeras

    distkeras.use_cpu_devices(2)
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * STEPS, 256)).astype("float32")
    y = rng.integers(0, 10, size=(64 * STEPS,))

    def run(verify):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model = distkeras.distribute(model, 2, verify=verify)
        start = time.perf_counter()
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
        seconds = time.perf_counter() - start
        state = sum(int(np.prod(v.shape)) * 4 for v in model.variables + model.optimizer.variables)
        return seconds, state

    run(False), run(True)  # warm-up: imports, first compilations
    times = {False: [], True: []}
    state = 0
    for _ in range(ROUNDS):
        for verify in (False, True):
            seconds, state = run(verify)
            times[verify].append(seconds)
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    print("backend {}: fit() of {} steps, median of {} rounds".format(keras.backend.backend(), STEPS, ROUNDS))
    print("  without the check {:.3f} s, with it {:.3f} s: ratio {:.2f}, the check's extra {:.3f} s".format(
        plain, checked, checked / plain, checked - plain))
    print("  training state the check copies: {:.1f} MiB".format(state / 2**20))


if __name__ == "__main__":
    main()
