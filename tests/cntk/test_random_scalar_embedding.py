"""Three things the one-device promise depends on, on the real CNTK runtime (Keras 2.3.1), each in the same few
jobs (one process, 2 and 3 MPI ranks):

- A: Dropout. Which masks do the ranks draw for their rows: the same as each other, or independent ones?
  Independent, measured: Keras gives CNTK's dropout no seed, and the seed CNTK picks differs per rank.
- B: a loss function returning one number for the batch (it ends in a mean over everything): is the gradient
  of N ranks one process's? Yes without sample weights, uneven last batches included. With sample weights Keras
  multiplies that number by the batch's mean sample weight, a product of two batch means that no sum over ranks
  gives (measured: 2e-3 apart after 12 steps; README, CNTK).
- C: Embedding (a gather) trained with Adam: are the ranks' gradients summed before Adam's moments? Yes: the
  ranks' weights and Adam's moments equal one process's.
"""

import numpy as np
import pytest

from tests.cntk.harness import needs_runtime, run

pytestmark = needs_runtime

BODY = """
    import numpy as np, distkeras, keras
    from keras import backend as K
    from tests.cntk import toy
    workers = {workers}

    def maybe(model):
        return distkeras.distribute(model) if workers > 1 else model

    # A: 1 -> 64 (kernel of ones) -> Dropout(0.5), loss the mean output, SGD(1): one step on one row of ones per
    # rank moves each kernel weight by 2/64 times the mean over the rows of that unit's mask.
    np.random.seed(0)
    inputs = keras.layers.Input((1,))
    dense = keras.layers.Dense(64, use_bias=False, kernel_initializer="ones")(inputs)
    dropout = keras.models.Model(inputs, keras.layers.Dropout(0.5)(dense))
    dropout.compile(keras.optimizers.SGD(learning_rate=1.0), lambda y, p: K.mean(p + 0 * y, axis=-1))
    dropout = maybe(dropout)
    rows = max(workers, 1)
    dropout.fit(np.ones((rows, 1), "float32"), np.zeros((rows, 64), "float32"), batch_size=rows, shuffle=False, verbose=0)
    kept = np.round((1.0 - dropout.get_weights()[0][0]) * 32 * rows).astype(int)

    # B: a scalar loss, 36 rows in batches of 6 (splits evenly over 2 and 3 ranks).
    x, y = toy.data(36)
    np.random.seed(100 + toy.rank())
    scalar = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_dim=3), keras.layers.Dense(2)])
    scalar.compile(keras.optimizers.SGD(learning_rate=0.1), lambda t, p: K.mean(K.square(t - p)))
    scalar = maybe(scalar)
    scalar_history = scalar.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    # ... and 37 rows: a last batch of 1 row, which one rank trains on (weighted 2) and the other on a copy weighted 0.
    x37, y37 = toy.data(37)
    np.random.seed(100 + toy.rank())
    uneven = keras.models.Sequential([keras.layers.Dense(8, activation="tanh", input_dim=3), keras.layers.Dense(2)])
    uneven.compile(keras.optimizers.SGD(learning_rate=0.1), lambda t, p: K.mean(K.square(t - p)))
    uneven = maybe(uneven)
    uneven.fit(x37, y37, batch_size=6, epochs=2, shuffle=False, verbose=0)

    # C: Embedding + Adam, the same ids in every rank's rows.
    ids = np.random.RandomState(5).randint(0, 10, size=(36, 5)).astype("float32")
    np.random.seed(200 + toy.rank())
    embedding = keras.models.Sequential([keras.layers.Embedding(10, 4, input_length=5), keras.layers.Flatten(),
                                         keras.layers.Dense(2)])
    embedding.compile(keras.optimizers.Adam(learning_rate=0.01), "mse")
    embedding = maybe(embedding)
    embedding_history = embedding.fit(ids, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    toy.report(kept=kept, scalar=scalar.get_weights(), scalar_history=scalar_history, uneven=uneven.get_weights(),
               embedding=embedding.get_weights(), embedding_history=embedding_history,
               adam=toy.optimizer_state(embedding), workers=toy.workers_from_cntk() if workers > 1 else 1)
"""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cntk-a-c")
    results = {}
    for workers in (1, 2, 3):
        job = run(out / str(workers), BODY.format(workers=workers), workers=workers if workers > 1 else None)
        assert job.returncode == 0, job
        assert sorted(job.results) == list(range(workers))
        results[workers] = job.results
    return results


def close(a, b, tol=2e-6):
    return len(a) == len(b) and all(np.allclose(np.asarray(p, float), np.asarray(q, float), rtol=tol, atol=tol)
                                    for p, q in zip(a, b))


@pytest.mark.parametrize("workers", [2, 3])
def test_ranks_draw_independent_dropout_masks(jobs, workers):
    # Per unit, how many of the step's rows (one per rank) kept it. Ranks drawing alike would make every count 0 or
    # the rank count; CNTK picks the seed of a dropout given none per rank, so they are independent. Not one process's
    # masks: that draws every row's mask from one generator in one call, which no split of the batch repeats.
    kept = np.asarray(jobs[workers][0]["kept"])
    assert [r["workers"] for r in jobs[workers].values()] == [workers] * workers
    assert set(kept.tolist()) <= set(range(workers + 1))
    assert int((kept % workers != 0).sum()) >= 16, kept.tolist()


@pytest.mark.parametrize("workers", [2, 3])
def test_a_scalar_loss_trains_as_one_process(jobs, workers):
    want, got = jobs[1][0], jobs[workers][0]
    assert close(got["scalar"], want["scalar"])
    assert close(got["uneven"], want["uneven"])
    assert close(got["scalar_history"]["loss"], want["scalar_history"]["loss"], tol=1e-5)


@pytest.mark.parametrize("workers", [2, 3])
def test_embedding_with_adam_trains_as_one_process(jobs, workers):
    want, got = jobs[1][0], jobs[workers][0]
    assert close(got["embedding"], want["embedding"])
    assert close(got["adam"], want["adam"])
    assert close(got["embedding_history"]["loss"], want["embedding_history"]["loss"], tol=1e-5)
