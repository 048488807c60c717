import numpy as np
import pytest

from distkeras import ShardError, shard, shard_bounds
from distkeras.sharding import batch_rows, fit_on_arrays, global_batch_size, num_samples, parts, select, shard_size


def test_block_bounds_match_the_cntk_recipe_for_every_size_up_to_1000_by_16():
    for workers in range(1, 17):
        for n in range(0, 1001):
            bounds = [shard_bounds(n, r, workers) for r in range(workers)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            for (_s0, e0), (s1, _) in zip(bounds, bounds[1:]):
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


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5, 12, 13, 36, 37, 41])
@pytest.mark.parametrize("batch_per_worker", [1, 2, 3])
def test_every_worker_takes_the_same_steps_and_the_loss_weights_add_up_to_the_global_batch(n, workers, batch_per_worker):
    batch = batch_per_worker * workers
    plans = [batch_rows(n, batch, rank, workers) for rank in range(workers)]
    steps = [[(rows[i:i + batch_per_worker], None if w is None else w[i:i + batch_per_worker])
              for i in range(0, len(rows), batch_per_worker)] for rows, w in plans]
    assert len(set(len(s) for s in steps)) == 1, "workers take different numbers of steps: a hang"
    assert len(steps[0]) == -(-n // batch)
    for k in range(len(steps[0])):
        sizes = [len(s[k][0]) for s in steps]
        assert len(set(sizes)) == 1, "step {}: batch sizes {} differ between workers".format(k, sizes)
        global_rows = list(range(k * batch, min((k + 1) * batch, n)))
        # Each worker's loss is a mean over its rows, weighed 1/workers by the trainer: the gradient the
        # workers sum weighs a row (weight w) w / (workers * size); one process weighs it 1 / len(global batch).
        contribution = {}
        for rows, weights in (s[k] for s in steps):
            for i, row in enumerate(rows):
                weight = 1.0 if weights is None else weights[i]
                contribution[row] = contribution.get(row, 0.0) + weight / (workers * sizes[0])
        contribution = {row: c for row, c in contribution.items() if c}
        assert sorted(contribution) == global_rows
        assert np.allclose(list(contribution.values()), 1.0 / len(global_rows))


def test_full_batches_are_interleaved_and_need_no_weights():
    assert batch_rows(12, 6, 1, 3) == ([1, 4, 7, 10], None)
    assert batch_rows(14, 6, 0, 2) == ([0, 2, 4, 6, 8, 10, 12], None)  # last batch: rows 12, 13, one each


def test_a_short_last_batch_is_topped_up_with_zero_weight_rows():
    assert batch_rows(13, 6, 0, 2) == ([0, 2, 4, 6, 8, 10, 12], [1.0] * 6 + [2.0])  # last batch: row 12 alone
    assert batch_rows(13, 6, 1, 2) == ([1, 3, 5, 7, 9, 11, 12], [1.0] * 6 + [0.0])
    # 5 rows (one short batch) over 3 workers: 2, 2 and 1 + a copy of row 0 weighted 0; real rows weigh 3 * 2 / 5
    assert [batch_rows(5, 6, r, 3) for r in range(3)] == [([0, 3], [1.2, 1.2]), ([1, 4], [1.2, 1.2]), ([2, 0], [1.2, 0.0])]



@pytest.mark.parametrize("batch", [10, 0, True, 6.0])
def test_batch_rows_need_a_batch_the_workers_divide(batch):
    with pytest.raises(ShardError, match="Expected a global batch size that 3 workers split evenly"):
        batch_rows(40, batch, 0, 3)
    with pytest.raises(ShardError, match=r"Received: batch_size=10\. Pass e\.g\. 9 or 12\."):
        batch_rows(40, 10, 0, 3)


def test_num_samples_and_select_take_any_structure():
    data = {"a": np.arange(5), "b": [np.arange(5) * 2, np.arange(5) * 3]}
    assert num_samples(data) == 5
    picked = select(data, [4, 0])
    assert picked["a"].tolist() == [4, 0] and picked["b"][1].tolist() == [12, 0]
    assert select((np.arange(5),), slice(3, None))[0].tolist() == [3, 4]
    with pytest.raises(ShardError, match="same number of samples"):
        num_samples((np.arange(3), np.arange(4)))


def test_fit_on_arrays_splits_only_numpy_arrays_without_steps_per_epoch():
    def fit(x=None, y=None, batch_size=None, epochs=1, sample_weight=None, steps_per_epoch=None):
        pass

    x, y = {"a": np.zeros((4, 2)), "b": np.ones((4, 1))}, np.arange(4)
    bound, data = fit_on_arrays(fit, (x, y), {"batch_size": 2})
    assert data == [x, y, None] and bound.arguments["batch_size"] == 2 and bound.arguments["epochs"] == 1
    assert parts(x) == list(x.values()) and parts((y,)) == [y] and parts(y) == [y]
    assert fit_on_arrays(fit, (x, y), {"steps_per_epoch": 2})[1] is None
    assert fit_on_arrays(fit, ([[1.0, 2.0]], y), {})[1] is None  # not NumPy: trained on as given
    assert fit_on_arrays(fit, (), {})[1] is None  # no x (a generator goes to another method)
