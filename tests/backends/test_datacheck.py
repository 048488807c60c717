"""The data check in a real job of two workers under `distkeras launch` (tests.backends.datacheck_job): every way
the workers can draw different global batches ends the job with DataError on every worker at the first step of the
pass, and data that agree (seeded, sorted, or made alike by distkeras) raise nothing.

The causes are the ones users meet: tf.data's shuffle without a seed, image_dataset_from_directory(shuffle=True)
without one, Dataset.list_files (which shuffles by default), files listed in another order, a dataset of another
length on one worker, augmentation drawn in a map from unseeded ops, arrays drawn apart before fit(), a
PyDataset reshuffled apart at an epoch's end, a generator drawing apart, predict() on an unseeded shuffle. The
input types: tf.data, NumPy arrays, PyDataset, generators and (PyTorch) DataLoader.
"""

import re

import pytest

from tests.backends.harness import BACKEND
from tests.backends import datacheck_job as job


TORCH = BACKEND == "torch"

#: What each differing case's message must say it found.
FOUND = {
    "unseeded-shuffle": "in x, y",
    "image-dir-unseeded": "in x, y",
    "list-files": "in x, y",
    "files-order": "in x, y",
    "length": "worker 1's data has 7 batches where worker 0's has 8",
    "augment": "in x. The usual causes: augmentation",
    "numpy-rank": "in x. The usual causes: augmentation",
    "pydataset-epoch2": "in x, y",
    "generator-unseeded": "in x, y",
    "predict-unseeded": "first step of predict()",
    "pipeline-unseeded": "in x, y",
    "model-shards-unseeded": "in x, y",
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """The cases' lines, ``{(rank, case): rest}``, and the job's output: the cases run as the first mode
    ("datacheck") of test_multiprocess_basics.py's shared job of 2 workers (one job start for both files)."""
    from tests.backends import test_multiprocess_basics as basics
    from tests.backends.test_multiworker import mode_output

    _, done = basics.shared(tmp_path_factory)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = {}
    for line in mode_output(done.stdout, "datacheck").splitlines():
        found = re.match(r"\[rank (\d)\] case (\S+): (.*)$", line)
        if found:
            lines[(int(found.group(1)), found.group(2))] = found.group(3)
    return lines, done.stdout + done.stderr


def results(outcome, case):
    lines, output = outcome
    got = [lines.get((rank, case)) for rank in (0, 1)]
    assert None not in got, "case {} did not finish on every worker:\n{}".format(case, output[-3000:])
    return got


@pytest.mark.parametrize("case", job.DIFFER + (job.TORCH_DIFFER if TORCH else ()))
def test_workers_drawing_different_batches_stop_with_a_data_error_on_every_worker(outcome, case):
    for result in results(outcome, case):
        assert result.startswith("DataError Expected every worker to draw the global batch one process draws"), result
        assert FOUND[case] in result, result
        assert "at the first step of" in result and "The usual causes: " in result  # where, and the usual fixes


@pytest.mark.parametrize("case", job.AGREE + (job.TORCH_AGREE if TORCH else ()))
def test_workers_drawing_the_same_batches_train_on_and_were_compared(outcome, case):
    for result in results(outcome, case):
        assert result.startswith("ok "), result
        # One comparison per pass: 2 epochs (evaluate-predict: and 2 validations, evaluate, predict).
        assert result == ("ok 6" if case == "evaluate-predict" else "ok 2"), result


def test_the_check_is_switched_off_or_warns_once_as_asked(outcome):
    assert results(outcome, "unseeded-off") == ["ok unwatched"] * 2
    assert results(outcome, "unseeded-warn") == ["ok 2"] * 2
    _, output = outcome
    assert output.count("Training goes on (check_data='warn')") == 1, output[-3000:]  # rank 0, once


def test_a_pydataset_reshuffled_apart_is_caught_at_the_epoch_it_differs(outcome):
    """TensorFlow: distkeras' own pipeline of a PyDataset calls its on_epoch_end (a reshuffle) after each pass, as
    Keras' adapter does, so the workers agree in epoch 1 and differ from epoch 2. JAX and PyTorch call it once
    before the first epoch too (Keras resets the iterator after building the model), and differ from epoch 1."""
    for result in results(outcome, "pydataset-epoch2"):
        assert "fit(), epoch {}".format(2 if BACKEND == "tensorflow" else 1) in result, result


def _watch_of_one_worker(watch_class):
    """A Watch over a job of one worker (its sum over the workers the vector itself), with this backend's way of
    noting the first batch of a pass."""
    from distkeras.backends import datawatch

    if BACKEND == "tensorflow":
        import tensorflow as tf

        from distkeras.backends.tensorflow import datacheck as tensorflow_datacheck

        return watch_class("raise", 0, 1, lambda v: v, BACKEND, wrap_adapter=tensorflow_datacheck.wrapper(tf),
                           read=tensorflow_datacheck.read)
    getter = "get_jax_iterator" if BACKEND == "jax" else "get_torch_dataloader"
    return watch_class("raise", 0, 1, lambda v: v, BACKEND, wrap_adapter=datawatch.noting_adapter(getter))


def test_keras_epoch_iterator_is_where_the_check_sees_every_pass_and_it_changes_no_result():
    """Pins the Keras privates the check wraps (``EpochIterator.__init__``, ``_enumerate_iterator``, its
    ``data_adapter`` and the adapter's getter of this backend) and shows what it does in one process: one record
    per pass (2 epochs, 2 validations, evaluate, predict), the batch's parts by name, and the same training as
    without it."""
    import numpy as np

    from distkeras.verify import datacheck
    from distkeras.backends import datawatch
    from tests.backends.harness import keras

    assert datawatch.install() and getattr(datawatch._epoch_iterator_class().__init__, "distkeras", False)
    x, y = job.samples()

    def train(watched):
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((32,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        net.compile(optimizer="adam", loss="mse")
        noted = []
        if watched:
            watch = _watch_of_one_worker(datacheck.Watch)
            note = watch.note
            watch.note = lambda parts, batches: (noted.append(([p.name for p in parts], batches)), note(parts, batches))
            datawatch.hook(net, watch)
        history = net.fit(x, y, batch_size=12, epochs=2, validation_data=(x[:24], y[:24]), verbose=0).history
        out = [net.evaluate(x, y, batch_size=12, verbose=0), net.predict(x, batch_size=12, verbose=0)]
        return history, out, net.get_weights(), noted, watch.checks if watched else None

    plain, watched = train(False), train(True)
    assert watched[0] == plain[0] and watched[1][0] == plain[1][0]
    np.testing.assert_array_equal(watched[1][1], plain[1][1])
    for a, b in zip(watched[2], plain[2]):
        np.testing.assert_array_equal(a, b)
    assert watched[4] == 6
    train_pass, validation = (["x", "y"], 8), (["x", "y"], 2)
    assert watched[3][-6:] == [train_pass, validation, train_pass, validation, (["x", "y"], 8), (["x"], 8)]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's pipeline step")
def test_the_pipeline_step_is_traced_once_for_every_dataset_of_one_structure():
    """Keras makes a new pipeline for each fit()/evaluate(): the fingerprints are traced once per process and
    structure (the cost per fit() the benchmark showed), the slot is the dataset's own, and it holds the first
    element's digests only."""
    import tensorflow as tf

    from distkeras.backends.tensorflow import datacheck as tensorflow_datacheck

    def dataset(seed):
        x = tf.random.stateless_uniform([8, 3], seed=[seed, 0])
        return tf.data.Dataset.from_tensor_slices((x, tf.range(8))).batch(4)

    digests = tensorflow_datacheck._digests(tf)
    traced = digests.experimental_get_tracing_count()  # earlier tests' structures are traced already
    slots = []
    for seed in (1, 2, 3):
        watched, slot, names = tensorflow_datacheck.watched_dataset(tf, dataset(seed))
        assert [n for n, _ in names] == ["x", "y"]
        batches = list(watched)
        assert len(batches) == 2 and batches[0][0].shape == (4, 3)
        values = slot.numpy()
        assert values[0] == 1 and list(values[2::2]) == [4, 4]  # the marker, then each part's rows
        slots.append(values)
    assert tensorflow_datacheck._digests(tf) is digests
    assert digests.experimental_get_tracing_count() - traced <= 1  # once for the structure, if it was new
    assert slots[0][1] != slots[1][1] and slots[0][1] != slots[2][1]
    again, slot, _ = tensorflow_datacheck.watched_dataset(tf, dataset(1))
    list(again)
    assert list(slot.numpy()) == list(slots[0])
