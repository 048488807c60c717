"""MXNet across processes on its own parameter server: real workers under `distkeras launch --backend mxnet`
on 127.0.0.1, a scheduler and a server beside them, training through a dist_sync KVStore.

Each job runs several cases in the same processes (each case a new model, so new KVStore keys) to keep
the suite fast: weights equal to one process at the same global batch and equal on every rank (the data check
comparing each call's arrays on the way, and raising DataError for arrays drawn apart); N workers
as MXNet's KVStore counts them; History equal to one process's; rank 0 alone prints and saves; uneven last
batches, one smaller than the number of workers, sample weights, shuffle=True and 'batch'. Two launchers on
127.0.0.1 as two nodes of one worker each. A killed worker, server or scheduler ends the job in bounded time,
naming it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.mxnet.harness import ROOT, keras  # noqa: F401 (skips without keras-mxnet)
from distkeras.launch import free_port
from tests.mxnet.cases import EVAL_BATCH, EVAL_SAMPLES, build, data, evaluate_all, fit_kwargs

STOP_TIMEOUT = 10
#: Cases of the 2-worker job: SAMPLES:BATCH:EPOCHS[:FLAGS] (tests/mxnet/cases.py: w sample weights, s shuffle=True,
#: b shuffle='batch'). 24:8 even; 29:6 a last batch of 5 (3 + 2 rows); 25:6 a last batch of 1 row (worker 1
#: steps on a copy weighted 0); 30:10 with sample weights, some 0; 29:6 shuffled; 27:7 a batch no worker count
#: divides, shuffled, weighted.
CASES_2 = ["24:8:2", "29:6:2", "25:6:1", "30:10:2:w", "29:6:3:s", "27:7:2:ws", "eval", "dropout"]
#: "eval" (both jobs): evaluate() and predict() on 10 rows in batches of 4 (sample weights; a last batch of 2, smaller
#: than 3 workers), a model never compiled, fit()'s validation_split and validation_data (tests/mxnet/cases.py).
#: "dropout": one step of a Dropout model on one row per context of the job (tests/mxnet/cases.py).
#: Last batches of 4 (2+1+1 rows) and 2 (worker 2 pads); shuffle='batch'.
CASES_3 = ["31:9:2", "20:6:1:w", "26:6:2:bw", "eval", "dropout"]
#: Cases of the 2-node job (1 worker, 1 context each): shuffled with an uneven last batch, weighted.
CASES_NODES = ["29:6:2:s", "30:10:1:w"]


def environment(contexts):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and not k.startswith("DMLC_")}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND="mxnet",
               PYTHONWARNINGS="ignore::DeprecationWarning", DISTKERAS_CPU_DEVICES=str(contexts))
    return env


def launcher(out_dir, workers, contexts, cases, extra=()):
    """A `distkeras launch --backend mxnet` of tests/mxnet/ps_job.py, started in its own session."""
    command = [sys.executable, "-m", "distkeras", "launch", "--backend", "mxnet", "--nproc-per-node", str(workers),
               "--stop-timeout", str(STOP_TIMEOUT)] + list(extra) + ["-m", "tests.mxnet.ps_job", str(out_dir),
                                                                     str(contexts)] + list(cases)
    # Its own session: on a timeout the whole job (launcher, scheduler, server, workers) is killed.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                            env=environment(contexts), cwd=ROOT, start_new_session=True)


def finish(processes, timeout):
    """Each launcher's (exit code, stdout, stderr); after ``timeout`` s every one still running is killed with
    its session, and so is every one left when this fails."""
    deadline = time.time() + timeout
    results = []
    try:
        for process in processes:
            try:
                stdout, stderr = process.communicate(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
                stderr += "\n(killed by the test after {} s)".format(timeout)
            results.append((process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    return results


def launch(out_dir, workers, contexts, cases, timeout=240, extra=()):
    started = time.time()
    (code, stdout, stderr), = finish([launcher(out_dir, workers, contexts, cases, extra)], timeout)
    return code, stdout, stderr, time.time() - started


def single_process(case):
    model = build(seed=0)
    x, y = data(int(case.split(":")[0]))
    history = model.fit(x, y, verbose=0, **fit_kwargs(case, seed=0))
    return model.get_weights(), history.history


def load(out_dir, case, rank):
    saved = np.load(os.path.join(str(out_dir), "case{}-rank{}.npz".format(case, rank)))
    with open(os.path.join(str(out_dir), "case{}-rank{}.json".format(case, rank))) as f:
        history = json.load(f)
    return [saved["arr_{}".format(i)] for i in range(len(saved.files))], history


def check_job(out_dir, workers, cases):
    for index, case in enumerate(cases):
        if case == "eval":
            check_evaluate_and_predict(out_dir, workers, index)
            continue
        if case == "dropout":
            check_dropout_masks(out_dir, workers, index)
            continue
        expected, expected_history = single_process(case)
        first, history = load(out_dir, index, 0)
        for rank in range(1, workers):
            for a, b in zip(first, load(out_dir, index, rank)[0]):
                np.testing.assert_array_equal(a, b)  # every rank the same weights, bit for bit
        assert max(float(np.abs(e - a).max()) for e, a in zip(expected, build(seed=1).get_weights())) > 0.1
        for e, a in zip(expected, first):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=case)
        # The epoch's loss and metric, as Keras averages each step's global values: one process's, also for
        # uneven last batches and sample weights (the loss weighs samples by weight, the metric does not).
        assert sorted(history) == sorted(expected_history) == ["loss", "mean_absolute_error"]
        for name in sorted(history):
            np.testing.assert_allclose(history[name], expected_history[name], rtol=1e-5, atol=1e-6, err_msg=case + name)
    seen = []
    for rank in range(workers):
        with open(os.path.join(str(out_dir), "kv-rank{}.json".format(rank))) as f:
            seen.append(json.load(f))
    # N workers, as MXNet's KVStore counts them: ps-lite numbers them itself, in its own order.
    assert sorted(s["kv_rank"] for s in seen) == list(range(workers))
    assert {(s["kv_workers"], s["kv_type"]) for s in seen} == {(workers, "dist_sync")}
    assert [s["describe"]["rank"] for s in seen] == list(range(workers))
    return seen


def check_dropout_masks(out_dir, workers, index):
    """The workers draw independent dropout masks for their rows (keras-mxnet reseeds MXNet alike on every worker
    when it builds a Dropout layer: distribute() reseeds every rank but 0 by its rank). The job has trained other
    models before this one, as a script may. Per unit, how many rows of the step kept it: with the workers' masks alike, every count is a
    multiple of the worker count; drawn independently (p=0.5, 64 units), many are not. Exactly one process's masks
    can't be drawn: MXNet's generators are per device, and one context draws all its rows' masks in one stream."""
    kept = [np.load(os.path.join(str(out_dir), "case{}-rank{}.npy".format(index, rank))) for rank in range(workers)]
    for rank in range(1, workers):
        np.testing.assert_array_equal(kept[rank], kept[0])  # one update, the same on every rank
    uneven = int((kept[0] % workers != 0).sum())
    assert uneven >= 16, kept[0]
    print("dropout: {} of 64 units kept by a number of rows that is not a multiple of {} workers".format(uneven, workers))


def batches(rows, batch):
    return [list(rows[start:start + batch]) for start in range(0, len(rows), batch)]


def check_evaluate_and_predict(out_dir, workers, index):
    """The ``eval`` case: every rank's evaluate()/predict()/validation results are one process's (and the same on
    every rank), and each rank computed only its rows [rank::workers] of each global batch (one copy of the batch's
    first row, weighted 0, where a batch has none for it)."""
    expected = evaluate_all(lambda model: model, seed=0)
    results = [dict(np.load(os.path.join(str(out_dir), "case{}-rank{}.npz".format(index, rank))))
               for rank in range(workers)]
    # The passes each rank's MXNet module computed, in order: evaluate twice, predict twice, then the validation of
    # fit(validation_split=0.25) on rows 18..23 of 24 (batch 8, 2 epochs) and of fit(validation_data=10 rows) (batch 6),
    # then evaluate and predict of the model with two outputs.
    x, _ = data(24)
    ten = batches(range(EVAL_SAMPLES), EVAL_BATCH)
    passes = ([("test", b) for b in ten * 2] + [("pred", b) for b in ten * 2] + [("test", list(range(18, 24)))] * 2
              + [("test", b) for b in batches(range(EVAL_SAMPLES), 6)] + [("test", b) for b in ten]
              + [("pred", b) for b in ten])
    for rank in range(workers):
        saved = np.load(os.path.join(str(out_dir), "case{}-rank{}-rows.npz".format(index, rank)))
        fed = [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("-")[0]))]
        phases = [k.split("-")[1] for k in sorted(saved.files, key=lambda k: int(k.split("-")[0]))]
        computed = [(phase, sorted({int(np.abs(x - row).sum(axis=1).argmin()) for row in rows}))
                    for phase, rows in zip(phases, fed)]
        mine = [(phase, sorted(set(b[rank::workers] or b[:1]))) for phase, b in passes]
        assert computed == mine, (rank, computed)
        print("rank {} computed {} of the {} rows evaluated and predicted".format(
            rank, sum(len(rows) for rows in fed), sum(len(b) for _, b in passes)))
    for rank in range(workers):  # evaluate() with other arrays on rank 1: a ShardError on every rank, naming them
        with open(os.path.join(str(out_dir), "case{}-rank{}-error.txt".format(index, rank))) as f:
            assert f.read() == ("Every worker must call evaluate() with the same full arrays, batch_size (distkeras "
                                "shards the data itself). Received (samples, batch_size) by rank: " + ", ".join(
                                    "{}: ({}, 32)".format(r, 9 if r == 1 else 10) for r in range(workers)) + ".")
    for rank in range(workers):  # sample weights leaving a context with rows of output a but none of b: every
        # rank raises in the first step, before any update (rank 0's initial weights; Keras 2 would compute 0/0
        # there, and the weights would become NaN)
        with open(os.path.join(str(out_dir), "case{}-rank{}-unweighted.txt".format(index, rank))) as f:
            moved, message = f.read().split("\n", 1)
        assert float(moved) == 0.0 and message.startswith("The sample weights of this step leave an output"), message
    for rank in range(workers):  # the data check: x drawn apart (x + rank) before fit(), caught on every rank
        with open(os.path.join(str(out_dir), "case{}-rank{}-data.txt".format(index, rank))) as f:
            message = f.read()
        assert message.startswith("Expected every worker to draw the global batch one process draws"), message
        assert "at the first step of fit() on the mxnet backend ({} workers)".format(workers) in message, message
        assert "batch differs from worker 0's in x." in message, message
    assert sorted(results[0]) == sorted(expected)
    assert any(k.startswith("split_val_") for k in expected) and any(k.startswith("data_val_") for k in expected)
    for name in sorted(expected):
        for rank in range(1, workers):
            np.testing.assert_array_equal(results[rank][name], results[0][name], err_msg=name)
        np.testing.assert_allclose(results[0][name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert results[0]["predict"].shape == (EVAL_SAMPLES, 3)

@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("mxnet-2-workers")
    return out, launch(out, 2, 2, CASES_2)


def test_two_workers_of_two_contexts_train_as_one_process(two_workers):
    out, (code, stdout, stderr, seconds) = two_workers
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    seen = check_job(out, 2, CASES_2)
    assert seen[0]["contexts"] == ["cpu(0)", "cpu(1)"]
    assert seen[0]["describe"]["replicas"] == 4 and seen[0]["describe"]["workers"] == 2
    print("2 workers x 2 contexts, {} cases: {:.1f} s".format(len(CASES_2), seconds))


def test_rank_zero_alone_prints_and_saves(two_workers, tmp_path):
    out, (code, stdout, stderr, _) = two_workers
    assert code == 0
    assert "[rank 0] Epoch 1/2" in stdout and "[rank 1] Epoch" not in stdout
    assert os.path.exists(os.path.join(str(out), "model.h5"))
    # The saved model loads in plain keras-mxnet (this process) and predicts as the workers did.
    model = keras.models.load_model(os.path.join(str(out), "model.h5"))
    x, _ = data(24)
    workers_prediction = np.load(os.path.join(str(out), "predict-rank0.npy"))
    np.testing.assert_array_equal(workers_prediction, np.load(os.path.join(str(out), "predict-rank1.npy")))
    np.testing.assert_allclose(model.predict(x), workers_prediction, rtol=1e-5, atol=1e-6)


def test_three_workers_uneven_batches_and_sample_weights(tmp_path):
    code, stdout, stderr, seconds = launch(tmp_path, 3, 1, CASES_3)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    check_job(tmp_path, 3, CASES_3)
    print("3 workers, {} cases: {:.1f} s".format(len(CASES_3), seconds))


def test_a_killed_worker_ends_the_job(tmp_path):
    code, stdout, stderr, seconds = launch(tmp_path, 2, 1, ["die"], timeout=120)
    assert code == 128 + signal.SIGKILL, stdout[-2000:] + stderr[-3000:]
    assert "rank 1 died (killed by SIGKILL); stopping the other workers" in stderr
    stopped = float(stderr.split("all workers stopped ")[1].split(" s after")[0])
    assert stopped < STOP_TIMEOUT + 5
    print("killed worker: job ended {:.1f} s after start, the rest stopped {:.1f} s after the death".format(seconds, stopped))


def test_two_nodes_of_one_worker_on_loopback(tmp_path):
    # Two launchers, as on two hosts (both on 127.0.0.1): node 0 runs the scheduler, each node a server.
    port = free_port()
    started = time.time()
    nodes = [launcher(tmp_path, 1, 1, CASES_NODES, extra=["--nnodes", "2", "--node-rank", str(node), "--coordinator",
                                                          "127.0.0.1:{}".format(port)]) for node in (0, 1)]
    results = finish(nodes, timeout=240)
    for code, stdout, stderr in results:
        assert code == 0, stdout[-3000:] + stderr[-3000:]
    check_job(tmp_path, 2, CASES_NODES)
    print("2 nodes x 1 worker, {} cases: {:.1f} s".format(len(CASES_NODES), time.time() - started))


@pytest.mark.parametrize("role,label", [("server", "server 0"), ("scheduler", "scheduler")])
def test_a_killed_parameter_server_process_ends_the_job_naming_it(tmp_path, role, label):
    code, stdout, stderr, seconds = launch(tmp_path, 2, 1, ["kill-" + role], timeout=120)
    assert code == 128 + signal.SIGKILL, stdout[-2000:] + stderr[-3000:]
    assert "{} died (killed by SIGKILL); stopping the other workers".format(label) in stderr, stderr[-3000:]
    stopped = float(stderr.split("all workers stopped ")[1].split(" s after")[0])
    assert stopped < STOP_TIMEOUT + 5
    print("killed {}: job ended {:.1f} s after start, the workers stopped {:.1f} s after".format(role, seconds, stopped))
