"""N workers (processes under the fake mpiexec) train as one process does at the same global batch.

Against the doubles (tests/cntk/doubles): CNTK's distributed learner sums gradients, loss and evaluation
values over the workers, as measured on CNTK 2.7, and the Keras stand-in trains as Keras 2.3.1 does. What
is tested is distkeras' part: the loss weights that turn the sum into the global batch's mean, the
broadcast of rank 0's weights, the sums of the metric states, and the sharding of fit()'s arrays.
"""

import numpy as np
import pytest

from tests.cntk.harness import needs_runtime, run

pytestmark = needs_runtime

TRAIN = """
    import numpy as np, distkeras
    from tests.cntk import toy
    x, y = toy.data({n})
    model = toy.model(seed=100 + toy.rank(), optimizer="{optimizer}", l2={l2})   # every rank starts elsewhere
    {distribute}
    history = model.fit(x, y, batch_size={batch}, epochs=3, shuffle=False, verbose=0{fit})
    toy.report(weights=model.get_weights(), history=history.history, optimizer=toy.optimizer_state(model), workers=toy.workers_from_cntk(),
               evaluation=model.evaluate(x, y, batch_size=8, verbose=0))
"""


def train(tmp_path, workers=None, n=37, batch=6, optimizer="rmsprop", l2=0.01, fit="", distribute=None):
    distribute = distribute or ("model = distkeras.distribute(model)" if workers else "pass")
    job = run(tmp_path / str(workers), TRAIN.format(n=n, batch=batch, optimizer=optimizer, l2=l2, fit=fit, distribute=distribute),
              workers=workers)
    assert job.returncode == 0, job
    assert sorted(job.results) == list(range(workers or 1))
    return job.results


def one_process(tmp_path, **kwargs):
    """The reference: plain Keras, one process, rank 0's initial weights."""
    return train(tmp_path, None, **kwargs)[0]


def close(a, b, tol=2e-6):
    return all(np.allclose(np.asarray(x, dtype=float), np.asarray(y, dtype=float), rtol=tol, atol=tol, equal_nan=True)
               for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("optimizer", ["rmsprop", "sgd", "adam"])
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_end_with_the_weights_of_one_process_at_the_same_global_batch(tmp_path, workers, optimizer):
    want = one_process(tmp_path, n=36, optimizer=optimizer)
    got = train(tmp_path, workers, n=36, optimizer=optimizer)
    for rank, result in got.items():
        assert result["weights"] == got[0]["weights"], "rank {} ended with other weights than rank 0".format(rank)
        assert result["optimizer"] == got[0]["optimizer"]
        assert result["history"] == got[0]["history"], "ranks reported different losses or metrics"
    assert [result["workers"] for result in got.values()] == [workers] * workers  # CNTK's MPI ran them all
    assert close(got[0]["weights"], want["weights"])
    assert close(got[0]["optimizer"], want["optimizer"])
    assert sorted(got[0]["history"]) == ["loss", "mae"]
    for key in ("loss", "mae"):  # the global values, not the workers' sum
        assert close(got[0]["history"][key], want["history"][key], tol=1e-5), key
    assert close(got[0]["evaluation"], want["evaluation"], tol=1e-5)


@pytest.mark.parametrize("n,workers", [(37, 2), (37, 3), (41, 3), (8, 3), (2, 3)])
def test_a_short_last_batch_trains_as_one_process_does_and_never_hangs(tmp_path, n, workers):
    """37 rows at batch 6: the last batch has 1 row; one worker trains on it, the others take a zero-weight row."""
    want = one_process(tmp_path, n=n)
    got = train(tmp_path, workers, n=n)
    assert all(result["weights"] == got[0]["weights"] for result in got.values())
    assert close(got[0]["weights"], want["weights"])
    assert close(got[0]["history"]["mae"], want["history"]["mae"], tol=1e-5)


def test_the_epoch_loss_is_the_one_process_loss_when_the_last_batch_splits_evenly(tmp_path):
    want = one_process(tmp_path, n=40)  # last batch: 4 rows, 2 per worker
    got = train(tmp_path, 2, n=40)
    assert close(got[0]["history"]["loss"], want["history"]["loss"], tol=1e-5)


def test_validation_split_takes_the_last_rows_before_sharding(tmp_path):
    want = one_process(tmp_path, fit=", validation_split=0.25")
    got = train(tmp_path, 3, fit=", validation_split=0.25")
    assert close(got[0]["weights"], want["weights"])
    assert got[0]["history"]["val_loss"] == got[2]["history"]["val_loss"]
    assert close(got[0]["history"]["val_loss"], want["history"]["val_loss"], tol=1e-5)


def test_sample_weights_follow_their_rows(tmp_path):
    fit = ", sample_weight=np.linspace(0.1, 2, len(x)).astype('float32')"
    want = one_process(tmp_path, fit=fit)
    got = train(tmp_path, 2, fit=fit)
    assert close(got[0]["weights"], want["weights"])


def test_without_the_loss_weights_cntks_distributed_learner_sums(tmp_path):
    """The CNTK recipe by hand, no distkeras: 2 workers at lr 0.025 on 32 rows each train as one process
    at lr 0.05 on 64 rows, and the loss Keras reports is the sum of the workers' (why the adapter weighs the
    loss 1/workers)."""
    body = """
        import numpy as np, cntk, keras
        from cntk.train.distributed import Communicator, data_parallel_distributed_learner
        from tests.cntk import toy
        x, y = toy.data(64)
        workers = Communicator.num_workers()
        np.random.seed(5)
        model = keras.models.Sequential([keras.layers.Dense(2, input_dim=3)])
        model.compile(keras.optimizers.SGD(learning_rate=0.05 / workers), loss="mse")
        model._make_train_function()
        trainer = model.train_function.trainer
        learner = data_parallel_distributed_learner(trainer.parameter_learners[0], num_quantization_bits=32, distributed_after=0)
        model.train_function.trainer = cntk.Trainer(trainer.model, (trainer.loss_function,), [learner])
        mine = slice(Communicator.rank() * 64 // workers, (Communicator.rank() + 1) * 64 // workers)
        local = model.evaluate(x[mine], y[mine], verbose=0)
        reported = model.train_on_batch(x[mine], y[mine])
        toy.report(weights=model.get_weights(), local=local, reported=reported)
        Communicator.finalize()
    """
    alone = run(tmp_path / "1", body)
    pair = run(tmp_path / "2", body, workers=2)
    assert alone.returncode == 0 and pair.returncode == 0, (alone, pair)
    assert close(pair.results[0]["weights"], alone.results[0]["weights"], tol=3e-7)
    assert pair.results[0]["weights"] == pair.results[1]["weights"]
    both = pair.results[0]["local"] + pair.results[1]["local"]
    assert np.isclose(pair.results[0]["reported"], both, rtol=1e-6) and np.isclose(pair.results[1]["reported"], both, rtol=1e-6)


def test_train_on_batch_with_equal_batches_is_one_step_on_their_union(tmp_path):
    body = """
        import numpy as np, distkeras
        from tests.cntk import toy
        x, y = toy.data(12)
        model = toy.model(seed=3)
        if {workers}:
            model = distkeras.distribute(model)
            mine = slice(toy.rank() * 6, toy.rank() * 6 + 6)
        else:
            mine = slice(0, 12)
        losses = [model.train_on_batch(x[mine], y[mine]) for _ in range(3)]
        toy.report(weights=model.get_weights(), losses=losses)
    """
    want = run(tmp_path / "1", body.format(workers=0)).results[0]
    got = run(tmp_path / "2", body.format(workers=2), workers=2).results
    assert close(got[0]["weights"], want["weights"]) and got[0]["weights"] == got[1]["weights"]
    assert close(got[1]["losses"], want["losses"], tol=1e-5)


def test_shuffled_training_keeps_the_workers_identical(tmp_path):
    body = """
        import numpy as np, distkeras
        from tests.cntk import toy
        np.random.seed(toy.rank())  # every worker shuffles its own shard its own way
        x, y = toy.data(41)
        model = distkeras.distribute(toy.model(seed=toy.rank()))
        history = model.fit(x, y, batch_size=6, epochs=4, verbose=0)
        toy.report(weights=model.get_weights(), history=history.history)
    """
    job = run(tmp_path, body, workers=3)
    assert job.returncode == 0, job
    assert job.results[0] == job.results[1] == job.results[2]
    assert job.results[0]["history"]["loss"][-1] < job.results[0]["history"]["loss"][0]


def test_recompiling_a_distributed_model_keeps_it_distributed(tmp_path):
    body = """
        import keras, distkeras
        from tests.cntk import toy
        x, y = toy.data(24)
        model = toy.model(seed=100 + toy.rank())
        if {workers}:
            model = distkeras.distribute(model)
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        model.compile(keras.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"])
        model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        toy.report(weights=model.get_weights())
    """
    want = run(tmp_path / "1", body.format(workers=0)).results[0]
    got = run(tmp_path / "2", body.format(workers=2), workers=2).results
    assert got[0]["weights"] == got[1]["weights"] and close(got[0]["weights"], want["weights"])


def test_workers_that_pass_different_data_get_an_error_instead_of_a_hang(tmp_path):
    body = """
        import distkeras
        from tests.cntk import toy
        x, y = toy.data(40)
        model = distkeras.distribute(toy.model(seed=1))
        mine = slice(toy.rank() * 40 // 3, (toy.rank() + 1) * 40 // 3)   # the CNTK recipe's own sharding
        try:
            model.fit(x[mine], y[mine], batch_size=6, verbose=0)
        except distkeras.ShardError as exc:
            toy.report(error=str(exc))
    """
    job = run(tmp_path, body, workers=3)
    assert job.returncode == 0, job
    for result in job.results.values():
        assert ("Every worker must call fit() with the same full arrays, batch_size and epochs (distkeras shards the "
                "data itself). Received (samples, batch_size, epochs) by rank: 0: (13, 6, 1), 1: (13, 6, 1), "
                "2: (14, 6, 1).") == result["error"]


def test_workers_that_shard_the_data_themselves_evenly_get_a_data_error_on_every_worker(tmp_path):
    """The CNTK recipe's own sharding where it splits evenly: the calls agree in every count, so only the data
    check sees that each worker passes other rows (distkeras would shard each worker's shard again). evaluate()
    with arrays drawn apart is caught the same way."""
    body = """
        import distkeras
        from tests.cntk import toy
        x, y = toy.data(40)
        model = distkeras.distribute(toy.model(seed=1))
        mine = slice(toy.rank() * 20, (toy.rank() + 1) * 20)   # the CNTK recipe's own sharding, even
        found = {}
        try:
            model.fit(x[mine], y[mine], batch_size=6, verbose=0)
        except distkeras.DataError as exc:
            found["fit"] = str(exc)
        try:
            model.evaluate(x + toy.rank(), y, batch_size=8, verbose=0)
        except distkeras.DataError as exc:
            found["evaluate"] = str(exc)
        toy.report(**found)
    """
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 0, job
    assert sorted(job.results) == [0, 1]
    for result in job.results.values():
        assert "at the first step of fit() on the cntk backend (2 workers)" in result["fit"], result
        assert "worker 1's batch differs from worker 0's in x, y." in result["fit"], result
        assert "at the first step of evaluate() on the cntk backend" in result["evaluate"], result
        assert "worker 1's batch differs from worker 0's in x." in result["evaluate"], result


def test_a_global_batch_the_workers_do_not_divide_is_refused_on_every_worker(tmp_path):
    body = """
        import distkeras
        from tests.cntk import toy
        x, y = toy.data(40)
        model = distkeras.distribute(toy.model(seed=1))
        try:
            model.fit(x, y, batch_size=10, verbose=0)
        except distkeras.ShardError as exc:
            toy.report(error=str(exc))
    """
    job = run(tmp_path, body, workers=3)
    assert job.returncode == 0, job
    assert [r["error"] for r in job.results.values()] == [
        "Expected a global batch size that 3 workers split evenly (a multiple of 3). Received: batch_size=10. Pass e.g. 9 or 12."] * 3


def test_evaluate_and_predict_give_every_worker_the_same_results(tmp_path):
    body = """
        import distkeras
        from tests.cntk import toy
        x, y = toy.data(20)
        model = distkeras.distribute(toy.model(seed=toy.rank()))
        model.fit(x, y, batch_size=4, verbose=0)
        toy.report(evaluation=model.evaluate(x, y, verbose=0), prediction=model.predict(x))
    """
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 0, job
    assert job.results[0] == job.results[1]


SPLIT = """
    import numpy as np, distkeras
    from keras.backend import cntk_backend
    from tests.cntk import toy
    x, y = toy.data(10)
    weights = np.linspace(0.1, 2, 10).astype("float32")
    model = toy.model(seed=100 + toy.rank())
    if {workers}:
        model = distkeras.distribute(model)
    seen = []   # the rows of every batch this rank's test and predict functions (no trainer) compute
    call = cntk_backend.Function.__call__
    def counting(self, inputs):
        if self.trainer is None and self.placeholders and self.placeholders[0] is model._feed_inputs[0]:
            seen.append(len(inputs[0]))
        return call(self, inputs)
    cntk_backend.Function.__call__ = counting
    def rows(run):
        del seen[:]
        return run(), list(seen)
    evaluation, evaluated = rows(lambda: model.evaluate(x, y, batch_size=4, verbose=0))
    weighted, weighed = rows(lambda: model.evaluate(x, y, batch_size=4, sample_weight=weights, verbose=0))
    prediction, predicted = rows(lambda: model.predict(x, batch_size=4))
    history, validated = rows(lambda: model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0,
                                                validation_data=(x[:7], y[:7], weights[:7])))
    cntk_backend.Function.__call__ = call
    error = None
    if {workers}:
        try:
            model.evaluate(x[:10 - toy.rank()], y[:10 - toy.rank()], batch_size=4, verbose=0)
        except distkeras.ShardError as exc:
            error = str(exc)
    toy.report(evaluation=evaluation, weighted=weighted, prediction=prediction, rows=[evaluated, weighed, predicted], validated=validated,
               history=history.history, error=error)
"""


@pytest.mark.parametrize("workers", [2, 3])
def test_evaluate_and_predict_split_the_rows_over_the_workers_with_the_results_of_one_process(tmp_path, workers):
    """10 rows at batch 4: each rank computes its rows [rank::workers] of every global batch (with 3 ranks,
    rank 2 has none of the last batch's 2), and evaluate (with and without sample weights), predict and fit()'s
    validation give one process' results on every rank; evaluate calls that differ raise on every rank."""
    want = run(tmp_path / "1", SPLIT.format(workers=0))
    assert want.returncode == 0, want
    want = want.results[0]
    job = run(tmp_path / str(workers), SPLIT.format(workers=workers), workers=workers)
    assert job.returncode == 0, job
    assert sorted(job.results) == list(range(workers))
    for rank, got in job.results.items():
        mine = [len(range(rank, size, workers)) for size in (4, 4, 2)]
        assert got["rows"] == [[n for n in mine if n]] * 3, "rank {} computed other rows than its own".format(rank)
        step = 6 // workers  # fit() feeds Keras a rank's share of the global batch, which it also validates in
        mine = [len(range(rank, min(step, 7 - start), workers)) for start in range(0, 7, step)]
        assert got["validated"] == [n for n in mine if n] * 2, rank
        for key in ("evaluation", "weighted"):
            assert close(got[key], want[key], tol=1e-6), (key, got[key], want[key])
        assert np.array_equal(got["prediction"], job.results[0]["prediction"])
        assert close(got["prediction"], want["prediction"], tol=1e-6)
        assert sorted(got["history"]) == ["loss", "mae", "val_loss", "val_mae"]
        for key in ("val_loss", "val_mae"):
            assert close(got["history"][key], want["history"][key], tol=1e-5), (key, got["history"][key], want["history"][key])
        assert got["error"] == (
            "Every worker must call evaluate() with the same full arrays, batch_size (distkeras shards the data itself). "
            "Received (samples, batch_size) by rank: {}.".format(", ".join("{}: ({}, 4)".format(r, 10 - r) for r in range(workers))))
    assert want["rows"] == [[4, 4, 2]] * 3 and want["validated"] == [6, 1] * 2


def test_one_bit_sgd_trains_the_workers_alike_but_not_exactly(tmp_path):
    """CNTK 2.7's PyPI wheel has 1-bit SGD: compression='1bit' quantizes the summed gradients (with error
    feedback), so the ranks stay identical and learn, but end away from the exact 32-bit run."""
    exact = train(tmp_path / "exact", 2, n=36, optimizer="sgd")
    got = train(tmp_path / "1bit", 2, n=36, optimizer="sgd", distribute="model = distkeras.distribute(model, compression='1bit')")
    assert got[0]["weights"] == got[1]["weights"] and got[0]["history"] == got[1]["history"]
    assert got[0]["history"]["loss"][-1] < got[0]["history"]["loss"][0]
    assert not close(got[0]["weights"], exact[0]["weights"], tol=1e-4), "1-bit SGD trained exactly: was it quantized?"


def test_a_second_distribute_with_1bit_sgd_trains_on_with_it(tmp_path):
    """An exact epoch, then distribute(model, compression='1bit') again: the next epochs are 1-bit SGD (the ranks
    alike, away from the all-exact run), not the first call's options silently kept."""
    body = """
        import distkeras
        from tests.cntk import toy
        x, y = toy.data(36)
        model = distkeras.distribute(toy.model(seed=100 + toy.rank(), optimizer="sgd"))
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        if {again}:
            model = distkeras.distribute(model, compression="1bit")
        history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        toy.report(weights=model.get_weights(), history=history.history)
    """
    exact = run(tmp_path / "exact", body.format(again=False), workers=2)
    got = run(tmp_path / "1bit", body.format(again=True), workers=2)
    assert exact.returncode == 0 and got.returncode == 0, (exact, got)
    assert got.results[0]["weights"] == got.results[1]["weights"]
    assert got.results[0]["history"]["loss"][-1] < got.results[0]["history"]["loss"][0]
    assert not close(got.results[0]["weights"], exact.results[0]["weights"], tol=1e-4), "the second call's 1-bit SGD was ignored"


def test_a_dead_rank_ends_the_job_in_bounded_time(tmp_path):
    """Rank 1 is killed (SIGKILL) in the middle of training while rank 0 waits in CNTK's all-reduce: Open MPI's
    mpiexec ends the job, with an error, well within the time limit."""
    body = """
        import os, signal, time, distkeras, keras
        from tests.cntk import toy
        x, y = toy.data(600)
        model = distkeras.distribute(toy.model(seed=1))
        class Die(keras.callbacks.Callback):
            def on_batch_end(self, batch, logs=None):
                if batch == 3 and toy.rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
        model.fit(x, y, batch_size=6, epochs=50, verbose=0, callbacks=[Die()])
        toy.report(finished=True)
    """
    job = run(tmp_path, body, workers=2, timeout=120)
    assert job.returncode != 0 and job.results == {}, job
    assert "signal 9" in job.stderr or "Killed" in job.stderr, job
