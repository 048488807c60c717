"""fit()'s default ``shuffle=True`` across processes: two workers under `distkeras launch`, each seeded differently,
train what one process seeded as rank 0 trains.

Every worker is given the whole arrays and takes its part of each global batch, so every worker must shuffle
alike: each takes rank 0's random state (Python's and NumPy's, which Keras' JAX and PyTorch trainers shuffle
with) at every epoch's start, and on TensorFlow rank 0's global seed for the tf.data shuffle Keras builds in
fit(). A job whose workers shuffled apart would train on some samples twice and skip others in an epoch."""

import numpy as np
import pytest

from tests.backends import scenarios
from tests.backends.harness import BACKEND, keras
from tests.full import FULL
from tests.backends.multiworker_job import EPOCHS, SHUFFLE_SEED
from tests.backends.test_multiworker import assert_close, launch, rank_weights


def one_process_seeded_as_rank_0():
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    x, y = scenarios.data(100)
    keras.utils.set_random_seed(SHUFFLE_SEED)  # rank 0's seed
    model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=True, verbose=0)
    return model.get_weights()


@pytest.mark.skipif(not FULL and BACKEND == "jax", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): JAX's trainer shuffles with Python's and NumPy's random state, as "
    "PyTorch's does, and the same code hands rank 0's state over on both; the default run keeps PyTorch's and "
    "TensorFlow's (its tf.data seed)"))
def test_workers_seeded_apart_shuffle_as_rank_0_and_train_as_one_process(tmp_path):
    done, _ = launch(tmp_path, "shuffle")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r0, r1 = rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    assert_close(one_process_seeded_as_rank_0(), r0)
    # Python's and NumPy's states too: taken from rank 0 at the last epoch's start, the same on both ranks after.
    drawn = [line.split("] ", 1)[1] for line in done.stdout.splitlines() if "drawn after fit" in line]
    assert len(drawn) == 2 and drawn[0] == drawn[1], drawn


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's global seed, fixed into Keras' tf.data shuffle")
def test_tensorflow_builds_the_shuffle_of_arrays_under_the_held_seed_and_keeps_its_own_seed():
    """The window a multi-worker fit() call holds rank 0's seed in: the pipeline built there shuffles as one built
    under that global seed (every epoch alike, as Keras' seeded shuffle does), and the process' own global seed
    (here none) is TensorFlow's again afterwards."""
    import tensorflow as tf
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
    from tensorflow.python.eager import context

    from distkeras.backends.tensorflow import batches

    def permutations(epochs=2):
        dataset = ArrayDataAdapter(np.arange(64), batch_size=64, shuffle=True).get_tf_dataset()
        return [next(iter(dataset)).numpy().tolist() for _ in range(epochs)]

    assert batches._build_shuffles_under_held_seed("keras")
    tf.random.set_seed(7)
    seeded = permutations()
    tf.random.set_seed(None)
    batches._shuffle_seed.value = 7
    try:
        held = permutations()
    finally:
        batches._shuffle_seed.value = None
    assert held == seeded and held[0] == held[1] and sorted(held[0]) == list(range(64))
    assert context.global_seed() is None
    assert permutations(1)[0] != seeded[0]  # unseeded again: a permutation of its own (equal with p = 1/64!)
