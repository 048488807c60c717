"""Per-batch logs on PyTorch: what ``on_train_batch_end`` / ``on_test_batch_end`` callbacks, the progress bar,
``train_on_batch`` and ``test_on_batch`` see are one device's values at the same global batch, on every rank.

Real torch.distributed (gloo on 127.0.0.1), bodies run on every rank of a 2-process worker job
(``harness.job``), each compared with plain Keras fitting the same model on the same data.
"""

import numpy as np
import pytest

from tests.backends.harness import BatchLogs as Recorder, BACKEND, job, keras
from tests.backends import scenarios

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch adapter tests (KERAS_BACKEND=torch)")

#: Hard limit for one multi-process run (start-up of every process included).
TIMEOUT = 240
#: How far a distributed per-batch value may be from one device's (float32 sums in another order).
TOLERANCE = 1e-6


def classifier(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class OwnLogs(keras.Sequential):
    """A custom ``train_step`` as the Keras guide writes it on PyTorch, logging the model's metrics and a scalar
    of its own (this batch's loss, not a running mean)."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        logs = {m.name: m.result() for m in self.metrics}
        logs["batch_loss"] = loss
        return logs


def custom(seed=0):
    keras.utils.set_random_seed(seed)
    model = OwnLogs([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    return model


def build(kind):
    return {"regression": scenarios.build, "classification": classifier, "custom": custom}[kind](
        *([keras] if kind == "regression" else []))


def dataset(kind, samples):
    x, y = scenarios.data(samples)
    if kind == "classification":
        y = np.argmax(y, axis=1).astype("int32")
    return x, y


# ---- bodies run on every rank of a job


def batch_logs(devices, kind, samples, batch):
    """Every batch's logs in fit() (train and validation batches) and in evaluate(), for one device and for
    ``devices`` replicas: ``(single, distributed)``, each ``(fit train, fit validation, evaluate)``."""
    x, y = dataset(kind, samples)
    runs = []
    for replicas in (1, devices):
        model = build(kind)
        if replicas > 1:
            model = distkeras.distribute(model, devices=replicas)
        recorder = Recorder()
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[recorder],
                  validation_data=(x[: samples // 2], y[: samples // 2]))
        fitted = (recorder.train, recorder.test)
        recorder = Recorder()
        model.evaluate(x, y, batch_size=batch, verbose=0, callbacks=[recorder])
        runs.append(fitted + (recorder.test,))
    return runs


def on_batch(devices, kind, samples):
    """What train_on_batch() and test_on_batch() return for one whole batch: one device's, then distributed."""
    x, y = dataset(kind, samples)
    runs = []
    for replicas in (1, devices):
        model = build(kind)
        if replicas > 1:
            model = distkeras.distribute(model, devices=replicas)
        trained = [model.train_on_batch(x, y, return_dict=True) for _ in range(2)]
        runs.append((trained, model.test_on_batch(x, y, return_dict=True)))
    return runs


# ---- tests


def assert_same_logs(expected, actual):
    assert len(actual) == len(expected) and expected
    for step, (one, many) in enumerate(zip(expected, actual)):
        assert set(one) == set(many), step
        for name in one:
            assert abs(many[name] - one[name]) < TOLERANCE, (step, name, one[name], many[name])


@pytest.mark.parametrize("kind", ["regression", "classification", "custom"])
@pytest.mark.parametrize(
    "samples,batch",
    [
        (48, 12),  # every batch splits evenly: 6 + 6
        (49, 12),  # last batch of 1: rank 1 has nothing in that step (a stand-in with weight zero)
        (46, 12),  # last batch of 10: 5 + 5, a smaller share than the others
    ],
)
def test_batch_logs_are_one_devices(kind, samples, batch):
    outcomes = job(2).run(batch_logs, 2, kind, samples, batch, timeout=TIMEOUT)
    for outcome in outcomes:  # every rank's callbacks see the same values: one device's
        single, distributed = outcome.result
        for expected, actual in zip(single, distributed):
            assert_same_logs(expected, actual)


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_train_and_test_on_batch_return_one_devices_logs(kind):
    outcomes = job(2).run(on_batch, 2, kind, 13, timeout=TIMEOUT)
    for outcome in outcomes:
        (single_train, single_test), (trained, tested) = outcome.result
        assert_same_logs(single_train, trained)
        assert_same_logs([single_test], [tested])


def quiet_fit_and_local_logs(devices):
    """Epoch logs of a fit() nothing reads per batch (verbose=0 and 2: no per-batch all-reduce), per-batch logs
    with ``batch_logs="local"`` (this rank's own), and History of both, against one device's."""
    x, y = dataset("regression", 46)
    single = build("regression")
    expected = single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    histories = []
    for verbose in (0, 2):
        model = distkeras.distribute(build("regression"), devices=devices)
        histories.append(model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=verbose).history)
    model = distkeras.distribute(build("regression"), devices=devices, batch_logs="local")
    recorder = Recorder()
    histories.append(model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0, callbacks=[recorder]).history)
    return expected, histories, recorder.train


def test_epoch_logs_stay_one_devices_without_per_batch_logs_and_local_logs_are_the_ranks_own():
    outcomes = job(2).run(quiet_fit_and_local_logs, 2, timeout=TIMEOUT)
    for outcome in outcomes:
        expected, histories, local = outcome.result
        for history in histories:
            for name, values in expected.items():
                np.testing.assert_allclose(history[name], values, rtol=1e-5, atol=1e-6)
    # "local": each rank's own running values over its rows, which differ between the ranks
    assert outcomes[0].result[2][0]["loss"] != outcomes[1].result[2][0]["loss"]


@pytest.mark.parametrize("value", ["rank0", None, True])
def test_batch_logs_takes_global_or_local(value):
    model = build("regression")
    with pytest.raises(distkeras.errors.OptionError, match=r"batch_logs in \('global', 'local'\)"):
        distkeras.distribute(model, devices=2, batch_logs=value)


def reductions(devices):
    """How often the metric states were all-reduced in a 4-step fit() of 2 epochs: nothing reading each batch
    (verbose 0, then 2), then a callback reading them."""
    from distkeras.backends.torch import collectives

    x, y = dataset("regression", 48)
    model = distkeras.distribute(build("regression"), devices=devices)
    calls = []
    reduce_states = collectives.all_reduce_states

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce_states(*args, **kwargs)

    collectives.all_reduce_states = counted
    counts = []
    try:
        for verbose, callbacks in ((0, []), (2, [keras.callbacks.EarlyStopping(patience=5)]), (0, [Recorder()])):
            del calls[:]
            model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=verbose, callbacks=callbacks)
            counts.append(len(calls))
    finally:
        collectives.all_reduce_states = reduce_states
    return counts


def test_no_per_batch_reduction_where_nothing_reads_batch_logs():
    for outcome in job(2).run(reductions, 2, timeout=TIMEOUT):
        assert outcome.result == [2, 2, 2 * 4 + 2]  # one per epoch; one per step more with a reader


class Lambda(keras.callbacks.LambdaCallback):
    pass


@pytest.mark.parametrize(
    "callbacks,verbose,train,reads",
    [
        ([], 0, True, False),
        ([], 2, True, False),  # Keras' bar at verbose=2 prints epoch logs only
        ([], "auto", True, True),
        ([], 1, False, True),
        ([keras.callbacks.History(), keras.callbacks.EarlyStopping(), keras.callbacks.CSVLogger("x.csv")], 0, True,
         False),
        ([Recorder()], 0, True, True),
        ([Recorder()], 0, False, True),
        ([keras.callbacks.TerminateOnNaN()], 0, True, True),  # on_batch_end
        ([keras.callbacks.TerminateOnNaN()], 0, False, False),
        ([keras.callbacks.LambdaCallback(on_epoch_end=print)], 0, True, False),
        ([keras.callbacks.LambdaCallback(on_train_batch_end=print)], 0, True, True),
        ([Lambda(on_test_batch_end=print)], 0, False, True),
        ([keras.callbacks.ProgbarLogger()], 1, True, True),
        ([keras.callbacks.ProgbarLogger()], 0, True, False),
    ],
)
def test_which_callbacks_read_batch_logs(callbacks, verbose, train, reads):
    from distkeras.backends.torch import trainer

    assert trainer._batch_logs_read(callbacks, verbose, train) is reads


def test_the_progress_bar_of_fit_shows_no_validation_batch():
    """fit() hands its CallbackList to its validation's evaluate(); Keras' bar there (``_called_in_fit``, a
    Keras private that decides it) shows no validation batch, and evaluate()'s own bar shows each."""
    from distkeras.backends.torch import trainer

    for verbose, reads in ((1, True), (0, False)):
        callbacks = keras.callbacks.CallbackList([], add_progbar=True, verbose=verbose, epochs=1, steps=2)
        assert trainer._batch_logs_read(callbacks, 0, train=False) is reads
        assert trainer._batch_logs_read(callbacks, 0, train=True) is reads
    callbacks.on_train_begin()
    callbacks.callbacks[-1].verbose = 1
    assert trainer._batch_logs_read(callbacks, 0, train=False) is False
