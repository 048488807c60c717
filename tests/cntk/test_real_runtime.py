"""The CNTK adapter on a real CNTK 2.7 + Keras 2.3.1 + Open MPI: what the doubles can only model.

Runs only where ``DISTKERAS_CNTK_PYTHON`` names a Python (CPython 3.5/3.6) with cntk 2.7 and Keras 2.3.1,
and ``mpiexec`` is on PATH:

    DISTKERAS_CNTK_PYTHON=/opt/cntk/bin/python python -m pytest tests/cntk/test_real_runtime.py

Two ranks started by ``distkeras launch --backend cntk --nproc-per-node 2`` train scenario 1's MLP
(784-512-512-10, dropout off so that runs are deterministic) from different initial weights on their
parts of generated data, with a last batch the ranks split unevenly; they must end with identical
weights, equal to those of one process at the same global batch.
"""

import os
import shutil
import subprocess
import textwrap

import numpy as np
import pytest

from tests.cntk.harness import ROOT, SRC

PYTHON = os.environ.get("DISTKERAS_CNTK_PYTHON", "")
REASON = "needs DISTKERAS_CNTK_PYTHON naming a Python with cntk and Keras 2.3.1, and mpiexec on PATH"


def _has_cntk_and_keras_231():
    if not PYTHON or not os.path.exists(PYTHON) or shutil.which("mpiexec") is None:
        return False
    check = "import cntk, keras, sys; sys.exit(keras.__version__ != '2.3.1')"
    env = dict(os.environ, KERAS_BACKEND="cntk")
    try:
        return subprocess.run([PYTHON, "-c", check], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _has_cntk_and_keras_231(), reason=REASON)

SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    single = sys.argv[1] == "single"
    optimizer_name, out = sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
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
""")


def run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, KERAS_BACKEND="cntk", KERAS_HOME=str(tmp_path),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-5000:]
    return done.stdout


def weights(path):
    with np.load(path) as saved:
        return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop"])
def test_two_ranks_end_with_the_weights_of_one_process(tmp_path, optimizer):
    script = tmp_path / "mlp.py"
    script.write_text(SCRIPT)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    run([PYTHON, str(script), "single", optimizer, str(tmp_path / "one")], tmp_path)
    output = run([PYTHON, "-m", "distkeras", "launch", "--backend", "cntk", "--nproc-per-node", "2", str(script), "multi",
                  optimizer, str(tmp_path / "two")], tmp_path)
    want = weights(tmp_path / "one" / "rank0.npz")
    ranks = [weights(tmp_path / "two" / "rank{}.npz".format(r)) for r in (0, 1)]
    for a, b in zip(*ranks):
        assert np.array_equal(a, b), "the two ranks ended with different weights"
    for got, expected in zip(ranks[0], want):
        assert np.allclose(got, expected, rtol=1e-4, atol=1e-5), "rank 0 differs from one process by {}".format(
            np.abs(got - expected).max())
    assert np.array_equal(np.load(str(tmp_path / "two" / "loss0.npy")), np.load(str(tmp_path / "two" / "loss1.npy")))
    assert "exited improperly" not in output and "exiting improperly" not in output


def test_the_scenario_1_example_runs_on_two_ranks(tmp_path):
    out = str(tmp_path / "mlp.h5")
    output = run([PYTHON, "-m", "distkeras", "launch", "--backend", "cntk", "--nproc-per-node", "2",
                  os.path.join(ROOT, "examples", "mnist_mlp_cntk.py"), "--quick", "--out", out], tmp_path)
    assert output.count("Test accuracy:") == 1 and os.path.exists(out)
