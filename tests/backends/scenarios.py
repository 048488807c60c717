"""Training scenarios for the equivalence tests: one model, one data set, one fit() call each.

``train(case, devices)`` builds the scenario's model from a fixed seed (so every run starts from the
same weights), distributes it over ``devices`` (1 = plain Keras, untouched), fits it and returns the
final weights and the history. Runnable as a script, for backends whose replicas are processes:

    python -m tests.backends.scenarios CASE DEVICES OUT.npz
"""

import sys

import numpy as np

#: name -> (samples, global batch, epochs, kernel regularizer). SGD, no dropout, no shuffling.
CASES = {
    "even": (96, 12, 2, None),  # every batch splits evenly over 2 and 3 replicas
    "uneven_tail": (100, 12, 2, None),  # last batch of 4: 2+2 on 2 replicas, 2+1+1 on 3
    "batch_not_divisible": (101, 10, 2, None),  # 10 on 3 replicas: 4+3+3; last batch of 1
    "l2": (96, 12, 2, "l2"),  # regularisation losses must not count once per replica
}


def data(samples, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = rng.normal(size=(samples, 3)).astype("float32")
    return x, y


def build(keras, regularizer=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"])
    return model


def train(case, devices):
    import keras

    import distkeras

    samples, batch, epochs, regularizer = CASES[case]
    model = build(keras, regularizer)
    if devices > 1 or distkeras.cluster.from_env().is_multi_worker:
        model = distkeras.distribute(model, devices=devices)
    x, y = data(samples)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], history.history


if __name__ == "__main__":
    name, count, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    weights, history = train(name, count)
    from distkeras import cluster

    np.savez(out.replace(".npz", ".rank{}.npz".format(cluster.from_env().rank)), *weights)
    if cluster.from_env().rank == 0:  # in a multi-process run, every rank trains; rank 0 writes
        np.savez(out, *weights, **{"history_" + k: np.asarray(v) for k, v in history.items()})
