"""distkeras.backends.agreement without a framework: ranks are threads sharing one dict as the job's store
(first writer wins, as on every engine's board); each has its own counters, as each process has."""

import itertools
import threading
import time

import pytest

from distkeras.backends import agreement
from distkeras.errors import CollectiveError


def boards(world):
    entries, lock = {}, threading.Lock()

    def post(key, value):
        with lock:
            return entries.setdefault(key, value)

    def read(key):
        with lock:
            return entries.get(key)

    return [agreement.Board(post, read, rank, world, (itertools.count(1), itertools.count(1)))
            for rank in range(world)]


def run(*bodies):
    """Run each body in its own thread; what each returned or raised."""
    results = [None] * len(bodies)

    def target(index, body):
        try:
            results[index] = body()
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=target, args=(i, body)) for i, body in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_every_rank_joining_the_same_call_goes_on_at_once():
    ranks = boards(3)
    started = time.time()
    assert run(*(lambda b=b: agreement.join("predict", b, timeout=10) or "go" for b in ranks)) == ["go"] * 3
    assert time.time() - started < 2


def test_a_call_on_one_rank_only_raises_within_the_timeout_there_and_on_a_late_rank_too():
    rank0, rank1 = boards(2)
    started = time.time()
    [error] = run(lambda: agreement.join("predict", rank0, timeout=0.3))
    assert 0.3 <= time.time() - started < 2
    assert isinstance(error, CollectiveError) and isinstance(error, RuntimeError)
    assert "Rank 0 called predict(), rank 1 did not within 0.3 s (DISTKERAS_JOIN_TIMEOUT)" in str(error)
    assert "Call predict() on every rank" in str(error)
    # Rank 1 comes to the same call later: the decision stands for it too, it doesn't enter a collective alone.
    with pytest.raises(CollectiveError, match="Rank 0 called predict"):
        agreement.join("predict", rank1, timeout=10)


def test_ranks_in_different_calls_all_raise_naming_them():
    rank0, rank1 = boards(2)
    errors = run(lambda: agreement.join("predict", rank0, timeout=10),
                 lambda: agreement.join("evaluate", rank1, timeout=10))
    for error in errors:
        assert isinstance(error, CollectiveError)
        assert "rank 1 called evaluate(); rank 0 called predict()" in str(error)


def test_a_nested_call_does_not_join_again():
    [rank0] = boards(1)
    rank0.world = 2  # no other rank will ever join
    calls = []
    with agreement.inside():
        agreement.join("evaluate", rank0, timeout=0.1)
        calls.append("evaluate")
    assert calls == ["evaluate"]


def slow_write(path, result):
    """Rank 0's write of ``path``: "done", after a while; returns ``result``."""

    def write():
        time.sleep(0.3)
        with open(path, "w") as f:
            f.write("done")
        return result

    return write


def test_other_ranks_return_from_a_save_once_rank_0_wrote_and_raise_where_it_failed(tmp_path):
    rank0, rank1 = boards(2)
    path = str(tmp_path / "model.keras")

    write0 = slow_write(path, "rank0")

    def read1():
        result = agreement.saving(path, lambda: "rank1", 1, rank1, timeout=10)
        with open(path) as f:  # complete when save() returns
            return result, f.read()

    assert run(lambda: agreement.saving(path, write0, 0, rank0), read1) == ["rank0", ("rank1", "done")]

    def fail():
        raise OSError("disk full")

    errors = run(lambda: agreement.saving(path, fail, 0, rank0), lambda: agreement.saving(path, lambda: 1, 1, rank1))
    assert isinstance(errors[0], OSError) and str(errors[0]) == "disk full"
    assert isinstance(errors[1], CollectiveError)
    assert "Rank 0 failed to write {}, which every rank saved: OSError: disk full".format(path) in str(errors[1])


def test_a_save_rank_0_never_makes_ends_within_the_timeout_and_rank_0_alone_waits_for_nobody(tmp_path):
    rank0, rank1 = boards(2)
    path = str(tmp_path / "w.weights.h5")
    with pytest.raises(CollectiveError, match="waited 0.2 s .DISTKERAS_SAVE_TIMEOUT. for rank 0.s save of it; rank 0 "):
        agreement.saving(path, lambda: None, 1, rank1, timeout=0.2)
    started = time.time()
    assert agreement.saving(str(tmp_path / "alone.keras"), lambda: "written", 0, rank0) == "written"
    assert time.time() - started < 0.1


def test_saves_pair_by_order_and_a_rank_saving_a_path_of_its_own_never_waits_for_that_path(tmp_path):
    """TensorFlow's multi-worker tutorial: the chief saves the real path, every other worker a path of its own.
    Rank 1 returns once rank 0's save of the same number is through, without an error; the next saves of one
    path pair again."""
    rank0, rank1 = boards(2)
    shared = str(tmp_path / "model.keras")

    write0 = slow_write(shared, 0)

    def second1():
        agreement.saving(str(tmp_path / "rank1" / "model.keras"), lambda: None, 1, rank1, timeout=10)
        agreement.saving(shared, lambda: None, 1, rank1, timeout=10)
        with open(shared) as f:
            return f.read()

    assert run(lambda: [agreement.saving(str(tmp_path / "chief.keras"), lambda: 0, 0, rank0),
                        agreement.saving(shared, write0, 0, rank0)], second1) == [[0, 0], "done"]


def test_without_a_board_nothing_waits(tmp_path):
    agreement.use(None)
    assert agreement.current() is None
    agreement.join("predict")
    assert agreement.saving(str(tmp_path / "m.keras"), lambda: 7, 1) == 7
