"""pipeline.interleave: one loop drives every stage of a one-process pipeline (JAX, TensorFlow) in an order that keeps
each stage's schedule (so each holds what its schedule holds) and runs every pass after the pass it needs."""

import pytest

from distkeras.parallel import pipeline


@pytest.mark.parametrize("name", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", [(2, 3), (4, 3), (4, 8), (3, 1)])
def test_every_pass_once_in_its_stage_order_after_what_it_needs(name, stages, microbatches):
    schedules = [pipeline.schedule(name, stages, s, microbatches) for s in range(stages)]
    order = pipeline.interleave(schedules)
    assert sorted(order) == sorted((s, kind, m) for s in range(stages) for kind, m in schedules[s])
    for s in range(stages):
        assert [(kind, m) for t, kind, m in order if t == s] == schedules[s]
    place = {action: i for i, action in enumerate(order)}
    for (s, kind, m), i in place.items():
        before = s - 1 if kind == pipeline.FORWARD else s + 1
        if 0 <= before < stages:
            assert place[(before, kind, m)] < i


def test_schedules_that_wait_on_each_other_are_an_error_not_a_hang():
    backward_first = [[(pipeline.BACKWARD, 0), (pipeline.FORWARD, 0)], [(pipeline.FORWARD, 0), (pipeline.BACKWARD, 0)]]
    with pytest.raises(RuntimeError, match="wait on each other"):
        pipeline.interleave(backward_first)
