"""Multi-process basics as a new user meets them under `distkeras launch --nproc-per-node 2`, on the backend's own
engine over 127.0.0.1 (jobs: basics_job.py): a model built from another seed on every rank trains from rank 0's
values; a save returns on every rank once the file is complete; predict()/evaluate() on one rank only end within
seconds with an error saying to call them on every rank."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.backends import basics_job, scenarios
from tests.backends.harness import BACKEND, keras
from tests.backends.test_multiworker import mode_output
from tests.full import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Seconds every rank has to join predict()/evaluate() in these jobs (DISTKERAS_JOIN_TIMEOUT; default 60).
JOIN_TIMEOUT = 4
#: The bound on a whole job: a hang fails the test here (subprocess.run kills the launcher, whose workers die
#: with it: PR_SET_PDEATHSIG), never waits for the engine's own timeout.
JOB_TIMEOUT = 150


def launch(out_dir, mode, timeout=JOB_TIMEOUT):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=BACKEND,
               DISTKERAS_JOIN_TIMEOUT=str(JOIN_TIMEOUT))
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "--backend", BACKEND,
               "--stop-timeout", "5", "-m", "tests.backends.basics_job", str(out_dir), mode]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    return done, time.time() - started


#: Corpus programs (tests/backends/corpus) run across the job's 2 workers, each with its own input pipeline: arrays
#: with validation data, a Python generator for fit() and its validation, class and sample weights over two fit()s.
#: By default one of the three a backend, taken in turn (what runs across the workers is the same code for every
#: program, their input pipelines are what differ); the full run takes all three on every backend, and more.
CORPUS = ("text_classification_from_scratch", "trainer_validation_data_infinite_generator",
          "training_class_and_sample_weights")
if FULL:
    CORPUS += ("sequential_model", "writing_your_own_callbacks", "subclassing_vae", "demo_mnist_convnet",
               "basic_full_flow", "trainer_stop_loop")
else:
    LIVE = ("tensorflow", "jax", "torch")
    CORPUS = (CORPUS[LIVE.index(BACKEND)],) if BACKEND in LIVE else CORPUS[:1]
#: Modes that share one job of 2 workers, run in turn in the same processes (the job's start costs more than they do).
#: test_datacheck.py's cases come first ("datacheck", as in a fresh process: no global seed set yet, which would make
#: the unseeded draws agree), "alone" last: after it rank 0 has had two collective calls fail (rank 1 never joined
#: them), and nothing runs after it but the job's end.
SHARED = ("datacheck", "unseeded", "save", "verify", "verify-mixing") + tuple("corpus-" + name for name in CORPUS) + (
    "uneven", "alone")
#: The bound on the data-check cases (test_datacheck.py) in the shared job.
DATACHECK_TIMEOUT = 420
_JOB = {}


def shared(tmp_path_factory):
    """``(folder, done)``: the shared job, launched once a pytest process (this module's tests and test_datacheck.py's
    read it)."""
    if "job" not in _JOB:
        out = tmp_path_factory.mktemp("shared")
        # a corpus program's bound: 60 s; "alone"'s: 60 s (two waits of JOIN_TIMEOUT, and rank 1's wait for it)
        done, _ = launch(out, ",".join(SHARED), JOB_TIMEOUT + 60 * len(CORPUS) + 60 + DATACHECK_TIMEOUT)
        _JOB["job"] = out, done
    return _JOB["job"]


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    return shared(tmp_path_factory)


def part(shared_job, mode):
    """``(folder, done, output)``: ``mode``'s folder in the shared job, the job, and its lines (``mode_output``)."""
    out, done = shared_job
    assert done.returncode == 0, shown(done)
    return os.path.join(str(out), mode), done, mode_output(done.stdout, mode)


def shown(done):
    return done.stdout[-4000:] + done.stderr[-4000:]


def weights(path):
    saved = np.load(path)
    return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


def test_ranks_built_from_different_seeds_train_from_rank_0s_values(shared_job):
    """Each rank builds its model from its own seed (as a script that seeds nothing does). JAX refused such a
    model in distribute() (device_put's "not the same on each process", printing the arrays); now every backend
    takes rank 0's values, and both ranks end where one device ends from rank 0's initial weights."""
    tmp_path, done, _ = part(shared_job, "unseeded")
    assert "not the same on each process" not in done.stdout + done.stderr
    model = scenarios.build(keras)
    model.set_weights(weights(os.path.join(str(tmp_path), "init.npz")))
    x, y = scenarios.data(48)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    r0, r1 = (weights(os.path.join(str(tmp_path), "rank{}.npz".format(r))) for r in (0, 1))
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    for expected, actual in zip(model.get_weights(), r0):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_every_rank_loads_what_it_just_saved(shared_job):
    """save()+load_model(), save_weights()+load_weights() and ModelCheckpoint(save_best_only=True) followed by
    load_model() of the best, on every rank, several times each: rank 1 returned from save() before rank 0 had
    written the file ("File not found" in 2 jobs of 3 with a single save)."""
    tmp_path, done, out = part(shared_job, "save")
    files = 3 * basics_job.ROUNDS
    assert "[rank 0] loaded {}".format(files) in out and "[rank 1] loaded {}".format(files) in out, shown(done)
    assert not [name for name in os.listdir(str(tmp_path)) if name.startswith(".tmp-")]


def test_predict_and_evaluate_on_one_rank_only_end_within_seconds_saying_what_to_do(shared_job):
    """Rank 0 alone saves, then calls predict(), then evaluate() (the Horovod habit); rank 1 stays alive elsewhere. The
    save returns at once; predict and evaluate each raise a CollectiveError after DISTKERAS_JOIN_TIMEOUT seconds,
    never the engine's 30-minute wait. The last mode of the shared job (the job ends after it, rank 0's two failed
    calls and all: the shared job's exit status 0 is asserted in ``part``)."""
    tmp_path, done, out = part(shared_job, "alone")
    saved = re.search(r"\[rank 0\] saved alone in ([0-9.]+) s", out)  # a save on rank 0 alone waits for nobody
    assert saved and float(saved.group(1)) < JOIN_TIMEOUT, shown(done)
    assert os.path.exists(os.path.join(str(tmp_path), "alone.keras"))
    for call in ("predict", "evaluate"):
        found = re.search(r"\[rank 0\] {} raised CollectiveError: (.*) after ([0-9.]+) s".format(call), out)
        assert found, shown(done)
        message, seconds = found.group(1), float(found.group(2))
        assert JOIN_TIMEOUT <= seconds < JOIN_TIMEOUT + 10, seconds
        assert "Rank 0 called {}(), rank 1 did not within {} s (DISTKERAS_JOIN_TIMEOUT)".format(
            call, JOIN_TIMEOUT) in message
        assert "Call {}() on every rank".format(call) in message


def test_variables_made_on_one_rank_only_are_a_collective_error_naming_them_never_a_wait(shared_job):
    """Issue 52: a metric tracker made on rank 0 only made predict() wait forever on PyTorch (rank 0 broadcast its
    new variables, rank 1 had none to broadcast). Every rank now raises the same CollectiveError at once, naming the
    variables (JAX's Gloo aborted both processes: "Received data size doesn't match expected size"). TensorFlow
    keeps a metric's variables out of predict() and returns."""
    _, done, out = part(shared_job, "uneven")
    for rank in (0, 1):
        if BACKEND in ("torch", "jax"):
            found = re.search(r"\[rank {}\] uneven predict raised CollectiveError: (.*) after ([0-9.]+) s".format(rank),
                              out)
            assert found, shown(done)
            assert "rank 0 has 2 the others lack (rank0_tracker/count" in found.group(1), found.group(1)
            assert "make it on every rank" in found.group(1) and float(found.group(2)) < JOIN_TIMEOUT
        else:
            assert "[rank {}] uneven predict returned (24, 3)".format(rank) in out, shown(done)


def test_the_one_device_check_runs_across_worker_processes(shared_job):
    """Every worker gathers the global batch (its rows are on the other worker too: TensorFlow's collective
    gather, JAX's process_allgather, torch.distributed's) and replays the step on a device of its own: the check
    ran on both ranks, found nothing and left no trace (weights and History bit-equal to a run without it), where
    on TensorFlow it used to switch itself off."""
    _, done, out = part(shared_job, "verify")
    for rank in (0, 1):
        assert "[rank {}] checked 1 found 0 skipped None".format(rank) in out, shown(done)
        assert "[rank {}] no trace True".format(rank) in out, shown(done)


def test_the_check_across_workers_catches_a_batch_mixing_forward_pass_on_every_worker(shared_job):
    """Each row minus its batch's mean row: TensorFlow's and PyTorch's replicas compute it on their own rows, and
    every worker raises VerifyError at the same step (none is left waiting). JAX runs one program over the global
    batch, which computes it exactly: nothing to catch."""
    _, done, out = part(shared_job, "verify-mixing")
    for rank in (0, 1):
        if BACKEND == "jax":
            assert "[rank {}] mixing trained unchecked".format(rank) in out, shown(done)
        else:
            assert "[rank {}] mixing raised VerifyError: distkeras' one-device check".format(rank) in out, shown(done)


@pytest.mark.parametrize("name", CORPUS)
def test_a_corpus_program_trains_across_worker_processes_as_on_one_device(shared_job, name):
    """An outside program as written, its own input pipeline included, under `distkeras launch` on 2 workers with the
    one-device check raising and the data check on (the default in a job): rank 0's weights, optimizer state,
    History, evaluate() and predict() are one device's, 2 replicas ran (read from the framework), and the data
    check compared the workers' batches on both ranks without a word."""
    import pickle

    from tests.backends import corpus
    from tests.backends.test_corpus import differences, without_noise_steps
    from tests.backends.test_realcode import assert_same_results

    folder, done, out = part(shared_job, "corpus-" + name)
    for rank in (0, 1):
        compared = re.search(r"\[rank {}\] data check compared (\d+) passes: ([a-z ]*)".format(rank), out)
        assert compared and int(compared.group(1)) >= 1 and "fit" in compared.group(2).split(), shown(done)
    with open(os.path.join(folder, "result.pkl"), "rb") as f:
        got = pickle.load(f)
    assert got["replicas"][0] == 2, got["replicas"]
    program = corpus.PROGRAMS[name]
    expected = corpus.run(name, 1)
    got = without_noise_steps(expected, got, program.tolerance)
    differ = differences(expected, got, program.tolerance)
    assert not differ, "{} across 2 workers differs from one device: {}".format(name, "; ".join(differ))
    assert_same_results(expected, got, program.tolerance)
