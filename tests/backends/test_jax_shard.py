"""shard= on JAX (ZeRO stages as array layouts, :mod:`distkeras.backends.jax.shard`): each mode trains what one
device trains for the compatibility patterns; the layouts, read from the arrays; what XLA compiles; save/load,
resume across shard values, a tied weight read outside its layer, the refused combinations; across processes."""

import math
import os
import re

import numpy as np
import pytest

from tests.backends.harness import BACKEND, keras  # noqa: F401 (skips if missing)

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="JAX adapter tests; KERAS_BACKEND={}".format(BACKEND))

from tests.backends import patterns, scenarios  # noqa: E402
from tests.backends.test_compat import assert_same_training, single_device  # noqa: E402
from tests.backends.test_jax import _collectives  # noqa: E402
from tests.full import only_in_full  # noqa: E402

import distkeras  # noqa: E402
from distkeras.callbacks import BackupAndRestore  # noqa: E402

MODES = ("optimizer", "gradients", "all")
#: The compatibility patterns the issue names; steps_per_execution runs a global batch of 10 (padded on 3 devices).
SHARD_PATTERNS = ("adamw_schedule", "clipnorm", "global_clipnorm", "ema", "accumulation", "mixed_bfloat16",
                  "batchnorm_convnet", "subclassed_without_config", "steps_per_execution")


def _split_dimension(shape, parts):
    """Where the test expects a variable split: its largest dimension ``parts`` divides (first of equals)."""
    best = None
    for i, size in enumerate(shape):
        if size % parts == 0 and size >= parts and (best is None or size > shape[best]):
            best = i
    return best


def _layouts(model):
    """Plain data on how JAX holds every trainable and optimizer variable: spec, device set, shard shapes."""

    def entry(v):
        a = v.value
        return {"path": v.path, "shape": tuple(a.shape), "spec": tuple(a.sharding.spec),
                "devices": len(a.sharding.device_set),
                "shards": sorted({tuple(s.data.shape) for s in a.addressable_shards}),
                "bytes": [s.data.nbytes for s in a.addressable_shards], "itemsize": a.dtype.itemsize}

    return {"trainable": [entry(v) for v in model.trainable_variables],
            "optimizer": [entry(v) for v in model.optimizer.variables]}


def _assert_laid_out(entry, parts, sharded):
    dimension = _split_dimension(entry["shape"], parts) if sharded else None
    assert entry["devices"] == parts, entry
    if dimension is None:
        assert all(axis is None for axis in entry["spec"]), entry
        assert entry["shards"] == [entry["shape"]], entry
        return
    expected = list(entry["shape"])
    expected[dimension] //= parts
    assert entry["spec"][dimension] == "batch", entry
    assert entry["shards"] == [tuple(expected)], entry  # every device holds 1/N of it, not the whole
    assert all(b * parts == math.prod(entry["shape"]) * entry["itemsize"] for b in entry["bytes"]), entry


def _pattern_params():
    """Every pattern in every mode in the full run. The default run takes every pattern with shard="gradients" (its
    own step: each shard's gradient reduce-scattered in a shard_map) and shard="all" (every variable split: what
    "optimizer" splits and more, by the same layout rule and XLA's partitioning); "optimizer", whose step is
    "gradients"', in the full run."""
    params = []
    for name in SHARD_PATTERNS:
        for mode in MODES:
            marks = () if mode != "optimizer" else only_in_full(
                "{} runs with shard='gradients' and 'all' in the default run ('optimizer' compiles to 'gradients'' "
                "step, test_what_xla_compiles_for_each_mode; 'all' splits what it splits, and more)".format(name))
            params.append(pytest.param(name, mode, marks=marks, id="{}-{}".format(name, mode)))
    return params


@pytest.mark.parametrize("name, mode", _pattern_params())
def test_pattern_trains_as_on_one_device(name, mode):
    index = SHARD_PATTERNS.index(name) + MODES.index(mode)
    devices = 3 if name == "steps_per_execution" else 2 + index % 2  # 10 rows on 3 devices: an uneven batch
    _, atol = patterns.PATTERNS[name]
    expected = single_device(name)
    got = patterns.run(name, devices, inspect=_layouts, shard=mode)
    assert_same_training(expected, got, atol)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(expected["initial"], got["weights"]))
    assert moved > 10 * atol, "the weights did not move: the test could not tell training from none"
    import jax

    assert got["replicas"] == (devices, devices) and jax.device_count() >= devices
    for entry in got["inspected"]["optimizer"]:
        _assert_laid_out(entry, devices, sharded=True)
    for entry in got["inspected"]["trainable"]:
        _assert_laid_out(entry, devices, sharded=mode == "all")


def _mlp(seed=0, optimizer=None):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="tanh"), keras.layers.Dense(32)])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse")
    return model


def _mlp_data(rows=32):
    rng = np.random.default_rng(5)
    return rng.normal(size=(rows, 64)).astype("float32"), rng.normal(size=(rows, 32)).astype("float32")


@pytest.fixture
def compiled_steps(monkeypatch):
    """The optimized HLO of every train step Keras' JAX trainer jits (its module's ``jit``, wrapped: the very
    function fit() runs, with the out_shardings Keras gives it), compiled at its first call."""
    from keras.src.backend.jax import trainer

    texts, own = [], trainer.jit

    def jit(function, **kwargs):
        jitted = own(function, **kwargs)

        def call(*args):
            if not texts:
                lowered = jitted.lower(*args)
                texts.append(lowered.compile().as_text())
                texts.append(lowered.as_text())  # before XLA's passes: the sharding constraints as written
            return jitted(*args)

        return call

    monkeypatch.setattr(trainer, "jit", jit)
    return texts


@pytest.mark.parametrize("mode", (None,) + MODES)
def test_what_xla_compiles_for_each_mode(mode, compiled_steps, capsys):
    """Read from XLA's optimized program (2 CPU devices, Adam on 64-128-32). What XLA emits on CPU, recorded:

    - None: one all-reduce of every gradient; no all-gather.
    - "optimizer" and "gradients" (distkeras' own step; XLA's CPU pipeline alone would all-reduce the gradients and
      slice them, making no reduce-scatter of the two: GPU pipelines do, ReduceScatterCreator): one reduce-scatter
      of every gradient laid side by side (each device receives its halves) and no all-reduce of a gradient-sized
      buffer (only scalars: the loss, the metrics); the updated slices all-gathered in one collective, and nothing
      else (no gathering of the optimizer state the step passes whole to the loss scale).
    - "all": no weight and no weight-sized gradient crosses devices at all: XLA partitions each matmul by the
      weight's split (gathering the batch's activations instead, which are smaller here).

    Before XLA's passes, "gradients" and "all" carry a sharding constraint on every gradient (4 here) as they enter
    the optimizer, which "optimizer" lacks; "optimizer" and "gradients" one on every weight, sliced for the update.
    """
    x, y = _mlp_data()
    model = distkeras.distribute(_mlp(), devices=2, shard=mode)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    found = _collectives(compiled_steps[0])
    kernels = {tuple(sorted(v.shape)) for v in model.trainable_variables if len(v.shape) == 2}
    gathered = {tuple(sorted(shape)) for op, _, shape in found if op == "all-gather"}
    reduced = {tuple(sorted(shape)) for op, _, shape in found if op in ("all-reduce", "reduce-scatter")}
    if mode is None:
        assert kernels <= reduced and not gathered, found
    elif mode in ("optimizer", "gradients"):
        # One reduce-scatter of every gradient laid side by side; its result is the device's slices: half of
        # each one's split dimension (the largest). One all-gather of the updated slices laid the same way (not
        # one per weight): both devices' halves.
        halves = sum(math.prod(_half(v.shape)) for v in model.trainable_variables)
        scattered = [shape for op, _, shape in found if op == "reduce-scatter"]
        assert len(scattered) == 1 and math.prod(scattered[0]) == halves, found
        assert [shape for op, _, shape in found if op == "all-gather"] == [(2, halves)], found
        assert all(shape == () for op, _, shape in found if op == "all-reduce"), found
    else:
        assert not kernels & (gathered | reduced), found
    # Shardy's spelling (JAX >= 0.7) or GSPMD's custom call.
    constraints = len(re.findall(r"sharding_constraint|@Sharding\b", compiled_steps[1]))
    # And in "optimizer" and "gradients" each weight is constrained to its slice for the update (local slicing).
    count = len(model.trainable_variables)
    assert constraints == {None: 0, "optimizer": count, "gradients": 2 * count, "all": count}[mode], compiled_steps[1]
    err = capsys.readouterr().err
    if mode == "all":  # the 32-wide output bias divides by 2: only Adam's scalars are left whole, unnamed
        assert "stay whole" not in err


def _half(shape):
    shape = list(shape)
    shape[_split_dimension(shape, 2)] //= 2
    return tuple(shape)


def test_variables_no_dimension_of_which_divides_are_named(capsys):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = patterns._data()
    distkeras.distribute(model, devices=2, shard="all").fit(x, y, batch_size=12, epochs=2, verbose=0)
    err = capsys.readouterr().err
    named = [line for line in err.splitlines() if "stay whole" in line]
    assert len(named) == 1, err  # once, when the step is made, not at every fit
    for path in (model.layers[1].bias.path, "bias_momentum (3,)", "bias_velocity (3,)"):
        assert path in named[0], named
    assert "iteration" not in named[0]  # scalars: nothing to split
    from distkeras.backends.jax import uneven as jax_uneven
    from distkeras.backends.jax import shard as jax_shard

    distribution = list(jax_uneven._ours.keys())[-1]
    share = jax_shard.replicated_share(model, distribution)
    assert 0 < share < 0.05, share


def test_saved_model_is_plain_keras_with_the_optimizer_state(tmp_path):
    x, y = _mlp_data()
    model = distkeras.distribute(_mlp(), devices=2, shard="all")
    assert distkeras.describe(model)["shard"] == "all"
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert tuple(model.trainable_variables[0].value.sharding.spec) == (None, "batch")
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.trainable_variables[0].value.sharding.is_fully_replicated  # one device's plain arrays
    assert len(loaded.trainable_variables[0].value.sharding.device_set) == 1
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    for saved, live in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(live.value), err_msg=live.path)
    for w, v in zip(model.get_weights(), model.weights):
        assert w.shape == tuple(v.shape)  # get_weights() gathers: the whole arrays


@pytest.mark.parametrize("first, then", [("all", "optimizer"), ("gradients", None)])
def test_checkpoint_of_a_sharded_run_resumes_exactly_with_another_shard(tmp_path, first, then):
    x, y = _mlp_data(48)
    single = _mlp()
    single.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
    folder = str(tmp_path / "ckpt")
    model = distkeras.distribute(_mlp(), devices=2, shard=first)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(folder, delete_checkpoint=False)])
    resumed = distkeras.distribute(_mlp(seed=7), devices=2, shard=then)  # other initial weights: all restored
    backup = BackupAndRestore(folder)
    resumed.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    assert backup.restored_epoch == 2
    for e, a in zip(single.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    for e, a in zip(single.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(e.value), rtol=1e-5, atol=1e-5, err_msg=a.path)


def _tied_model():
    """An unbuilt subclassed model whose output layer is the embedding table, read outside the Embedding's call
    (the tied weight FSDP wrappers must special-case)."""

    class Tied(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(12, 8)
            self.hidden = keras.layers.Dense(8, activation="tanh")

        def call(self, ids):
            h = self.hidden(keras.ops.mean(self.embed(ids), axis=1))
            return keras.ops.matmul(h, keras.ops.transpose(self.embed.embeddings))

    keras.utils.set_random_seed(0)
    model = Tied()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_a_tied_weight_read_outside_its_layer_trains_as_on_one_device():
    """No "variable read outside call" problem on JAX: the sharded table is a global array, gathered by XLA
    wherever it is read. The model is built at its first fit, under the distribution: created sharded."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 12, size=(24, 5)).astype("int32")
    y = rng.normal(size=(24, 12)).astype("float32")
    single = _tied_model()
    single.fit(ids, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    model = distkeras.distribute(_tied_model(), devices=2, shard="all")
    model.fit(ids, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    table = model.embed.embeddings.value
    assert tuple(table.sharding.spec) == ("batch", None) and table.addressable_shards[0].data.shape == (6, 8)
    for e, a in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ("optimizer", "gradients"))
def test_compression_combines_with_optimizer_and_gradient_sharding(mode, compiled_steps):
    """With "gradients" each device's slices travel as 16-bit bits in one all-to-all (XLA's CPU compiler widens
    16-bit float collectives): no float32 collective of a kernel's gradient, only the updated slices gathered."""
    x, y = scenarios.data(48)
    built = []
    for _ in range(2):
        built.append(scenarios.build(keras))
        built[-1].compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    single, model = built
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    compiled_steps.clear()
    model = distkeras.distribute(model, devices=2, shard=mode, compression="bf16")
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    momentum = [v for v in model.optimizer.variables if tuple(v.shape) == (5, 16)][0]
    assert tuple(momentum.value.sharding.spec) == (None, "batch")
    for e, a in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, e, rtol=2e-2, atol=2e-2)  # 16-bit gradients: test_jax's tolerance
    if mode == "gradients":
        found = _collectives(compiled_steps[0])
        sent = [(op, dtype) for op, dtype, shape in found if op != "all-gather" and math.prod(shape) > 1]
        assert sent and set(sent) == {("all-to-all", "u16")}, found
    with pytest.raises(distkeras.OptionError, match="shard='all' and compression='bf16' don't combine"):
        distkeras.distribute(scenarios.build(keras), devices=2, shard="all", compression="bf16")


def test_gradients_with_an_own_train_step_keep_the_constraint_and_say_so(capsys):
    """A class' own train_step leaves no gradient for distkeras' step to scatter: XLA places the collectives (the
    gradients constrained to their layout), rank 0 says so once, and training is one device's."""

    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    def build():
        keras.utils.set_random_seed(0)
        model = OwnStep([keras.Input((5,)), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    x, y = scenarios.data(24)
    y = np.concatenate([y, y[:, :1]], axis=1)
    single = build()
    single.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model = distkeras.distribute(build(), devices=2, shard="gradients")
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert "train_step" not in model.__dict__
    assert "OwnStep.train_step is your own" in capsys.readouterr().err
    for e, a in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_shard_is_refused_with_model_parallel_and_bad_values():
    with pytest.raises(distkeras.OptionError, match=re.escape("shard='optimizer' applies to strategy='data'")):
        distkeras.distribute(scenarios.build(keras), devices=2, strategy="model", shard="optimizer")
    with pytest.raises(distkeras.OptionError, match="None, 'optimizer', 'gradients', 'all'"):
        distkeras.distribute(scenarios.build(keras), devices=2, shard="zero3")


def test_private_api_pin_shard():
    """The Keras privates :mod:`distkeras.backends.jax.shard` relies on: a variable's ``_layout`` (read by
    Keras when it assigns), ``_value`` (swapped while saving across processes), the optimizer's
    ``add_variable(..., layout=...)``, and the trainer module's ``jit`` the compiled-step test wraps."""
    import inspect

    from keras.src.backend.jax import trainer

    v = keras.Variable(np.zeros((2, 2), "float32"))
    assert hasattr(v, "_layout") and hasattr(v, "_value")
    assert "layout" in inspect.signature(keras.optimizers.Optimizer.add_variable).parameters
    assert callable(trainer.jit)


@pytest.fixture(scope="module")
def shard_job(tmp_path_factory):
    """One job of 2 processes (distkeras launch, one CPU device each) for both tests below: it runs "shard" then
    "shard-gradients", each on a fresh model, into a folder of its own (starting a job costs more than its
    training). ``shard_job(mode)`` gives that mode's folder and its lines of the output."""
    from tests.backends.test_multiworker import launch, mode_output

    out = tmp_path_factory.mktemp("shard")
    done, _ = launch(out, "shard,shard-gradients")

    def part(mode):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return os.path.join(str(out), mode), mode_output(done.stdout, mode)
    return part


def test_two_processes_shard_all_and_rank_0_saves_the_plain_model(shard_job):
    """Across processes (distkeras launch, one CPU device each) shard='all' splits the arrays over both
    processes' devices, so neither holds a whole kernel; save() gathers them and rank 0 writes the plain model,
    which trains what one process trains."""
    from tests.backends.test_multiworker import rank_weights, single_process_weights

    tmp_path, stdout = shard_job("shard")
    assert "[rank 1] sharded spec (None, 'batch') local (5, 8)" in stdout, stdout[-3000:]
    expected = single_process_weights()
    loaded = keras.saving.load_model(os.path.join(str(tmp_path), "model.keras"))
    for e, a in zip(expected, loaded.get_weights()):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    assert len(loaded.optimizer.variables) > 2  # SGD's momenta saved too
    for a, b in zip(rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(str(tmp_path))) == ["model.keras", "rank0.npz", "rank1.npz"]  # rank 1 wrote no file


def test_two_processes_shard_gradients_train_as_one_process(shard_job):
    """Across processes distkeras' shard step reduce-scatters the gradients and all-gathers the updated slices
    with rings of small ppermutes (steps._ring_reduce_scatter/_ring_all_gather; one process' devices use XLA's
    collectives): the ranks stay equal and train what one process trains. (In the shared job it follows the
    shard='all' fit in the same processes, on a model of its own.)"""
    from tests.backends.test_multiworker import rank_weights, single_process_weights

    tmp_path, stdout = shard_job("shard-gradients")
    expected = single_process_weights()
    r0, r1 = rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    for e, a in zip(expected, r0):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    assert "framework replicas 2" in stdout
