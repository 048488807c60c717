"""Scenario 1 on the real runtime, at the size of the recipe: two ranks started by ``distkeras launch --backend
cntk --nproc-per-node 2`` train its MLP (784-512-512-10, dropout off so that runs are deterministic) from
different initial weights on their parts of generated data, with a last batch the ranks split unevenly; they
must end with identical weights, equal to those of one process at the same global batch. And the example runs.
"""

import os

import numpy as np
import pytest

from tests.cntk.harness import PYTHON, ROOT, needs_runtime, run

pytestmark = needs_runtime

SCRIPT = """
    import os, sys
    import numpy as np
    single = sys.argv[1] == "single"
    optimizer_name, out = sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    import distkeras
    import keras
    from keras.layers import Dense
    np.random.seed(0 if single else rank)   # the ranks start from different weights
    model = keras.models.Sequential([Dense(512, activation="relu", input_shape=(784,)), Dense(512, activation="relu"),
                                     Dense(10, activation="softmax")])
    optimizer = keras.optimizers.RMSprop(learning_rate=0.0005) if optimizer_name == "rmsprop" else keras.optimizers.SGD(learning_rate=0.05)
    model.compile(loss="categorical_crossentropy", optimizer=optimizer, metrics=["accuracy"])
    if not single:
        model = distkeras.distribute(model)
    data = np.random.RandomState(1)
    x = data.uniform(size=(501, 784)).astype("float32")   # 501 = 7 batches of 64 and one of 53: ranks get 27 and 26 + 1
    y = keras.utils.to_categorical(data.randint(10, size=501), 10)
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    np.savez(os.path.join(out, "rank{}.npz".format(rank)), *model.get_weights())
    np.save(os.path.join(out, "loss{}.npy".format(rank)), np.array(history.history["loss"]))
"""

LAUNCH = [PYTHON, "-m", "distkeras", "launch", "--backend", "cntk", "--nproc-per-node", "2"]


def weights(path):
    with np.load(str(path)) as saved:
        return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop"])
def test_two_ranks_end_with_the_weights_of_one_process(tmp_path, optimizer):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    alone = run(tmp_path / "one", SCRIPT, args=["single", optimizer, str(tmp_path / "one")])
    assert alone.returncode == 0, alone
    pair = run(tmp_path / "two", SCRIPT, command=LAUNCH, args=["multi", optimizer, str(tmp_path / "two")])
    assert pair.returncode == 0, pair
    want = weights(tmp_path / "one" / "rank0.npz")
    ranks = [weights(tmp_path / "two" / "rank{}.npz".format(r)) for r in (0, 1)]
    for a, b in zip(*ranks):
        assert np.array_equal(a, b), "the two ranks ended with different weights"
    for got, expected in zip(ranks[0], want):
        assert np.allclose(got, expected, rtol=1e-4, atol=1e-5), "rank 0 differs from one process by {}".format(
            np.abs(got - expected).max())
    assert np.array_equal(np.load(str(tmp_path / "two" / "loss0.npy")), np.load(str(tmp_path / "two" / "loss1.npy")))
    assert "exited improperly" not in pair.stderr and "exiting improperly" not in pair.stderr


def test_the_scenario_1_example_runs_on_two_ranks(tmp_path):
    out = str(tmp_path / "mlp.h5")
    job = run(tmp_path, None, command=LAUNCH + [os.path.join(ROOT, "examples", "mnist_mlp_cntk.py"), "--quick", "--out", out])
    assert job.returncode == 0, job
    assert job.stdout.count("Test accuracy:") == 1 and os.path.exists(out)
