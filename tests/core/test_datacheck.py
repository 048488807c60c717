"""The data check's neutral part (distkeras.verify.datacheck): its switch, the record of a batch, the all-gather by sum,
and the verdict that names what differs and why. No framework."""

import numpy as np
import pytest

from distkeras.verify import datacheck
from distkeras.errors import DataError, OptionError


def parts(**arrays):
    return [datacheck.digest_array(v)._replace(name=k) for k, v in arrays.items()]


def test_the_switch_is_on_by_default_and_takes_the_option_over_the_environment():
    assert datacheck.mode(None, {}) == "raise"
    assert datacheck.mode(None, {datacheck.ENV: "0"}) is None
    assert datacheck.mode(None, {datacheck.ENV: "warn"}) == "warn"
    assert datacheck.mode(False, {datacheck.ENV: "1"}) is None
    assert datacheck.mode("warn", {}) == "warn" and datacheck.mode(True, {}) == "raise"
    with pytest.raises(OptionError, match="check_data=True .*Received: check_data='yes please'"):
        datacheck.mode("yes please")
    with pytest.raises(OptionError, match="Received: DISTKERAS_CHECK_DATA='maybe'"):
        datacheck.mode(None, {datacheck.ENV: "maybe"})


def test_parts_are_named_by_their_place_in_x_y_sample_weight():
    assert datacheck.part_name((0,)) == "x" and datacheck.part_name((1,)) == "y"
    assert datacheck.part_name((2,)) == "sample_weight"
    assert datacheck.part_name((0, "image")) == "x['image']" and datacheck.part_name(()) == "x"
    assert datacheck.part_name(("image",)) == "x['image']"  # a batch of a dict of inputs alone


def test_a_digest_follows_values_order_dtype_and_shape():
    x = np.arange(12, dtype="float32").reshape(6, 2)
    same = datacheck.digest_array(x.copy())
    assert same == datacheck.digest_array(x) and same.rows == 6
    assert datacheck.digest_array(x[::-1]).digest != same.digest  # the same rows in another order
    assert datacheck.digest_array(x.astype("float64")).digest != same.digest
    assert datacheck.digest_array(x.reshape(3, 4)).digest != same.digest
    strings = datacheck.digest_array(np.array([b"a", b"b"], dtype=object))
    assert strings.digest != datacheck.digest_array(np.array([b"b", b"a"], dtype=object)).digest


class _Sums(object):
    """The sum over workers of a job in which this process plays rank 0 and ``others`` are the other records."""

    def __init__(self, *others):
        self.others = others

    def __call__(self, vector):
        total = np.asarray(vector, np.float64)
        for rank, record in enumerate(self.others, start=1):
            total[rank * datacheck.SIZE:(rank + 1) * datacheck.SIZE] += record
        return total


def test_records_are_exact_in_a_float32_sum_and_gather_by_rank():
    record = datacheck.encode(parts(x=np.ones((4, 2)), y=np.zeros(4)), batches=7)
    assert len(record) == datacheck.SIZE and max(record) < 2 ** 24 and record[2] == 8
    other = datacheck.encode(parts(x=np.full((4, 2), 2.0), y=np.zeros(4)), batches=7)

    assert datacheck.gather(record, 0, 2, _Sums(other)) == [record, other]
    summed = np.float32(np.asarray(record, np.float32) + np.asarray(other, np.float32) * 0)  # float32 keeps them
    assert [int(v) for v in summed] == record


def verdict_of(*workers):
    records = [datacheck.encode(p, b) for p, b in workers]
    return datacheck.verdict(records, workers[0][0])


def test_the_verdict_names_what_differs_and_its_usual_causes():
    x, y = np.arange(24.0).reshape(12, 2), np.arange(12.0)
    assert verdict_of((parts(x=x, y=y), 8), (parts(x=x, y=y), 8)) is None
    shuffled = verdict_of((parts(x=x, y=y), 8), (parts(x=x[::-1], y=y[::-1]), 8))
    assert "worker 1's batch differs from worker 0's in x, y" in shuffled and "shuffle(buffer, seed=S)" in shuffled
    augmented = verdict_of((parts(x=x, y=y), 8), (parts(x=x + 0.1, y=y), 8))
    assert "in x. The usual causes: augmentation" in augmented and "stateless" in augmented
    shorter = verdict_of((parts(x=x, y=y), 8), (parts(x=x, y=y), 7))
    assert "worker 1's data has 7 batches where worker 0's has 8" in shorter
    rows = verdict_of((parts(x=x, y=y), 8), (parts(x=x[:6], y=y[:6]), 8))
    assert "x has 6 rows where worker 0's has 12" in rows and "batch size" in rows
    renamed = verdict_of((parts(x=x, y=y), 8), (parts(x=x, label=y), 8))
    assert "other parts (names or dtypes)" in renamed
    assert verdict_of((parts(x=x), None), ([], None)) is not None  # an empty record: a worker drew no batch
    assert "worker 2" in verdict_of((parts(x=x), 1), (parts(x=x), 1), (parts(x=x + 1), 1))


def test_parts_past_the_slots_are_folded_into_the_last_and_still_compared():
    many = {"p{}".format(i): np.full(3, float(i)) for i in range(datacheck.PARTS + 3)}
    changed = dict(many, p14=np.full(3, -1.0))
    assert verdict_of((parts(**many), 1), (parts(**many), 1)) is None
    found = verdict_of((parts(**many), 1), (parts(**changed), 1))
    assert "p11/p12/p13/p14" in found


def test_a_watch_raises_or_warns_once_and_compares_once_per_check(caplog):
    x = np.arange(8.0)
    mine = parts(x=x)
    same, other = datacheck.encode(mine, 2), datacheck.encode(parts(x=x[::-1]), 2)
    watch = datacheck.Watch("raise", 0, 2, _Sums(same), "jax")
    watch.note(mine, 2)
    watch.check("fit(), epoch 1")
    assert watch.checks == 1 and watch.pending is None
    watch = datacheck.Watch("raise", 0, 2, _Sums(other), "jax")
    watch.note(mine, 2)
    with pytest.raises(DataError, match=r"at the first step of fit\(\), epoch 3 on the jax backend \(2 workers\)"):
        watch.check("fit(), epoch 3")
    watch = datacheck.Watch("warn", 0, 2, _Sums(other), "torch")
    for _ in range(2):
        watch.note(mine, 2)
        watch.check("evaluate()")
    assert [r.getMessage().count("Training goes on") for r in caplog.records] == [1]
