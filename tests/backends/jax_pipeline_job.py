"""The training run of tests/backends/test_jax_pipeline.py, and, run as a script, its 4-device cases (the backend
suite's harness gives its process 3): the MLP cut after each Dense and the transformer stack at 4 stages, and both
at 2 stages x 2 replicas, checked against one device in that process; it prints "ok" and exits 0, or fails."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import distkeras  # noqa: E402

if __name__ == "__main__":
    distkeras.use_cpu_devices(4)  # before Keras starts JAX

import jax  # noqa: E402

from tests.backends.pipeline_models import MODELS, assert_same  # noqa: E402


def devices_of(value):
    return sorted(d.id for d in value.devices())


def train(name, stages=None, devices=2, save=None, rows=None, **options):
    """Two epochs at batch 8 (the last batch smaller), then evaluate and predict; for a pipelined model also where
    JAX holds each stage's variables and optimizer slots. ``rows``: the data's first rows only (16: every batch
    whole, one micro-batch shape to compile per stage)."""
    build, x, y = MODELS[name]
    x, y = x[:rows], y[:rows]
    model = build()
    if stages is not None:
        model = distkeras.distribute(model, ["cpu:{}".format(i) for i in range(devices)], pipeline_stages=stages,
                                     **options)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=True).history
    result = {"weights": model.get_weights(), "history": history, "evaluate": model.evaluate(x, y, verbose=0),
              "predict": model.predict(x[:7], verbose=0)}
    if stages is not None:
        result["describe"] = distkeras.describe(model)
        plan = model.__dict__["_distkeras_pipeline"]
        result["stages"] = [[layer.name for layer in part.layers] for part in plan.parts]
        cpus = jax.devices("cpu")
        expected, found = [], []
        for s, part in enumerate(plan.parts):
            # Stage s of replica r is devices[r * stages + s]: a copy of its variables on each.
            mine = sorted(cpus[r * len(plan.parts) + s].id for r in range(devices // len(plan.parts)))
            for layer in part.layers:
                for variable in layer.variables:
                    expected.append((variable.path, mine))
                    found.append((variable.path, devices_of(variable.value)))
                    # The optimizer's slots made from it (Adam's moments, SGD's momentum): on its device too.
                    key = variable.path.replace("/", "_") + "_"
                    for slot in model.optimizer.variables:
                        if slot.name.startswith(key):
                            expected.append((slot.path, mine))
                            found.append((slot.path, devices_of(slot.value)))
        result["placed"], result["expected"] = found, expected
        result["ran"] = [sorted(ran) for ran in plan.ran]  # (device ids, rows per device) of each stage's outputs
    if save is not None:
        model.save(save)
    return result


def four_stages():
    # The one-device runs are deterministic (each build() seeds every generator): one of each serves every check.
    one = train("mlp-dropout")
    four = train("mlp-dropout", ["d1", "d2", "d3"], devices=4, microbatches=3, schedule="1f1b")
    assert four["stages"] == [["d1"], ["d2"], ["drop", "d3"], ["d4"]], four["stages"]
    assert four["placed"] == four["expected"], four["placed"]
    assert four["describe"]["replicas"] == 1 and four["describe"]["model_shards"] == 4, four["describe"]
    assert_same(one, four)
    # 2 stages x 2 replicas on the 4 devices: each stage's micro-batches split by rows over its 2 devices.
    two = train("mlp-dropout", ["d2"], devices=4, microbatches=2, schedule="gpipe")
    assert two["placed"] == two["expected"], two["placed"]
    for ids, ran in zip([(0, 2), (1, 3)], two["ran"]):  # read from JAX: the outputs' shardings
        assert (ids, 2) in ran, two["ran"]  # a micro-batch of 4 rows: 2 on each replica's device
    assert_same(one, two)
    # The functional transformer stack, balanced by parameters over 4 devices (cuts between blocks only), on 16
    # of its 20 rows: every batch 8 rows, one micro-batch shape per stage to compile (the MLPs above and the
    # 2-stage tests cover an epoch's smaller last batch).
    one = train("transformer", rows=16)
    four = train("transformer", 4, devices=4, microbatches=2, schedule="gpipe", rows=16)
    assert four["placed"] == four["expected"], four["placed"]
    assert four["describe"]["model_shards"] == 4 and all(four["stages"]), four["stages"]
    assert_same(one, four)
    two = train("transformer", 2, devices=4, microbatches=2, schedule="1f1b", rows=16)
    assert two["placed"] == two["expected"], two["placed"]
    assert two["describe"]["replicas"] == 2 and two["describe"]["model_shards"] == 2, two["describe"]
    assert_same(one, two)


if __name__ == "__main__":
    assert len(jax.devices("cpu")) == 4, jax.devices()
    four_stages()
    print("ok")
    sys.exit(0)
