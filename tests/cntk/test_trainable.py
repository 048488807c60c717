"""CNTK (Keras 2.3.1): a layer's trainability follows its flag after ``distribute()``, as in one process.

The transfer-learning guide's phases on N MPI workers: the first layer frozen (and the model compiled) before
``distribute()``, trained; unfrozen and compiled again, fine-tuned; frozen again and compiled, trained. Keras 2
reads the trainable weights when it builds its train function after ``compile()``: the weights equal one
process's at the same global batch, the frozen phases leave the layer as it was, and CNTK's MPI ran every worker.
"""

import numpy as np

from tests.cntk.harness import needs_runtime, run

pytestmark = needs_runtime

PHASES = """
    import numpy as np, distkeras
    from tests.cntk import toy
    x, y = toy.data(36)
    model = toy.model(seed=100)
    first = model.layers[0]
    first.trainable = False
    model.compile(toy.OPTIMIZERS["sgd"](__import__("keras")), loss="mse")
    {distribute}
    phases = [model.get_weights()]
    for trainable in (False, True, False):
        if trainable != first.trainable:
            first.trainable = trainable
            model.compile(toy.OPTIMIZERS["sgd"](__import__("keras")), loss="mse")
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        phases.append(model.get_weights())
    toy.report(phases=phases, workers=toy.workers_from_cntk())
"""


def _phases(tmp_path, workers=None):
    distribute = "model = distkeras.distribute(model)" if workers else "pass"
    job = run(tmp_path / str(workers), PHASES.format(distribute=distribute), workers=workers)
    assert job.returncode == 0, job
    return job.results


def test_a_layer_frozen_at_distribute_fine_tunes_once_unfrozen_and_stops_once_frozen_again(tmp_path):
    want = _phases(tmp_path)[0]["phases"]
    got = _phases(tmp_path, 2)
    assert [result["workers"] for result in got.values()] == [2, 2]
    phases = got[0]["phases"]
    assert got[1]["phases"] == phases
    first = lambda weights: [np.asarray(w) for w in weights[:2]]  # noqa: E731 (the first layer's kernel and bias)
    for before, after, moves in ((0, 1, False), (1, 2, True), (2, 3, False)):
        moved = max(float(np.abs(a - b).max()) for a, b in zip(first(phases[before]), first(phases[after])))
        assert (moved > 1e-4) == moves, (before, after, moved)
    for e, g in zip(want[-1], phases[-1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=2e-5)
