"""The shared policies (distkeras.backends.policies), without any framework: batch shares, atomic rank-0 saving,
the checks that every worker calls fit()/evaluate()/predict() alike, and random-state sync."""

import errno
import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest

from distkeras.backends import policies
from distkeras.errors import CheckpointError, ShardError
from tests.tmpfs import small_tmpfs

# ---- batch shares


def test_a_replica_weighs_its_rows_over_the_global_batch():
    assert policies.batch_share(3, 8) == 0.375
    assert policies.batch_shares([3, 3, 2]) == [0.375, 0.375, 0.25]
    assert sum(policies.batch_shares([5, 4, 4])) == pytest.approx(1.0)


def test_an_empty_replica_weighs_zero():
    assert policies.batch_share(0, 7) == 0.0
    assert policies.batch_share(None, 7) == 0.0  # no step in flight
    assert policies.batch_shares([0, 0]) == [0.0, 0.0]  # no rows at all: no division by zero
    assert policies.batch_shares([2, 0, 1], total=4) == [0.5, 0.0, 0.25]  # a process' contexts of a larger batch


def test_the_share_relative_to_an_even_split_and_the_even_share():
    assert policies.relative_share(4, 8, 2) == 1.0  # even: weight 1
    assert policies.relative_share(3, 7, 2) == pytest.approx(6 / 7)
    assert policies.relative_share(0, 5, 3) == 0.0
    assert policies.even_share(4) == 0.25


def test_the_shares_take_the_frameworks_division_inside_a_graph():
    calls = []

    def divide_no_nan(a, b):
        calls.append((a, b))
        return np.divide(a, b, out=np.zeros_like(a), where=b != 0)

    rows, total = np.array([3.0, 0.0]), np.array([8.0, 0.0])
    np.testing.assert_array_equal(policies.batch_share(rows, total, divide=divide_no_nan), [0.375, 0.0])
    np.testing.assert_array_equal(policies.relative_share(rows, total, 2, divide=divide_no_nan), [0.75, 0.0])
    assert len(calls) == 2


def test_shares_weigh_replica_means_into_the_global_mean():
    values = np.arange(13, dtype="float64")
    parts = [values[r::3] for r in range(3)]
    shares = policies.batch_shares([len(p) for p in parts])
    assert sum(s * p.mean() for s, p in zip(shares, parts)) == pytest.approx(values.mean())
    # Means the framework averages equally over the replicas, each weighed by its relative share.
    weighted = [policies.relative_share(len(p), len(values), 3) * p.mean() for p in parts]
    assert np.mean(weighted) == pytest.approx(values.mean())


# ---- rank 0 writes, atomically


class Model(object):
    """Stands in for a Keras model's save/save_weights: writes ``chunks`` to the file, failing half-way when told."""

    def __init__(self):
        self.fail = False
        self.paths = []

    def save(self, filepath, overwrite=True, **kwargs):
        self.paths.append(filepath)
        with open(filepath, "wb") as f:
            f.write(b"new-start ")
            if self.fail:
                raise RuntimeError("failed half-way")
            f.write(b"new-end")

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        self.paths.append(filepath)
        with open(filepath, "wb") as f:
            f.write(b"weights")


def test_rank0_saves_atomically_and_a_failed_save_leaves_the_previous_file(tmp_path):
    model = Model()
    policies.rank0_writes(model, 0)
    target = tmp_path / "model.keras"
    model.save(str(target))
    assert target.read_bytes() == b"new-start new-end"
    # A temporary file of the same name in a private folder, reached through its descriptor (write_atomically).
    assert model.paths[0].startswith("/proc/self/fd/") and os.path.basename(model.paths[0]) == "model.keras"
    model.fail = True
    with pytest.raises(RuntimeError, match="half-way"):
        model.save(target)  # a pathlib.Path too
    assert target.read_bytes() == b"new-start new-end"
    assert os.listdir(str(tmp_path)) == ["model.keras"]  # no temporary file left behind


class Talker(Model):
    """Stands in for a Keras model's fit/evaluate/predict: records the verbosity each call ran with."""

    def __init__(self):
        Model.__init__(self)
        self.verbosity = []

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None):
        self.verbosity.append(verbose)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto"):
        self.verbosity.append(verbose)

    def predict(self, x, batch_size=None, verbose="auto"):
        self.verbosity.append(verbose)


@pytest.mark.parametrize("backend_hook", [False, True])
def test_other_ranks_run_quietly_also_through_a_backends_own_hook(backend_hook):
    """Rank 1's fit/evaluate/predict run with verbose=0 however the call passes it, also when a backend hooked the
    method first with a plain ``(*args, **kwargs)`` wrapper (TensorFlow's PyDataset one did, and rank 1 printed)."""
    from distkeras.backends import keras_model

    model = Talker()
    if backend_hook:
        for name in ("fit", "evaluate", "predict"):
            own = getattr(model, name)
            keras_model.hook(model, name, lambda *args, _m=own, **kwargs: _m(*args, **kwargs))
    policies.rank0_speaks_and_writes(model, 1)
    model.fit([1], [1], 4, 2, 2)  # verbose=2 given by position
    model.fit(x=[1], verbose=1)
    model.evaluate([1], [1])
    model.predict([1], verbose=1)
    assert model.verbosity == [0, 0, 0, 0]
    rank0 = Talker()
    policies.rank0_speaks_and_writes(rank0, 0)
    rank0.fit([1], verbose=2)
    assert rank0.verbosity == [2]


def test_other_ranks_write_nothing_at_the_path_and_leave_nothing(tmp_path):
    model = Model()
    policies.rank0_writes(model, 1)
    model.save(str(tmp_path / "model.h5"))
    model.save_weights(str(tmp_path / "model.weights.h5"))
    assert os.listdir(str(tmp_path)) == []
    assert [os.path.basename(p) for p in model.paths] == ["model.h5", "model.weights.h5"]  # Keras still ran
    assert not any(os.path.exists(os.path.dirname(p)) for p in model.paths)  # its throwaway folders are gone


def test_folders_shards_prompts_and_file_objects_are_written_as_keras_writes_them(tmp_path):
    model = Model()
    policies.rank0_writes(model, 0)
    for path, kwargs in [("saved_model", {}), ("m.keras", {"overwrite": False}), ("m.keras", {"zipped": False}),
                         ("gs://bucket/m.keras", {})]:
        model.paths = []
        try:
            model.save(path if "://" in path else str(tmp_path / path), **kwargs)
        except OSError:
            pass  # gs:// is no local file
        assert model.paths[0].endswith(path)
    model.paths = []
    model.save_weights(str(tmp_path / "w.weights.h5"), max_shard_size=1)
    assert model.paths == [str(tmp_path / "w.weights.h5")]


def test_a_second_distribute_replaces_the_save_hooks_instead_of_wrapping_them(tmp_path, monkeypatch):
    made, mkdtemp = [], policies.tempfile.mkdtemp
    monkeypatch.setattr(policies.tempfile, "mkdtemp", lambda **kwargs: made.append(kwargs) or mkdtemp(**kwargs))
    model = Model()
    policies.rank0_writes(model, 0)
    policies.rank0_writes(model, 0)
    model.save(str(tmp_path / "m.keras"))
    assert len(model.paths) == 1 and len(made) == 1  # one write_atomically, not one inside another


def test_write_atomically_returns_what_the_writer_returns(tmp_path):
    target = str(tmp_path / "checkpoint.json")

    def write(path):
        with open(path, "w") as f:
            f.write("{}")
        return "done"

    assert policies.write_atomically(target, write) == "done"
    assert os.listdir(str(tmp_path)) == ["checkpoint.json"]


# ---- every worker calls fit()/evaluate()/predict() alike


class Job(object):
    """A job's float32 all-sum over ``rows`` (each worker's values, by rank): the sum of the table every worker
    fills in its row of."""

    def __init__(self, rows):
        self.rows = rows

    def all_sum(self, vector):
        table = np.asarray(vector, "float32").reshape(len(self.rows), -1, 2).copy()
        for rank, values in enumerate(self.rows):
            table[rank] = policies.encode_call(values)
        return table.ravel()


def test_equal_calls_pass():
    values = policies.array_call_values(24, None)
    assert values == [("samples", 24), ("batch_size", 32)]
    policies.check_same_everywhere(Job([values, values]).all_sum, 0, 2, "evaluate", values)


def test_different_calls_raise_a_shard_error_that_says_what_each_rank_passed():
    mine = policies.array_call_values(24, 8) + [(name, policies.fit_code(name, value)) for name, value in (
        ("epochs", 2), ("shuffle", "batch"), ("validation_samples", None), ("validation_split", 0.25))]
    theirs = [("samples", 23)] + mine[1:]
    with pytest.raises(ShardError) as caught:
        policies.check_same_everywhere(Job([mine, theirs]).all_sum, 0, 2, "fit", mine)
    assert str(caught.value) == (
        "Every worker must call fit() with the same full arrays, batch_size, epochs, shuffle, validation_samples and "
        "validation_split (distkeras shards the data itself). Received (samples, batch_size, epochs, shuffle, "
        "validation_samples, validation_split) by rank: 0: (24, 8, 2, 'batch', None, 0.25), "
        "1: (23, 8, 2, 'batch', None, 0.25).")


def test_the_codes_survive_a_float32_sum_exactly():
    values = [("samples", 10 ** 7 + 1), ("batch_size", 4097), ("validation_samples", -1)]
    pairs = np.asarray(policies.encode_call(values), "float32")
    assert policies.decode_call(pairs) == [10 ** 7 + 1, 4097, -1]
    assert [policies.fit_code("shuffle", v) for v in (False, True, "batch")] == [0, 1, 2]


# ---- random-state sync


def test_every_rank_takes_rank0s_random_states():
    """Rank 1 of two, its broadcast made of a float32 sum (as MXNet's is): rank 0's states, exactly."""
    random.seed(0)
    np.random.seed(0)
    np.random.randn(1)  # a cached Gaussian in NumPy's state too
    rank0 = policies.random_states()
    sent = []  # the vector rank 0 adds to the sum
    policies.broadcast_by_sum(lambda vector: sent.append(vector) or vector, 0)(pickle.dumps(rank0, protocol=2))
    random.seed(1)
    np.random.seed(1)
    policies.sync_random_state(policies.broadcast_by_sum(lambda vector: sent[0] + vector, 1))
    assert random.getstate() == rank0["python"]
    after = np.random.get_state()
    np.testing.assert_array_equal(after[1], rank0["numpy"][1])
    assert after[2:] == rank0["numpy"][2:]


def test_a_framework_state_travels_along():
    held = {"state": b"rank 1"}
    framework = (lambda: held["state"], lambda state: held.update(state=state))
    rank0 = pickle.dumps(dict(policies.random_states(), framework=b"rank 0"), protocol=2)
    policies.sync_random_state(lambda data: rank0, framework)
    assert held["state"] == b"rank 0"


def test_the_epoch_callback_takes_rank0s_states_and_goes_last():
    rank0 = pickle.dumps(dict(policies.random_states(), python=random.Random(0).getstate()), protocol=2)
    callback = policies.every_epoch(object, lambda data: rank0)
    random.seed(1)
    callback.on_epoch_begin(0)
    assert random.getstate() == random.Random(0).getstate()
    mine = object()
    assert policies.with_callback(None, callback) == [callback]
    assert policies.with_callback((mine,), callback) == [mine, callback]
    assert policies.with_callback(object(), callback) is None  # a CallbackList: left as the user made it


def test_a_broadcast_by_sum_refuses_more_bytes_than_it_carries():
    with pytest.raises(ValueError, match="at most 4 bytes"):
        policies.broadcast_by_sum(lambda v: v, 0, size=4)(b"12345")


def test_the_policies_import_no_framework():
    code = ("import sys; from distkeras.backends import policies; "
            "print(sorted(m for m in ('tensorflow', 'jax', 'torch', 'mxnet', 'cntk', 'keras') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.stdout.strip() == "[]", done.stderr


# --- a full disk during a save: a clear CheckpointError, the previous file intact, no temporary left -----------

def _full_disk_write(path):
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.parametrize("raised", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    # h5py's error of a failed HDF5 write: the C errno only in the text
    OSError("Can't synchronously write data (file write failed: time = ..., filename = '.tmp-w.weights.h5', file "
            "descriptor = 3, errno = 28, error message = 'No space left on device', buf = 0x7f, total write size = "
            "1356488, bytes this sub-write = 1356488, offset = 1052672)"),
], ids=["ENOSPC", "EDQUOT", "h5py"])
def test_a_full_disk_during_a_checkpoint_write_is_a_clear_checkpoint_error(tmp_path, raised):
    target = tmp_path / "epoch-00003.weights.h5"
    target.write_bytes(b"the previous checkpoint")

    def write(path):
        with open(path, "wb") as f:
            f.write(b"y" * 2048)
        raise raised

    with pytest.raises(CheckpointError) as info:
        policies.write_atomically(str(target), write)
    message = str(info.value)
    with pytest.raises(CheckpointError, match="writing epoch-00003.weights.h5 failed"):  # BackupAndRestore's nesting
        policies.write_atomically(str(tmp_path / ".tmp-epoch-00003.weights.h5"), write)
    assert "The disk is full: writing epoch-00003.weights.h5 failed in {} (No space left on device; 2.0 KiB " \
           "written".format(tmp_path) in message, message
    assert "The previous checkpoint (or file) there is intact" in message and "Free space on that disk" in message
    assert info.value.errno == errno.ENOSPC and info.value.__cause__ is raised
    if "total write size" in str(raised):
        assert "the write that failed needed 1.3 MiB more" in message
    assert target.read_bytes() == b"the previous checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-00003.weights.h5"]  # no .tmp- file left


def test_other_write_errors_stay_what_they_are(tmp_path):
    def write(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    with pytest.raises(PermissionError):
        policies.write_atomically(str(tmp_path / "w.weights.h5"), write)
    assert list(tmp_path.iterdir()) == []


def test_a_real_full_disk_is_a_clear_checkpoint_error(tmp_path):
    """A 1 MiB tmpfs, mounted where this test may (root, and mounts permitted), filled by a 2 MiB write."""
    with small_tmpfs(tmp_path / "small") as small:
        (small / "checkpoint.json").write_text('{"epoch": 1}')

        def write(path):
            with open(path, "wb") as f:
                for _ in range(32):
                    f.write(b"z" * 65536)

        with pytest.raises(CheckpointError, match=r"The disk is full: writing checkpoint.json failed in {}".format(
                small)) as info:
            policies.write_atomically(str(small / "checkpoint.json"), write)
        assert "0 bytes free on that file system" in str(info.value)
        assert (small / "checkpoint.json").read_text() == '{"epoch": 1}'
        assert sorted(p.name for p in small.iterdir()) == ["checkpoint.json"]


def test_arguments_reach_a_name_a_method_takes_in_its_kwargs():
    """keras_model.Arguments: a KerasHub task's fit(x, y, ..., **kwargs) takes verbose and callbacks in **kwargs;
    read and set by name they reach the call (BoundArguments.arguments would drop a name the signature lacks)."""
    import inspect

    from distkeras.backends.keras_model import Arguments

    def keras_fit(x=None, y=None, verbose="auto", callbacks=None, shuffle=True):
        return locals()

    def hub_fit(x=None, y=None, batch_size=None, **kwargs):
        return keras_fit(x, y, **kwargs)

    for fit in (keras_fit, hub_fit):
        bound = Arguments(inspect.signature(fit), (1, 2), {"callbacks": ["mine"]})
        assert bound.get("verbose", "auto") == "auto" and bound.get("callbacks") == ["mine"]
        assert bound.get("shuffle", True) is True
        bound.set("verbose", 0)
        bound.set("callbacks", ["ours"] + bound.get("callbacks"))
        called = fit(*bound.args, **bound.kwargs)
        assert (called["verbose"], called["callbacks"], called["x"], called["y"]) == (0, ["ours", "mine"], 1, 2)
    bound = Arguments(inspect.signature(keras_fit), (), {"shuffle": False})
    assert bound.get("shuffle", True) is False


def test_write_atomically_follows_no_link_planted_in_the_folder_or_in_place_of_its_private_folder(tmp_path):
    """Someone who can write the folder plants links at the names writes used to take (``.tmp-<name>``), and, while
    a write runs, moves its private folder away and puts a link to a folder of theirs in its place: the write still
    lands in the target and nothing outside the folder is touched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("the user's file")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(str(victim), str(folder / ".tmp-checkpoint.json"))
    os.symlink(str(victim), str(folder / "checkpoint.json"))  # even at the target's own name: replaced, not followed

    def write(path):
        private = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()][0]
        os.rename(str(private), str(folder / "moved"))
        os.symlink(str(outside), str(private))
        with open(path, "w") as f:
            f.write('{"epoch": 1}')

    policies.write_atomically(str(folder / "checkpoint.json"), write)
    assert victim.read_text() == "the user's file" and sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert (folder / "checkpoint.json").read_text() == '{"epoch": 1}' and not (folder / "checkpoint.json").is_symlink()
