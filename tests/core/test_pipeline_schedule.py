"""The pipeline's schedules and micro-batches (distkeras.parallel.pipeline), framework-free: every micro-batch runs forward
once and backward once on every stage, a backward after its own forward; GPipe holds M activations, 1F1B at most
S - s; the passes of neighbouring stages can't deadlock (simulated with blocking receives); shares sum to one."""

import itertools

import pytest

from distkeras.parallel import pipeline
from distkeras.errors import OptionError


@pytest.mark.parametrize("name, stages, microbatches", itertools.product(("gpipe", "1f1b"), (2, 3, 4), (1, 2, 5, 8)))
def test_each_stage_runs_each_microbatch_once_each_way_and_the_pipe_never_deadlocks(name, stages, microbatches):
    plans = [pipeline.schedule(name, stages, s, microbatches) for s in range(stages)]
    for s, actions in enumerate(plans):
        forwards = [m for kind, m in actions if kind == pipeline.FORWARD]
        backwards = [m for kind, m in actions if kind == pipeline.BACKWARD]
        assert forwards == list(range(microbatches)) and backwards == list(range(microbatches))
        for m in range(microbatches):
            assert actions.index((pipeline.FORWARD, m)) < actions.index((pipeline.BACKWARD, m))
        held = pipeline.in_flight(actions)
        assert held == (microbatches if name == "gpipe" else min(stages - s, microbatches))
    # Blocking receives, buffered sends: each stage advances while what it waits for was sent.
    position, sent = [0] * stages, set()
    while any(p < len(plans[s]) for s, p in enumerate(position)):
        moved = False
        for s in range(stages):
            if position[s] == len(plans[s]):
                continue
            kind, m = plans[s][position[s]]
            needs = None
            if kind == pipeline.FORWARD and s > 0:
                needs = (pipeline.FORWARD, s - 1, m)
            if kind == pipeline.BACKWARD and s < stages - 1:
                needs = (pipeline.BACKWARD, s + 1, m)
            if needs is None or needs in sent:
                sent.add((kind, s, m))
                position[s] += 1
                moved = True
        assert moved, "deadlock at {}".format(position)


def test_microbatches_differ_by_at_most_a_row_and_their_shares_sum_to_one():
    assert pipeline.microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert pipeline.microbatch_sizes(2, 4) == [1, 1]
    assert pipeline.microbatch_sizes(8, 1) == [8]
    assert sum(pipeline.weights([3, 3, 2, 2])) == pytest.approx(1.0)
    assert pipeline.bubble(4, 4) == pytest.approx(3 / 7.0)


def test_bad_schedule_options_say_what_is_accepted():
    with pytest.raises(OptionError, match=r"Expected schedule in \('gpipe', '1f1b'\)"):
        pipeline.schedule("interleaved", 2, 0, 4)
    with pytest.raises(OptionError, match="positive integer"):
        pipeline.check_microbatches(0)
    with pytest.raises(OptionError, match="doesn't divide the job's 6 processes"):
        pipeline.check_world(6, 4)
    assert pipeline.groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def test_stages_times_replicas_devices_and_each_replicas_rows():
    # Replica r's stage s is device r * S + s, as stage_of numbers processes: a replica's stages are neighbours.
    assert pipeline.stage_devices(["d0", "d1", "d2", "d3"], 2) == [["d0", "d2"], ["d1", "d3"]]
    assert pipeline.stage_devices(list("abcdef"), 3) == [["a", "d"], ["b", "e"], ["c", "f"]]
    assert [pipeline.stage_of(rank, 2) for rank in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for count, replicas in itertools.product(range(1, 12), range(1, 5)):
        rows = pipeline.replica_rows(count, replicas)
        assert sum(rows) == count and min(rows) >= 1 and max(rows) - min(rows) <= 1
        assert len(rows) == min(count, replicas) and rows == sorted(rows, reverse=True)
