"""A checkpoint folder is data, never code (issue 35): what BackupAndRestore trusts in it.

Each case writes a real checkpoint with a short fit(), then changes the folder as an attacker or bad luck would,
and runs fit() again: a crafted file runs nothing, no file outside the folder is read or deleted, a corrupt or
malformed checkpoint is an error that names the file and the field (never a silent resume), and the end of a run
removes only distkeras' own files.
"""

import json
import os

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras
from tests.backends import scenarios

import distkeras
from distkeras.callbacks import MANIFEST, BackupAndRestore

pytestmark = pytest.mark.skipif(BACKEND == "torch", reason="torch runs replicas as processes: see test_preemption.py")


def _fit(folder, epochs=2, delete=False):
    model = distkeras.distribute(scenarios.build(keras), devices=2)
    x, y = scenarios.data(24)
    model.fit(x, y, batch_size=12, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(str(folder), delete_checkpoint=delete)])
    return model


def _manifest(folder):
    with open(os.path.join(str(folder), MANIFEST)) as f:
        return json.load(f)


def _write_manifest(folder, content):
    with open(os.path.join(str(folder), MANIFEST), "w") as f:
        f.write(content if isinstance(content, str) else json.dumps(content))


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    _fit(folder, epochs=1)
    manifest = _manifest(folder)
    assert set(manifest) == {"epoch", "weights", "sha256"} and manifest["epoch"] == 1
    return folder


@pytest.mark.parametrize("field, value, named", [
    ("weights", "../outside/x.weights.h5", "weights"),
    ("weights", "/abs/victim.weights.h5", "weights"),
    ("random", "/abs/victim.txt", "random"),
    ("epoch", -5, "epoch"),
    ("epoch", "1", "epoch"),
    ("sha256", None, "sha256"),
    ("surprise", 1, "fields"),
])
def test_a_malformed_manifest_is_an_error_naming_the_file_and_the_field(checkpoint, tmp_path, field, value, named):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "x.weights.h5"
    victim.write_bytes(b"the user's")
    manifest = _manifest(checkpoint)
    manifest[field] = value
    _write_manifest(checkpoint, manifest)
    with pytest.raises(distkeras.CheckpointError, match=r"{}.*{}".format(named, MANIFEST)):
        _fit(checkpoint)
    assert victim.read_bytes() == b"the user's"  # neither loaded nor deleted


@pytest.mark.parametrize("content, said", [("{\"epoch\": 1, \"weig", "Expected JSON"), ("{}", "epoch"),
                                           ("[1, 2]", "JSON object")])
def test_a_truncated_or_empty_manifest_is_an_error(checkpoint, content, said):
    _write_manifest(checkpoint, content)
    with pytest.raises(distkeras.CheckpointError, match=said):
        _fit(checkpoint)


def test_corrupt_weights_stop_the_resume_before_anything_is_loaded(checkpoint):
    """Random bytes or NaNs written over the weights file resumed silently and trained to NaN, rc 0."""
    path = os.path.join(str(checkpoint), _manifest(checkpoint)["weights"])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2: len(data) // 2 + 64] = np.full(16, np.nan, dtype="float32").tobytes()
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(distkeras.CheckpointError, match="SHA-256.*another content"):
        _fit(checkpoint)


def test_an_epoch_beyond_the_run_is_an_error(checkpoint):
    """"epoch": 99 trained 0 epochs silently."""
    manifest = _manifest(checkpoint)
    manifest["epoch"] = 99
    _write_manifest(checkpoint, manifest)
    with pytest.raises(distkeras.CheckpointError, match="at most epoch 2.*epoch 99"):
        _fit(checkpoint)


def test_random_states_are_json_and_a_crafted_pickle_runs_nothing(tmp_path):
    """A mid-epoch checkpoint's random states are JSON; a pickle that would run code where the random file is named
    is refused by name, and a .pkl file is never opened."""
    from distkeras import checkpoints

    states = {"python": __import__("random").getstate(), "numpy": np.random.get_state()}
    text = checkpoints.encode_random_states(states)
    back = checkpoints.decode_random_states(text, "x")
    assert back["python"] == states["python"]
    np.testing.assert_array_equal(back["numpy"][1], states["numpy"][1])
    __import__("random").setstate(back["python"])
    np.random.set_state(back["numpy"])
    evil = b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR."
    for bad in (evil.decode("latin-1"), '{"python": [3, "x", null]}', '{"other": 1}'):
        with pytest.raises(distkeras.CheckpointError, match="random states"):
            checkpoints.decode_random_states(bad, "x")
    assert not (tmp_path / "pwned").exists()
    assert not checkpoints.RANDOM.match("epoch-00001-step-000003.random.pkl")


def test_the_end_of_a_run_removes_only_distkeras_files(tmp_path):
    """BackupAndRestore(".") wiped the training script and data (Keras' own callback does the same)."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "train.py").write_text("print('the user's script')")
    _fit(folder, epochs=2, delete=True)
    assert sorted(os.listdir(str(folder))) == ["train.py"]
    alone = tmp_path / "alone"
    _fit(alone, epochs=1, delete=True)
    assert not alone.exists()  # a folder of its own goes with its files


def test_links_planted_at_the_temporary_names_are_never_written_through(tmp_path):
    """Issue 46: a link at a fixed temporary name made the manifest or the weights land in the file it points to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in (".tmp-checkpoint.json", ".tmp-epoch-00001.weights.h5", ".tmp-epoch-00002.weights.h5",
                 ".tmp-.tmp-epoch-00001.weights.h5", ".tmp-.tmp-epoch-00002.weights.h5"):
        os.symlink(str(victim), str(folder / name))
    _fit(folder, epochs=2)
    assert victim.read_text() == "the user's file"
    assert sorted(os.listdir(str(folder))) == [MANIFEST, "epoch-00002.weights.h5"]  # the links are gone too
    assert _manifest(folder)["epoch"] == 2


class _Poison(keras.callbacks.Callback):
    """Makes the first kernel NaN at the end of epoch ``at`` (1-based), before BackupAndRestore saves it."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.at:
            kernel = self.model.trainable_variables[0]
            kernel.assign(np.full(tuple(kernel.shape), np.nan, dtype="float32"))


def test_nan_weights_are_not_checkpointed_and_the_last_finite_checkpoint_stays(tmp_path, capfd):
    folder = tmp_path / "ckpt"
    model = distkeras.distribute(scenarios.build(keras), devices=2)
    x, y = scenarios.data(24)
    model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0,
              callbacks=[_Poison(at=2), BackupAndRestore(str(folder), delete_checkpoint=False)])
    err = capfd.readouterr().err
    assert "not checkpointed: the weights of epoch 2 hold NaN or infinite values" in err, err[-2000:]
    assert "The last checkpoint, epoch-00001.weights.h5, stays" in err
    # Epoch 3 trained on NaN weights: NaN again, not saved either; a restart resumes from epoch 1's finite weights.
    assert _manifest(folder)["epoch"] == 1 and sorted(os.listdir(str(folder))) == [MANIFEST, "epoch-00001.weights.h5"]
    resumed = distkeras.distribute(scenarios.build(keras), devices=2)
    callback = BackupAndRestore(str(folder), delete_checkpoint=False)
    resumed.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.restored_epoch == 1
    assert all(np.isfinite(w).all() for w in resumed.get_weights())


def test_sigterm_while_the_checkpoint_is_read_still_ends_the_process(checkpoint, monkeypatch):
    """The preemption handler is installed after the restore: a resume stuck reading (a slow disk, before: a FIFO)
    is ended by SIGTERM as any process is."""
    import signal

    from distkeras import checkpoints

    seen = []
    check = checkpoints.check_weights

    def spy(folder, manifest):
        seen.append(signal.getsignal(signal.SIGTERM))
        return check(folder, manifest)

    monkeypatch.setattr(checkpoints, "check_weights", spy)
    before = signal.getsignal(signal.SIGTERM)
    _fit(checkpoint)
    assert seen == [before]
