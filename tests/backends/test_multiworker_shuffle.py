"""fit()'s default ``shuffle=True`` across processes: two workers under `distkeras launch`, each seeded differently,
train what one process seeded as rank 0 trains.

Every worker is given the whole arrays and takes its part of each global batch, so every worker must shuffle
alike: each takes rank 0's random state (Python's and NumPy's, which Keras' JAX and PyTorch trainers shuffle
with) at every epoch's start, and on TensorFlow rank 0's global seed for the tf.data shuffle Keras builds in
fit(). A job whose workers shuffled apart would train on some samples twice and skip others in an epoch."""

import numpy as np

from tests.backends import scenarios
from tests.backends.harness import keras
from tests.backends.multiworker_job import EPOCHS, SHUFFLE_SEED
from tests.backends.test_multiworker import assert_close, launch, rank_weights


def one_process_seeded_as_rank_0():
    model = scenarios.build(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    x, y = scenarios.data(100)
    keras.utils.set_random_seed(SHUFFLE_SEED)  # rank 0's seed
    model.fit(x, y, batch_size=12, epochs=EPOCHS, shuffle=True, verbose=0)
    return model.get_weights()


def test_workers_seeded_apart_shuffle_as_rank_0_and_train_as_one_process(tmp_path):
    done, _ = launch(tmp_path, "shuffle")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r0, r1 = rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    assert_close(one_process_seeded_as_rank_0(), r0)
