"""What the data check costs: fit() across two worker processes with ``check_data=True`` (the default) against
``check_data=False``, on data that agree.

Run: ``KERAS_BACKEND=jax python -m benchmarks.data_check`` (or tensorflow, torch). It starts a job of two workers
on this host (``distkeras launch --nproc-per-node 2``, one CPU device each) running this module; in the job, side by
side and interleaved (each round in the other order than the last), each round distributes a fresh model (an MLP of about 0.2 M parameters, global batch 64) and
times ``fit()`` over ``EPOCHS`` epochs of ``STEPS`` steps, checked and unchecked, on NumPy arrays (fit's shuffle) and
on a seeded, shuffled ``tf.data`` pipeline. Rank 0 prints the medians, their ratio and the check's cost per pass
(the difference of medians over the passes compared: one batch hashed, one all-gather).
``DATA_CHECK_BENCH_EPOCHS`` (default 3) sets the epochs per ``fit()``: a cost paid once per ``fit()`` (a pipeline
step traced, a new dataset's iterator made) shrinks per pass as it grows, a cost per pass does not.
"""

import os
import statistics
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("DATA_CHECK_BENCH_ROUNDS", "7"))
EPOCHS = int(os.environ.get("DATA_CHECK_BENCH_EPOCHS", "3"))
STEPS, BATCH = 16, 64


def worker():
    import distkeras
    import keras
    import numpy as np

    rank = distkeras.cluster.from_env().rank
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 256)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * STEPS,))

    def data(kind):
        if kind == "arrays":
            return dict(x=x, y=y, batch_size=BATCH)
        import tensorflow as tf

        return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1).batch(BATCH))

    def run(kind, check):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model = distkeras.distribute(model, check_data=check)
        start = time.perf_counter()
        model.fit(epochs=EPOCHS, verbose=0, **data(kind))
        return time.perf_counter() - start

    for kind in ("arrays", "tf.data"):
        run(kind, False), run(kind, True)  # warm-up: imports, first compilations
        times = {False: [], True: []}
        for round_ in range(ROUNDS):
            for check in ((False, True) if round_ % 2 == 0 else (True, False)):  # neither always runs first
                times[check].append(run(kind, check))
        plain, checked = statistics.median(times[False]), statistics.median(times[True])
        if rank == 0:
            print("{} backend, {}: fit() of {} epochs x {} steps over 2 workers, median of {} rounds".format(
                keras.backend.backend(), kind, EPOCHS, STEPS, ROUNDS))
            print("  check_data=False {:.3f} s, True {:.3f} s: ratio {:.3f}; per pass compared {:+.1f} ms".format(
                plain, checked, checked / plain, 1000 * (checked - plain) / EPOCHS), flush=True)


def main():
    if "--worker" in sys.argv:
        worker()
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), root]))
    env.pop("XLA_FLAGS", None)
    backend = env.get("KERAS_BACKEND", "tensorflow")
    sys.exit(subprocess.call([sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "--backend",
                              backend, "-m", "benchmarks.data_check", "--worker"], env=env, cwd=root))


if __name__ == "__main__":
    main()
