"""distkeras.checkpoints without a framework: the random-state codec, the manifest's rules, the own-files clean-up."""

import json
import random

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
