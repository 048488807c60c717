"""distkeras.checkpoints without a framework: the random-state codec, the manifest's rules, the own-files clean-up."""

import json
import os
import random
import time

import numpy as np
import pytest

from distkeras import checkpoints
from distkeras.errors import CheckpointError


def test_random_states_round_trip_through_json_with_a_framework_byte_state():
    torch_like = np.arange(40, dtype=np.uint8)  # torch.get_rng_state() is such a byte tensor
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch_like}
    back = checkpoints.decode_random_states(checkpoints.encode_random_states(states), "r.json")
    assert back["python"] == states["python"]
    np.testing.assert_array_equal(back["numpy"][1], states["numpy"][1])
    assert back["numpy"][0] == "MT19937" and back["numpy"][2:] == states["numpy"][2:]
    np.testing.assert_array_equal(back["torch"], torch_like)
    with pytest.raises(ValueError, match="expected bytes"):
        checkpoints.encode_random_states({"torch": np.zeros(3, dtype=np.float32)})
    for bad in ('{"torch": [1, 999]}', '{"../x": []}', '{"numpy": ["PCG64", [], 0, 0, 0.0]}', "not json"):
        with pytest.raises(CheckpointError, match="r.json"):
            checkpoints.decode_random_states(bad, "r.json")


def test_manifest_fields_are_checked_one_by_one(tmp_path):
    good = {"epoch": 2, "weights": "epoch-00002.weights.h5", "sha256": "0" * 64}
    assert checkpoints.read_manifest(str(tmp_path)) is None
    (tmp_path / checkpoints.MANIFEST).write_text(json.dumps(good))
    assert checkpoints.read_manifest(str(tmp_path)) == good
    for field, value in (("weights", "sub/epoch-00002.weights.h5"), ("weights", "epoch-00002.weights.h5/.."),
                         ("weights", "epoch-00002.weights.h5\n"), ("sha256", "0" * 64 + "\n"),
                         ("random", "epoch-00002-step-000001.random.pkl"), ("step", True), ("step", -1),
                         ("steps_per_execution", 0), ("sha256", "ab")):
        (tmp_path / checkpoints.MANIFEST).write_text(json.dumps(dict(good, **{field: value})))
        with pytest.raises(CheckpointError, match=field):
            checkpoints.read_manifest(str(tmp_path))


def test_only_distkeras_files_are_removed(tmp_path):
    names = [checkpoints.MANIFEST, "epoch-00001.weights.h5", "epoch-00001-step-000004.random.json",
             ".tmp-epoch-00002.weights.h5", "notes.txt", "epoch-1.weights.h5"]
    for name in names:
        (tmp_path / name).write_text("x")
    checkpoints.remove_own_files(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-1.weights.h5", "notes.txt"]


def test_stale_temporaries_and_planted_links_are_removed_never_followed(tmp_path):
    outside = tmp_path / "victim.txt"
    outside.write_text("the user's file")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in (".tmp-checkpoint.json", ".tmp-epoch-00001.weights.h5", ".tmp-.tmp-epoch-00001.weights.h5"):
        os.symlink(str(outside), str(folder / name))
    private = folder / ".tmp-abc_1234"  # an interrupted write's private folder
    private.mkdir()
    (private / "epoch-00002.weights.h5").write_text("half")
    os.symlink(str(outside), str(private / "checkpoint.json"))
    (folder / "notes.txt").write_text("mine")
    checkpoints.remove_temporaries(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert outside.read_text() == "the user's file"


@pytest.mark.parametrize("how", ["10 GiB", "/dev/zero", "a FIFO", "a folder", "100 000 fields", "3000 fields"])
def test_a_crafted_manifest_is_an_error_in_seconds_in_bounded_memory_with_a_short_message(tmp_path, how):
    path = tmp_path / checkpoints.MANIFEST
    if how == "10 GiB":
        with open(str(path), "wb") as f:
            f.truncate(10 * 1024 ** 3)  # sparse: no disk used
    elif how == "/dev/zero":
        os.symlink("/dev/zero", str(path))
    elif how == "a FIFO":
        os.mkfifo(str(path))
    elif how == "a folder":
        path.mkdir()
    else:
        count = int(how.split(" f")[0].replace(" ", ""))
        path.write_text(json.dumps({"field{}".format(i): i for i in range(count)}))
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        checkpoints.read_manifest(str(tmp_path))
    assert time.monotonic() - started < 5
    assert str(path) in str(caught.value) and len(str(caught.value)) < 2048, str(caught.value)[:300]


@pytest.mark.parametrize("how", ["2 MiB", "a FIFO", "/dev/zero"])
def test_a_crafted_random_state_file_is_an_error_not_a_read_of_it_all(tmp_path, how):
    path = tmp_path / "epoch-00001-step-000001.random.json"
    if how == "2 MiB":
        path.write_text("[" + "1," * (1024 * 1024) + "1]")
    elif how == "a FIFO":
        os.mkfifo(str(path))
    else:
        os.symlink("/dev/zero", str(path))
    with pytest.raises(CheckpointError, match="random-state file"):
        checkpoints.read_bounded(str(path), checkpoints.MAX_RANDOM, "the random-state file")


def test_non_finite_names_the_arrays_with_nan_or_inf_a_block_at_a_time(tmp_path):
    import h5py

    path = str(tmp_path / "w.weights.h5")
    with h5py.File(path, "w") as f:
        f["layers/dense/vars/0"] = np.ones((3, 4), dtype=np.float32)
        f["layers/dense/vars/1"] = np.array([1.0, np.nan], dtype=np.float32)
        f["optimizer/vars/3"] = np.array(np.inf, dtype=np.float64)
        f["optimizer/vars/0"] = np.array(7, dtype=np.int64)
    assert checkpoints.non_finite(path) == ["layers/dense/vars/1", "optimizer/vars/3"]
    with h5py.File(path, "w") as f:
        f["big"] = np.zeros((1 << 13, 1 << 12), dtype=np.float32)  # 128 MiB, read in 64 MiB blocks
        f["big"][-1, -1] = np.inf
    assert checkpoints.non_finite(path) == ["big"]
