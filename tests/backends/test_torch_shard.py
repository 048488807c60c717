"""``shard=`` on PyTorch (ZeRO-1 "optimizer", ZeRO-2 "gradients", ZeRO-3 "all").

Every case runs on one 3-process worker job (its start is most of the time): sharded training equals
single-device training for the compatibility patterns, the optimizer state (and, with "gradients", the
gradients) each rank holds is ~1/N of the whole, read from torch's storage sizes, a released slot read from
outside fails clearly (with "all" the weights too: ~1/N each, and a weight read outside its layer's
call, as tied weights read it, fails clearly on every rank), save() writes the plain model with the full
optimizer state (loaded by a process without distkeras), a BackupAndRestore checkpoint of a sharded run resumes into another ``shard`` value.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras, replicated  # noqa: F401 (skips if the backend is missing)
from tests.backends import patterns
from tests.backends.test_compat import assert_same_training

if BACKEND != "torch":
    pytest.skip("shard= of the PyTorch adapter", allow_module_level=True)

DEVICES = 3
_single = {}

#: (pattern, shard, extra distribute() options): both modes, the overlapped buckets and the plain path.
CASES = [
    ("clipnorm", "gradients", {}),
    ("global_clipnorm", "optimizer", {}),
    ("global_clipnorm", "gradients", {"overlap": False}),
    ("clipvalue", "optimizer", {}),
    ("adamw_schedule", "gradients", {}),
    ("ema", "optimizer", {}),
    ("accumulation", "gradients", {}),
    ("mixed_float16", "gradients", {}),
    ("batchnorm_convnet", "optimizer", {}),
    ("subclassed_without_config", "gradients", {}),
    ("uneven", "gradients", {"overlap": False}),
    ("uneven", "optimizer", {}),
    ("clipnorm", "all", {}),
    ("global_clipnorm", "all", {"overlap": False}),
    ("adamw_schedule", "all", {}),
    ("ema", "all", {}),
    ("accumulation", "all", {}),
    ("mixed_float16", "all", {}),
    ("batchnorm_convnet", "all", {}),
    ("subclassed_without_config", "all", {}),
    ("uneven", "all", {}),
    ("uneven", "all", {"overlap": False}),
]


def uneven(keras_module):
    """Adam at a global batch of 10 on 3 replicas: shares 4, 3, 3 (and a last batch of 6: 2 each)."""
    model, x, y, _ = patterns._mlp(keras_module, keras_module.optimizers.Adam(0.01))
    return model, x[:46], y[:46], {"batch_size": 10}


patterns.PATTERNS.setdefault("uneven", (uneven, 1e-5))


def run_pattern(name, devices, **options):
    patterns.PATTERNS.setdefault("uneven", (uneven, 1e-5))  # in a worker process too
    return patterns.run(name, devices, **options)


def single_device(name):
    if name not in _single:
        _single[name] = run_pattern(name, 1)
    return _single[name]


@pytest.mark.parametrize("name, shard, options", CASES, ids=["{}-{}{}".format(n, s, "-nooverlap" if o else "")
                                                             for n, s, o in CASES])
def test_sharded_training_equals_one_device(name, shard, options):
    _, atol = patterns.PATTERNS[name]
    expected = single_device(name)
    got = replicated(DEVICES, run_pattern, name, DEVICES, shard=shard, **options)
    assert_same_training(expected, got, atol)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(expected["initial"], got["weights"]))
    assert moved > 10 * atol
    assert got["replicas"] == (DEVICES, DEVICES)  # torch.distributed's world size and distinct processes


def _balanced(keras_module, seed=0):
    """Six equal kernels (no biases): whole-variable ownership splits them 2, 2, 2 on 3 replicas."""
    keras_module.utils.set_random_seed(seed)
    layers = [keras_module.Input((16,))] + [keras_module.layers.Dense(16, use_bias=False, activation="tanh")
                                           for _ in range(6)]
    model = keras_module.Sequential(layers)
    model.compile(optimizer=keras_module.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(24, 16)).astype("float32"), rng.normal(size=(24, 16)).astype("float32")


def _storage(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def held_bytes(shard):
    """Bytes of optimizer slots and gradients this rank holds after fit(), and of the whole (from shapes)."""
    import keras as keras_module
    import torch.distributed as dist

    import distkeras
    from distkeras.errors import ShardError

    model, x, y = _balanced(keras_module)
    distkeras.distribute(model, devices=DEVICES, shard=shard)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    slots = [v for v in model.optimizer.variables if len(v.shape)]  # not iterations, learning_rate
    full = sum(int(np.prod(v.shape)) * 4 for v in slots)
    grads = [v.value.grad for v in model.trainable_variables]
    errors, weight_errors = [], []
    for variables, found in ((slots, errors), (model.trainable_variables, weight_errors)):
        for variable in variables:
            try:
                variable.numpy()
            except ShardError as exc:
                found.append(str(exc))
    result = {
        "slots": _storage([v._value for v in slots]), "slots_full": full,
        "grads": _storage(grads), "grads_full": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables),
        "weights": _storage([v._value for v in model.trainable_variables]),
        "errors": errors, "weight_errors": weight_errors,
        # Gathered on every rank (a collective), and released again after.
        "get_weights": [np.asarray(w) for w in model.get_weights()],
        "weights_after": _storage([v._value for v in model.trainable_variables]),
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    return every


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "all"])
def test_state_is_sharded(shard):
    every = replicated(DEVICES, held_bytes, shard)
    for rank, held in enumerate(every):
        assert held["slots"] <= held["slots_full"] * (1.0 / DEVICES + 0.1), (rank, held)
        if shard == "all":  # weights too, at rest and after get_weights() gathered them; reads outside fail
            assert held["weights"] <= held["grads_full"] * (1.0 / DEVICES + 0.1), (rank, held)
            assert held["weights_after"] == held["weights"], (rank, held)
            assert len(held["weight_errors"]) == 6, held["weight_errors"]  # on the owners too: every rank alike
            assert "get_weights()" in held["weight_errors"][0] and "of layer 'dense" in held["weight_errors"][0]
            for got, want in zip(held["get_weights"], every[0]["get_weights"]):
                np.testing.assert_array_equal(got, want)
        else:
            assert held["weights"] == held["grads_full"], (rank, held)
        if shard in ("gradients", "all"):
            assert held["grads"] <= held["grads_full"] * (1.0 / DEVICES + 0.1), (rank, held)
        else:
            assert held["grads"] == held["grads_full"], (rank, held)
        # Released slots fail clearly when read from outside, naming the variable.
        assert len(held["errors"]) == 8 and "held by another replica" in held["errors"][0], held["errors"]
        assert "_kernel_" in held["errors"][0]  # the released slot, by its path


def _trained_reference(epochs):
    model, x, y = _balanced(keras)
    model.fit(x, y, batch_size=12, epochs=epochs, shuffle=False, verbose=0)
    return model, x


def save_sharded(path, shard):
    import keras as keras_module

    import distkeras

    model, x, y = _balanced(keras_module)
    distkeras.distribute(model, devices=DEVICES, shard=shard)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model.save(path)  # every rank: the optimizer state is gathered first
    return model.get_weights()


_LOAD = """
import json, sys
import numpy as np
import keras
model = keras.models.load_model(sys.argv[1])
x = np.load(sys.argv[2])
print(json.dumps({"pred": keras.ops.convert_to_numpy(model.predict(x, verbose=0)).tolist(),
                  "opt": [np.asarray(v.numpy(), dtype="float64").tolist() for v in model.optimizer.variables],
                  "modules": sorted(m for m in sys.modules if m.startswith("distkeras"))}))
"""


@pytest.mark.parametrize("shard", ["gradients", "all"])
def test_save_is_the_plain_model_with_full_optimizer_state(shard):
    reference, x = _trained_reference(2)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        replicated(DEVICES, save_sharded, path, shard)
        np.save(os.path.join(folder, "x.npy"), x)
        env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH="")
        out = subprocess.run([sys.executable, "-c", _LOAD, path, os.path.join(folder, "x.npy")], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["modules"] == []
    np.testing.assert_allclose(loaded["pred"], keras.ops.convert_to_numpy(reference.predict(x, verbose=0)),
                               rtol=1e-5, atol=1e-5)
    expected = [np.asarray(v.numpy(), dtype="float64") for v in reference.optimizer.variables]
    assert len(loaded["opt"]) == len(expected)
    for got, want in zip(loaded["opt"], expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def resume_across(folder, first, then):
    """One epoch sharded with ``first`` (checkpoint kept), then a new run with ``then`` resumes to epoch 3."""
    import keras as keras_module

    import distkeras
    from distkeras.callbacks import BackupAndRestore

    backup = os.path.join(folder, "backup")
    model, x, y = _balanced(keras_module)
    distkeras.distribute(model, devices=DEVICES, shard=first)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(backup, delete_checkpoint=False)])
    model, x, y = _balanced(keras_module, seed=1)  # other initial weights: only a resume gives the reference
    distkeras.distribute(model, devices=DEVICES, shard=then)
    history = model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0,
                        callbacks=[BackupAndRestore(backup)])
    return history.epoch, model.get_weights()


@pytest.mark.parametrize("first, then", [("optimizer", "gradients"), ("gradients", None), ("all", "optimizer"),
                                         (None, "all")])
def test_backup_resumes_into_another_shard_value(first, then):
    reference, _ = _trained_reference(3)
    with tempfile.TemporaryDirectory() as folder:
        epochs, got = replicated(DEVICES, resume_across, folder, first, then)
    assert epochs == [1, 2]  # resumed after the checkpoint's epoch
    for g, e in zip(got, reference.get_weights()):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_bad_values_and_combinations():
    import distkeras
    from distkeras.errors import OptionError

    model, _, _ = _balanced(keras)
    with pytest.raises(OptionError, match="one of None, 'optimizer', 'gradients', 'all'"):
        distkeras.distribute(model, devices=DEVICES, shard="everything")


@pytest.mark.parametrize("overlap", [True, False])
def test_compression_with_sharded_gradients_trains_close(overlap):
    """fp16 on the wire to each owner (buckets, or the reduce after the backward pass): close to one device,
    at test_torch's tolerance for fp16-compressed all-reduces."""
    expected = single_device("sequential")
    got = replicated(DEVICES, run_pattern, "sequential", DEVICES, shard="gradients", compression="fp16",
                     overlap=overlap)
    for path, e, g in zip(expected["paths"], expected["weights"], got["weights"]):
        np.testing.assert_allclose(g, e, rtol=3e-3, atol=3e-3, err_msg=path)


def tied_read(shard):
    """A layer reading another layer's kernel in its call (tied weights): with shard="all" a clear error on
    every rank (none waits for another), naming the weight; with "gradients" it trains."""
    import keras as keras_module

    import distkeras
    from distkeras.errors import ShardError

    class Tied(keras_module.layers.Layer):
        def __init__(self, source, **kwargs):
            super().__init__(**kwargs)
            self.source = source

        def call(self, x):
            return keras_module.ops.matmul(x, keras_module.ops.transpose(self.source.kernel))

    keras_module.utils.set_random_seed(0)
    inputs = keras_module.Input((8,))
    dense = keras_module.layers.Dense(4, use_bias=False)
    model = keras_module.Model(inputs, Tied(dense)(dense(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    distkeras.distribute(model, devices=DEVICES, shard=shard)
    x = np.ones((6, 8), "float32")
    try:
        model.fit(x, x, batch_size=6, epochs=1, verbose=0)
    except ShardError as exc:
        return str(exc)
    return None


def test_tied_weight_read_by_another_layer_fails_clearly():
    messages = replicated(DEVICES, _every_rank, tied_read, "all")
    for message in messages:
        assert message is not None and re.search(r"The weight '(\w+/)?dense\w*/kernel' of layer 'dense\w*' is held by "
                                                 r"another replica", message), message
        assert "shard='gradients'" in message and "model.get_weights()" in message


def _every_rank(function, *args):
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, function(*args))
    return every
