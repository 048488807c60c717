import numpy as np
import pytest

from distkeras import ShardError, shard, shard_bounds
from distkeras.sharding import global_batch_size, shard_size


def test_block_bounds_match_the_cntk_recipe_for_every_size_up_to_1000_by_16():
    for workers in range(1, 17):
        for n in range(0, 1001):
            bounds = [shard_bounds(n, r, workers) for r in range(workers)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            for (s0, e0), (s1, _) in zip(bounds, bounds[1:]):
                assert e0 == s1  # contiguous, disjoint, in order
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert bounds == [(r * n // workers, min((r + 1) * n // workers, n)) for r in range(workers)]


@pytest.mark.parametrize("mode", ["block", "interleave"])
@pytest.mark.parametrize("n,workers", [(0, 3), (1, 3), (10, 3), (101, 4), (7, 7), (5, 8)])
def test_shards_are_disjoint_and_cover_every_sample(mode, n, workers):
    data = np.arange(n)
    pieces = [shard(data, r, workers, mode=mode) for r in range(workers)]
    assert sorted(np.concatenate(pieces).tolist()) == list(range(n))
    assert [len(p) for p in pieces] == [shard_size(n, r, workers, mode) for r in range(workers)]


def test_interleave_is_strided():
    assert shard(list(range(10)), 1, 3, mode="interleave") == [1, 4, 7]


def test_structures_are_sharded_together():
    x, y = np.arange(10).reshape(10, 1), np.arange(10)
    xs, ys = shard((x, y), rank=1, workers=2)
    assert xs[:, 0].tolist() == ys.tolist() == [5, 6, 7, 8, 9]
    got = shard({"a": x, "b": [y, y]}, rank=0, workers=2)
    assert got["a"].shape == (5, 1) and got["b"][1].tolist() == [0, 1, 2, 3, 4]


def test_rank_and_workers_default_to_the_launch_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert shard(list(range(4))) == [2, 3]


@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=2, workers=2), "0 <= rank < workers"),
    (dict(rank=0, workers=0), "workers >= 1"),
    (dict(rank=0, workers=2, mode="random"), "mode in"),
    (dict(rank=0.5, workers=2), "Expected an int for rank"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ShardError, match=match):
        shard(list(range(4)), **kwargs)


def test_unequal_lengths():
    with pytest.raises(ShardError, match=r"same number of samples.*\[3, 4\]"):
        shard((np.zeros(3), np.zeros(4)), 0, 2)


def test_global_batch_size():
    assert global_batch_size(32, 3) == 96
    with pytest.raises(ValueError):
        global_batch_size(0, 2)
