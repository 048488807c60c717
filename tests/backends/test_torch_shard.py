"""``shard=`` on PyTorch (ZeRO-1 "optimizer", ZeRO-2 "gradients", ZeRO-3 "all").

Every case runs on one 3-process worker job (its start is most of the time): sharded training equals
single-device training for the compatibility patterns, the optimizer state (and, with "gradients", the
gradients) each rank holds is ~1/N of the whole, read from torch's storage sizes, a released slot read from
outside fails clearly (with "all" the weights too: ~1/N each, and a weight read outside its layer's
call, as tied weights read it, fails clearly on every rank), save() writes the plain model with the full
optimizer state (loaded by a process without distkeras), a BackupAndRestore checkpoint of a sharded run resumes into another ``shard`` value.
"""

import contextlib
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
    ("custom_layer_losses", "all", {}),  # weight regularizers: computed outside the layers' call
    ("shared_layer", "all", {}),
    # A bucket per variable part: the other owners' parts are sent from the gradient itself (scaled in place).
    ("clipnorm", "gradients", {"bucket_mb": 1e-6}),
    ("adamw_schedule", "all", {"bucket_mb": 1e-6}),
]


def uneven(keras_module):
    """Adam at a global batch of 10 on 3 replicas: shares 4, 3, 3 (and a last batch of 6: 2 each)."""
    model, x, y, _ = patterns._mlp(keras_module, keras_module.optimizers.Adam(0.01))
    return model, x[:46], y[:46], {"batch_size": 10}


def shared_layer(keras_module):
    """One Dense applied to two inputs in each step (its weights used twice, forward and backward)."""
    keras_module.utils.set_random_seed(0)
    shared = keras_module.layers.Dense(6, activation="tanh")
    first, second = keras_module.Input((6,)), keras_module.Input((6,))
    joined = keras_module.layers.Concatenate()([shared(first), shared(second)])
    model = keras_module.Model([first, second], keras_module.layers.Dense(3)(joined))
    model.compile(optimizer=keras_module.optimizers.Adam(0.01), loss="mse")
    x, y = patterns._data()
    return model, [x, x[:, ::-1].copy()], y, {}


def made_out_of_order(keras_module):
    """A subclassed model whose last layer (in the forward pass) is tracked first: its variables come first in the
    model's, so the gradients don't come in their reverse order; one variable per bucket makes every rank's
    launch order follow them."""

    class OutOfOrder(keras_module.Model):
        def __init__(self):
            super().__init__()
            self.head = keras_module.layers.Dense(3, name="head")
            self.early = keras_module.layers.Dense(5, activation="tanh", name="early")
            self.middle = keras_module.layers.Dense(7, activation="tanh", name="middle")

        def call(self, inputs):
            return self.head(self.middle(self.early(inputs)))

    keras_module.utils.set_random_seed(0)
    model = OutOfOrder()
    model(np.zeros((1, 6), "float32"))
    model.compile(optimizer=keras_module.optimizers.Adam(0.01), loss="mse")
    x, y = patterns._data()
    return model, x, y, {}


def _add_patterns():
    patterns.PATTERNS.setdefault("uneven", (uneven, 1e-5))
    patterns.PATTERNS.setdefault("shared_layer", (shared_layer, 1e-5))
    patterns.PATTERNS.setdefault("made_out_of_order", (made_out_of_order, 1e-5))


_add_patterns()


def run_pattern(name, devices, **options):
    _add_patterns()  # in a worker process too
    return patterns.run(name, devices, **options)


def single_device(name):
    if name not in _single:
        _single[name] = run_pattern(name, 1)
    return _single[name]


@pytest.mark.parametrize("name, shard, options", CASES, ids=["{}-{}{}".format(n, s, "".join(
    "-nooverlap" if k == "overlap" else "-{}={}".format(k, v) for k, v in o.items())) for n, s, o in CASES])
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


def _held(variables):
    """Storage bytes this rank holds for ``variables``: each one's tensor, and this rank's part of a variable
    split across ranks, which the shard module keeps in a tensor of its own (``_distkeras_piece``)."""
    return _storage([v._value for v in variables] + [v.__dict__.get("_distkeras_piece") for v in variables])


def _dominant(keras_module, seed=0, optimizer=None):
    """One kernel is 76% of the parameters (16x96 of 2020): whole-variable ownership can't balance it, so it
    (and the next ones) are split, one flat part per rank."""
    keras_module.utils.set_random_seed(seed)
    model = keras_module.Sequential([keras_module.Input((16,)), keras_module.layers.Dense(96, activation="tanh"),
                                     keras_module.layers.Dense(4)])
    model.compile(optimizer=optimizer or keras_module.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(24, 16)).astype("float32"), rng.normal(size=(24, 4)).astype("float32")


MODELS = {"balanced": _balanced, "dominant": _dominant}


def held_bytes(shard, build="balanced"):
    """Bytes of optimizer slots and gradients this rank holds after fit(), and of the whole (from shapes)."""
    import keras as keras_module
    import torch.distributed as dist

    import distkeras
    from distkeras.errors import ShardError

    model, x, y = MODELS[build](keras_module)
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
        "slots": _held(slots), "slots_full": full,
        "grads": _storage(grads), "grads_full": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables),
        "weights": _held(model.trainable_variables),
        "errors": errors, "weight_errors": weight_errors, "described": distkeras.describe(model)["shard"],
        # Gathered on every rank (a collective), and released again after.
        "get_weights": [np.asarray(w) for w in model.get_weights()],
        "weights_after": _held(model.trainable_variables),
        # The variables split across ranks (the sharding's layout, as distkeras keeps it).
        "split": [i for i, v in enumerate(model.trainable_variables)
                  if model.__dict__["_distkeras_sharding"].owner_map()[id(v)] == -1],
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    return every


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "all"])
def test_state_is_sharded(shard):
    every = replicated(DEVICES, held_bytes, shard)
    for rank, held in enumerate(every):
        assert held["described"] == shard
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


@pytest.mark.parametrize("shard", ["optimizer", "all"])
def test_a_dominant_variable_is_split(shard):
    """A kernel that is most of the model: each rank holds 1/N of its optimizer state (and with "all" of its
    weight), read from torch's storages, and the same gathered weights."""
    every = replicated(DEVICES, held_bytes, shard, "dominant")
    assert every[0]["split"] == [0, 1, 2]  # the first kernel and bias, the second kernel (not its bias of 4)
    for rank, held in enumerate(every):
        assert held["slots"] <= held["slots_full"] * (1.0 / DEVICES + 0.05), (rank, held)
        if shard == "all":
            assert held["weights"] <= held["grads_full"] * (1.0 / DEVICES + 0.05), (rank, held)
            assert held["weights_after"] == held["weights"], (rank, held)
            for got, want in zip(held["get_weights"], every[0]["get_weights"]):
                np.testing.assert_array_equal(got, want)
        assert held["errors"], held  # this rank's part only: the whole slot, read from outside, fails clearly


def train_dominant(shard, optimizer, options):
    import keras as keras_module

    import distkeras

    model, x, y = _dominant(keras_module, optimizer=_optimizer(keras_module, optimizer))
    if shard != "single":
        distkeras.distribute(model, devices=DEVICES, shard=shard, **options)
    initial = model.get_weights()
    model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    split = []
    if shard != "single":
        owner = model.__dict__["_distkeras_sharding"].owner_map()
        split = [i for i, v in enumerate(model.trainable_variables) if owner[id(v)] == -1]
    return initial, model.get_weights(), split


def _optimizer(keras_module, name):
    return {"adam_clipnorm": lambda: keras_module.optimizers.Adam(0.01, clipnorm=0.05),
            "sgd_ema_accumulation": lambda: keras_module.optimizers.SGD(
                0.1, momentum=0.9, use_ema=True, ema_overwrite_frequency=2, gradient_accumulation_steps=2),
            "adamw": lambda: keras_module.optimizers.AdamW(0.01, weight_decay=0.1),
            "adafactor": lambda: keras_module.optimizers.Adafactor(0.05)}[name]()


@pytest.mark.parametrize("optimizer, shard, options", [
    ("adam_clipnorm", "gradients", {}), ("adam_clipnorm", "all", {"overlap": False}),
    ("sgd_ema_accumulation", "optimizer", {}), ("sgd_ema_accumulation", "all", {}),
    ("adamw", "gradients", {"overlap": False}), ("adafactor", "all", {})])
def test_split_variables_train_as_on_one_device(optimizer, shard, options):
    """Split variables (their parts updated on their own ranks, a clipnorm over the whole variable): the
    single-device training. Adafactor (a factored second moment per matrix) keeps every variable whole."""
    initial, expected, _ = train_dominant("single", optimizer, {})
    got_initial, got, split = replicated(DEVICES, train_dominant, shard, optimizer, options)
    for a, b in zip(initial, got_initial):
        np.testing.assert_array_equal(a, b)
    assert split == ([] if optimizer == "adafactor" else [0, 1, 2])
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(initial, expected)) > 1e-2  # it trained


def _trained_reference(epochs, build="balanced"):
    model, x, y = MODELS[build](keras)
    model.fit(x, y, batch_size=12, epochs=epochs, shuffle=False, verbose=0)
    return model, x


def save_sharded(path, shard, build="balanced"):
    import keras as keras_module

    import distkeras

    model, x, y = MODELS[build](keras_module)
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


@pytest.mark.parametrize("shard, build", [("gradients", "balanced"), ("all", "balanced"), ("optimizer", "dominant"),
                                         ("all", "dominant")])
def test_save_is_the_plain_model_with_full_optimizer_state(shard, build):
    reference, x = _trained_reference(2, build)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        replicated(DEVICES, save_sharded, path, shard, build)
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


def resume_across(folder, first, then, build="balanced"):
    """One epoch sharded with ``first`` (checkpoint kept), then a new run with ``then`` resumes to epoch 3."""
    import keras as keras_module

    import distkeras
    from distkeras.callbacks import BackupAndRestore

    backup = os.path.join(folder, "backup")
    model, x, y = MODELS[build](keras_module)
    distkeras.distribute(model, devices=DEVICES, shard=first)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(backup, delete_checkpoint=False)])
    model, x, y = MODELS[build](keras_module, seed=1)  # other initial weights: only a resume gives the reference
    distkeras.distribute(model, devices=DEVICES, shard=then)
    history = model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0,
                        callbacks=[BackupAndRestore(backup)])
    return history.epoch, model.get_weights()


@pytest.mark.parametrize("first, then, build", [
    ("optimizer", "gradients", "balanced"), ("gradients", None, "balanced"), ("all", "optimizer", "balanced"),
    (None, "all", "balanced"), ("all", "gradients", "dominant"), ("optimizer", None, "dominant"),
    (None, "all", "dominant")])
def test_backup_resumes_into_another_shard_value(first, then, build):
    reference, _ = _trained_reference(3, build)
    with tempfile.TemporaryDirectory() as folder:
        epochs, got = replicated(DEVICES, resume_across, folder, first, then, build)
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


def test_layout_splits_only_what_balance_needs():
    from distkeras.backends.torch.shard_layout import SPLIT, layout, part_range

    # Equal variables balance whole: none is split.
    assert layout([1024] * 6, [256] * 6, [True] * 6, 3) == [0, 1, 2, 0, 1, 2]
    # One variable that is most of the model is split; the rest stays whole where it balances.
    sizes, elements = [32_000_000, 4_000_000, 4_000, 400], [8_000_000, 1_000_000, 1_000, 100]
    assert layout(sizes, elements, [True] * 4, 4) == [SPLIT, SPLIT, 0, 1]
    # Not where the optimizer forbids it (whole, greedy), nor a variable too small to give each rank 8 elements.
    assert layout(sizes, elements, [False] * 4, 4) == [0, 1, 2, 3]
    assert layout([64, 4], [16, 1], [True, True], 4) == [0, 1]
    # Parts: contiguous, ceil(n / N) each, every element once.
    assert [part_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]


def test_which_optimizers_may_split_a_variable():
    """Keras' own elementwise optimizers (on torch, its torch_* subclasses, which Keras' TorchOptimizer.__new__
    makes: the private module path this checks is pinned here), not Adafactor/Lamb nor a user's subclass."""
    from distkeras.backends.torch.shard_layout import elementwise

    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Lion", "Ftrl"):
        optimizer = getattr(keras.optimizers, name)()
        assert elementwise(optimizer), (name, type(optimizer).__module__)
    assert type(keras.optimizers.Adam()).__module__.startswith("keras.src.backend.torch.optimizers.torch_")

    class MyAdam(keras.optimizers.Adam):
        pass

    for optimizer in (keras.optimizers.Adafactor(), keras.optimizers.Lamb(), MyAdam()):
        assert not elementwise(optimizer), type(optimizer)


@contextlib.contextmanager
def _in_pieces(piece_bytes, window=2):
    """Across hosts the sharded messages travel in small pieces (messages.py); here, where every rank shares this
    host and they go in pieces of ONE_HOST_PIECE_BYTES (larger than these tests' messages), force pieces of
    ``piece_bytes`` with ``window`` in flight, the cross-host path."""
    from distkeras.backends.torch import messages

    saved = messages.PIECE_BYTES, messages.WINDOW, messages.configure, messages.Links._message
    messages.PIECE_BYTES, messages.WINDOW = piece_bytes, window
    messages.configure = lambda one_host: messages._one_host.__setitem__(0, False)
    messages._one_host[0] = False
    messages.cut = []  # pieces per message sent or received

    def counted(self, kind, tensor, peer, on_piece=None):
        message = saved[3](self, kind, tensor, peer, on_piece)
        messages.cut.append(message.left)
        return message

    messages.Links._message = counted
    try:
        yield messages
    finally:
        messages.PIECE_BYTES, messages.WINDOW, messages.configure, messages.Links._message = saved


def messages_between_every_pair():
    """Messages of several sizes and dtypes between every pair of ranks, in 64-byte pieces, with an all-reduce
    of the main thread between them: what each rank received, against what was sent."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    with _in_pieces(64) as messages:
        link = messages.links()
        waiting, received, pieces = [], [], 0
        for index, (size, dtype) in enumerate([(0, torch.float32), (1, torch.float16), (701, torch.float32),
                                               (333, torch.float64), (5, torch.float32)] * 2):
            for src in range(world):
                for dst in range(world):
                    want = (torch.arange(size, dtype=torch.float64) % 97 + 10 * src + dst + index).to(dtype)
                    if src == dst or rank not in (src, dst):
                        continue
                    if rank == src:
                        message = link.send(want, dst)
                    else:
                        got = torch.empty(size, dtype=dtype)
                        message = link.recv(got, src)
                        received.append((got, want))
                    pieces += message.left
                    waiting.append(message)
            total = torch.ones(2)
            dist.all_reduce(total)
        messages.wait(waiting)
    return {"received": len(received), "wrong": sum(not torch.equal(g, w) for g, w in received), "pieces": pieces}


def test_messages_in_pieces_arrive_whole_and_in_order():
    replicated(DEVICES, run_pattern, "sequential", DEVICES)  # the job's process group, as distribute() makes it
    for result in replicated(DEVICES, _every_rank, messages_between_every_pair):
        assert result["received"] == 20 and result["wrong"] == 0
        assert result["pieces"] > 4 * 20  # really cut (64 bytes each, 2 in flight)


def run_pattern_in_pieces(name, devices, **options):
    with _in_pieces(16) as messages:
        result = run_pattern(name, devices, **options)
        result["pieces"] = max(messages.cut)
        return result


@pytest.mark.parametrize("shard", ["gradients", "all"])
def test_sharded_training_in_pieces_equals_one_device(shard):
    """The owners' gradients and weights in 16-byte pieces (as across hosts, in larger ones): the same training."""
    _, atol = patterns.PATTERNS["clipnorm"]
    expected = single_device("clipnorm")
    got = replicated(DEVICES, run_pattern_in_pieces, "clipnorm", DEVICES, shard=shard)
    assert got["pieces"] > 1  # some message was cut
    assert_same_training(expected, got, atol)


def _bucket_order(model):
    buckets = model.optimizer.__dict__["_distkeras_replica"].buckets  # distkeras' own state, read by its test
    paths = [v.path for v in buckets._variables]
    return {"expected": [paths[i] for i in buckets._order], "rebuilt": buckets._rebuilt is not None,
            "first_units": [paths[b.entries[0][0]] for b in buckets._buckets]}


@pytest.mark.parametrize("shard", ["gradients", "all"])
def test_buckets_follow_the_order_the_gradients_came_in(shard):
    """After the first step the sharded buckets are made again in the order that step's gradients came (rank 0's,
    on every rank: DDP's rebuild), here not the reverse of the variables' order; the training is unchanged."""
    _, atol = patterns.PATTERNS["made_out_of_order"]
    expected = single_device("made_out_of_order")
    got = replicated(DEVICES, run_pattern, "made_out_of_order", DEVICES, shard=shard, bucket_mb=1e-6,
                     inspect=_bucket_order)
    assert_same_training(expected, got, atol)
    order = got["inspected"]
    assert order["rebuilt"]
    # The head's gradients come first and the first-made layer's last, unlike the model's variable order.
    first = [min(i for i, path in enumerate(order["expected"]) if name in path.split("/")) for name in ("head", "middle",
                                                                                                    "early")]
    assert first == sorted(first), order
    assert order["expected"] != list(reversed(got["paths"][: len(order["expected"])])), order
    firsts = [order["expected"].index(path) for path in order["first_units"]]
    assert firsts == sorted(firsts), order  # the buckets launch in that order


def _tiled_model(keras_module, variant):
    """The dominant kernel (16x96, split in 3 parts of partial rows) in a plain, shared or mixed-precision model."""
    keras_module.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 16)).astype("float32"), rng.normal(size=(24, 4)).astype("float32")
    if variant == "mixed":
        keras_module.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        big = keras_module.layers.Dense(96, activation="tanh", name="big")
        if variant == "shared":  # the big layer called twice per step: its gradient is the sum of both uses
            first, second = keras_module.Input((16,)), keras_module.Input((16,))
            joined = keras_module.layers.Add()([big(first), big(second)])
            model = keras_module.Model([first, second], keras_module.layers.Dense(4, name="head")(joined))
            x = [x, x[:, ::-1].copy()]
        else:
            inputs = keras_module.Input((16,))
            model = keras_module.Model(inputs, keras_module.layers.Dense(4, name="head", dtype="float32")(big(inputs)))
    finally:
        keras_module.mixed_precision.set_dtype_policy("float32")
    model.compile(optimizer=keras_module.optimizers.Adam(0.01), loss="mse")
    return model, x, y


def train_tiled(shard, variant, options=None):
    """Train :func:`_tiled_model`; what torch saw of the big kernel: how often autograd accumulated a whole gradient
    into its ``.grad`` (seen by its post-accumulate-grad hook), and its storage's largest size at any gradient hook
    of the step."""
    import keras as keras_module

    import distkeras

    model, x, y = _tiled_model(keras_module, variant)
    initial = model.get_weights()
    if shard != "single":
        distkeras.distribute(model, devices=DEVICES, shard=shard, **(options or {}))
    kernel = model.get_layer("big")._kernel._value  # Keras' torch variable's Parameter (a Keras private)
    seen = {"whole_gradients": 0, "kernel_storage": 0}

    def whole(parameter):
        # (torch calls the hook also when the backward pass gave the kernel no gradient: .grad is None then)
        seen["whole_gradients"] += parameter.grad is not None

    def sample(_):
        seen["kernel_storage"] = max(seen["kernel_storage"], kernel.untyped_storage().nbytes())

    kernel.register_post_accumulate_grad_hook(whole)
    for variable in model.trainable_variables:
        if variable._value is not kernel:
            variable._value.register_post_accumulate_grad_hook(sample)
    model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    tiled, every = [], [seen]
    if shard != "single":
        import torch.distributed as dist

        sharding = model.__dict__["_distkeras_sharding"]  # distkeras' own state: which layers it tiles
        tiled = sorted(s.layer.name for s in sharding._layers.values() if s.tiled is not None)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, seen)
    predicted = model.predict(x, batch_size=12, verbose=0)  # the forward pass part by part, without gradients
    return {"initial": initial, "weights": model.get_weights(), "tiled": tiled, "ranks": every,
            "predicted": np.asarray(predicted)}


@pytest.mark.parametrize("variant, options", [("plain", {}), ("shared", {}), ("mixed", {}), ("plain", {"overlap": False})])
def test_a_dominant_dense_kernel_is_computed_part_by_part(variant, options):
    """shard="all" never holds a split Dense kernel whole: the forward and backward passes fetch one owner's part
    at a time, and each part's gradient goes to its owner as it is computed (autograd never accumulates the
    whole gradient: the kernel's hook never fires; its storage stays empty). The training is one device's,
    also for a layer used twice per step (its parts summed), in mixed precision, and without overlap (then
    the parts are added into ``.grad``, as autograd would)."""
    expected = train_tiled("single", variant)
    assert expected["ranks"][0]["whole_gradients"] == 3 * 2  # one device: a whole gradient per step, as torch makes it
    got = replicated(DEVICES, train_tiled, "all", variant, options)
    assert "big" in got["tiled"]  # (and the head's kernel, split too)
    for a, b in zip(expected["initial"], got["initial"]):
        np.testing.assert_array_equal(a, b)
    tolerance = 2e-3 if variant == "mixed" else 2e-5
    for g, e in zip(got["weights"], expected["weights"]):
        np.testing.assert_allclose(g, e, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(got["predicted"], expected["predicted"], rtol=tolerance, atol=tolerance)
    assert len(got["ranks"]) == DEVICES
    if not options:
        assert all(r["whole_gradients"] == 0 and r["kernel_storage"] == 0 for r in got["ranks"]), got["ranks"]
