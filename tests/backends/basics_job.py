"""One worker of a test job of multi-process basics, started by `distkeras launch` (see
test_multiprocess_basics.py).

    python -m tests.backends.basics_job OUT_DIR MODE

MODE:

- "unseeded": every rank builds the model from its own seed (rank 0's initial weights go to OUT_DIR/init.npz),
  distributes it and trains; every rank writes its final weights to OUT_DIR/rank{R}.npz.
- "save": every rank saves and at once loads again, ROUNDS times each: ``model.save`` + ``load_model``,
  ``save_weights`` + ``load_weights``, and ``ModelCheckpoint(save_best_only=True)`` in fit() followed by
  ``load_model`` of each epoch's best (a callback after it); each rank prints "loaded N" with the number of files it read back.
- "alone": rank 0 alone saves the model, then calls predict() and then evaluate() (the Horovod habit) and prints
  what each raised and how long it took; rank 1 stays alive outside any collective until rank 0 is through.
- "verify": every rank trains with the one-device check on and prints what it checked and found.
- "verify-mixing": a forward pass that mixes a batch's rows, checked: every rank prints the VerifyError it raised.
- "corpus-NAME": the corpus program NAME (tests/backends/corpus) with its own input pipeline, distributed over the
  job's 2 workers with the one-device check raising and the data check on (the default in a job); rank 0 pickles
  its result to OUT_DIR/result.pkl; every rank prints how many times the data check compared the workers' batches.
- "uneven": a metric tracker made on rank 0 only after distribute(), then predict() on every rank; each prints
  what predict returned or raised.
- "datacheck": every case of tests/backends/datacheck_job.py for this backend (test_datacheck.py reads its lines),
  with DISTKERAS_JOIN_TIMEOUT at its default: the job's 4 s are for "alone", which waits them out.
"""

import os
import sys
import time

import distkeras  # first: a multi-worker engine starts before the backend's first op
import keras
import numpy as np

from tests.backends import scenarios

#: Saves (and loads) of each kind in mode "save": the race this checks lost 2 jobs of 3 with one save.
ROUNDS = 3


def unseeded(out_dir, rank):
    model = scenarios.build(keras, seed=1000 + rank)  # another seed on every rank, as without any seed
    if rank == 0:
        np.savez(os.path.join(out_dir, "init.npz"), *model.get_weights())
    model = distkeras.distribute(model)
    x, y = scenarios.data(48)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    np.savez(os.path.join(out_dir, "rank{}.npz".format(rank)), *model.get_weights())


def saves(out_dir, rank):
    model = distkeras.distribute(scenarios.build(keras))
    expected = model.get_weights()
    loaded = 0
    for i in range(ROUNDS):
        path = os.path.join(out_dir, "model-{}.keras".format(i))
        model.save(path)
        same(keras.saving.load_model(path).get_weights(), expected)
        path = os.path.join(out_dir, "w-{}.weights.h5".format(i))
        model.save_weights(path)
        model.load_weights(path)
        same(model.get_weights(), expected)
        loaded += 2
    x, y = scenarios.data(48)
    path = os.path.join(out_dir, "best-{epoch}.keras")  # the loss falls every epoch: a new best file each time
    best = keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True)
    load = LoadBest(path)
    model.fit(x, y, batch_size=12, epochs=ROUNDS, shuffle=False, verbose=0, callbacks=[best, load])
    print("loaded", loaded + load.loaded)


class LoadBest(keras.callbacks.Callback):
    """After ModelCheckpoint (the callback before it) saved the epoch's best model: load it on every rank."""

    def __init__(self, path):
        super().__init__()
        self.path, self.loaded = path, 0

    def on_epoch_end(self, epoch, logs=None):
        best = keras.saving.load_model(self.path.format(epoch=epoch + 1))
        same(best.get_weights(), self.model.get_weights())
        self.loaded += 1


def same(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)


def alone(out_dir, rank):
    model = distkeras.distribute(scenarios.build(keras))
    x, y = scenarios.data(24)
    done = os.path.join(out_dir, "done")
    if rank != 0:  # alive and busy elsewhere (not in a collective) until rank 0 is through, 60 s at most
        deadline = time.time() + 60
        while not os.path.exists(done) and time.time() < deadline:
            time.sleep(0.1)
        return
    started = time.time()
    model.save(os.path.join(out_dir, "alone.keras"))  # rank 0 alone saves: it waits for nobody
    print("saved alone in {:.1f} s".format(time.time() - started))
    for name, call in (("predict", lambda: model.predict(x, verbose=0)),
                       ("evaluate", lambda: model.evaluate(x, y, verbose=0))):
        started = time.time()
        try:
            result = call()
            print("{} returned {} in {:.1f} s".format(name, np.asarray(result).shape, time.time() - started))
        except distkeras.DistKerasError as exc:
            print("{} raised {}: {} after {:.1f} s".format(name, type(exc).__name__, exc, time.time() - started))
    sys.stdout.flush()
    open(done, "w").close()


def uneven(out_dir, rank):
    """A metric tracker made on rank 0 only, after distribute() (a Horovod habit: state kept by rank 0), then
    predict() on every rank: prints what it returned or raised, and how long it took."""
    model = distkeras.distribute(scenarios.build(keras))
    if rank == 0:
        model.rank0_tracker = keras.metrics.Mean(name="rank0_tracker")
    x, _ = scenarios.data(24)
    started = time.time()
    try:
        result = model.predict(x, verbose=0)
        print("uneven predict returned {} in {:.1f} s".format(np.asarray(result).shape, time.time() - started))
    except distkeras.DistKerasError as exc:
        print("uneven predict raised {}: {} after {:.1f} s".format(type(exc).__name__, exc, time.time() - started))
    sys.stdout.flush()


def verified(out_dir, rank):
    """Trains with the check and without: prints what the check did, and whether it left any trace (every weight
    and History value bit-equal)."""
    x, y = scenarios.data(48)
    runs = []
    for verify in (True, False):
        model = distkeras.distribute(scenarios.build(keras), verify=verify)
        history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
        runs.append((model.get_weights(), history))
        if verify:
            check = model.__dict__["_distkeras_check"]
            print("checked {} found {} skipped {}".format(check.checked, len(check.found), check.skipped))
    (checked, checked_history), (plain, plain_history) = runs
    print("no trace {}".format(checked_history == plain_history and all(
        np.array_equal(a, b) for a, b in zip(checked, plain))))


def verified_mixing(out_dir, rank):
    """A forward pass that mixes a batch's rows (each row minus its batch's mean row): each replica computes it on
    its own rows, one device on the global batch. Every worker raises VerifyError at the same step."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    hidden = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    model = distkeras.distribute(model, verify=True)
    x, y = scenarios.data(48)
    try:
        model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        print("mixing trained unchecked")
    except distkeras.VerifyError as error:
        print("mixing raised VerifyError: {}".format(str(error).splitlines()[0]))


def corpus_program(out_dir, rank, name):
    """Corpus program ``name`` on the job's 2 workers (``distribute(model, 2)``: 2 devices over the job)."""
    import pickle

    from distkeras.verify import datacheck
    from tests.backends import corpus

    # The program says distribute(model, 2): two devices of one host. In a job of 2 workers of one device each the
    # user's line is distribute(model) (every device of the job); the devices a worker names are its own.
    distribute = distkeras.distribute
    distkeras.distribute = lambda model, devices=None, **options: distribute(model, **options)
    compared = []
    check = datacheck.Watch.check

    def counted(self, *args, **kwargs):
        compared.append(self.call)
        return check(self, *args, **kwargs)

    datacheck.Watch.check = counted
    try:
        got = corpus.run(name, 2)
    finally:
        datacheck.Watch.check, distkeras.distribute = check, distribute
    print("data check compared {} passes: {}".format(len(compared), " ".join(sorted(set(compared)))), flush=True)
    if rank == 0:
        with open(os.path.join(out_dir, "result.pkl"), "wb") as f:
            pickle.dump(got, f)


def datacheck(out_dir, rank):
    from distkeras.backends import agreement
    from tests.backends import datacheck_job

    saved = os.environ.pop(agreement.JOIN_TIMEOUT_ENV, None)
    try:
        datacheck_job.main(out_dir, ",".join(datacheck_job.cases(keras.backend.backend())))
    finally:
        if saved is not None:
            os.environ[agreement.JOIN_TIMEOUT_ENV] = saved


if __name__ == "__main__":
    from tests.backends.multiworker_job import run_modes

    modes = {"unseeded": unseeded, "save": saves, "alone": alone, "verify": verified,
             "verify-mixing": verified_mixing, "datacheck": datacheck, "uneven": uneven}

    def run(folder, mode):
        rank = distkeras.cluster.from_env().rank
        if mode.startswith("corpus-"):
            return corpus_program(folder, rank, mode[len("corpus-"):])
        return modes[mode](folder, rank)

    run_modes(sys.argv[1], sys.argv[2], run)
