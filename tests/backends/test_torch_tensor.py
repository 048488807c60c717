"""Tensor parallelism on PyTorch (strategy="model"): a Megatron-style split over 2 real processes (gloo) trains
what one device trains at the same batch, for an MLP (a column/row pair and a column split alone) and a
transformer block (embedding by vocabulary, attention by heads, a feed-forward pair, LayerNorm and Dropout
replicated); each process really holds half of each split kernel and of its Adam slots (read from torch); the
saved model is the plain one, loading without distkeras and predicting the same; BackupAndRestore resumes to the
uninterrupted run; what can't be split is a clear error naming it."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.harness import BACKEND, job, keras

import distkeras
import distkeras.callbacks

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="tensor parallelism by process groups is PyTorch's "
                                "(JAX's strategy='model' is tested in its own module)")

RNG = np.random.default_rng(0)
X_MLP, Y_MLP = RNG.normal(size=(32, 6)).astype("float32"), RNG.normal(size=(32, 1)).astype("float32")
X_TOK, Y_TOK = RNG.integers(0, 16, size=(24, 6)).astype("int32"), RNG.integers(0, 3, size=(24,)).astype("int32")
MLP_LAYOUT = {"up/kernel": (None, "model"), "down/kernel": ("model", None), "alone/kernel": (None, "model")}
BLOCK_LAYOUT = {"embed/embeddings": ("model", None), "attn/query/kernel": (None, "model", None),
                "ff1/kernel": (None, "model"), "ff2/kernel": ("model", None)}


def mlp(l2=0.0):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    regularizer = keras.regularizers.L2(l2) if l2 else None
    h = keras.layers.Dense(8, activation="relu", name="up", kernel_regularizer=regularizer)(inputs)
    h = keras.layers.Dense(6, name="down", kernel_regularizer=regularizer)(h)
    h = keras.layers.Dense(4, activation="tanh", name="alone")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def block(attention_dropout=0.0):
    keras.utils.set_random_seed(2)
    ids = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(16, 8, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=attention_dropout, name="attn")(x, x)
    x = keras.layers.LayerNormalization(name="ln1")(x + a)
    h = keras.layers.Dense(16, activation="relu", name="ff1")(x)
    x = keras.layers.LayerNormalization(name="ln2")(x + keras.layers.Dense(8, name="ff2")(h))
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Dropout(0.1)(x))
    model = keras.Model(ids, keras.layers.Dense(3, name="head")(x))
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


MODELS = {"mlp": (mlp, X_MLP, Y_MLP, MLP_LAYOUT), "block": (block, X_TOK, Y_TOK, BLOCK_LAYOUT),
          "mlp-l2": (lambda: mlp(l2=0.05), X_MLP, Y_MLP, MLP_LAYOUT)}


def train(name, split, layout=None, epochs=2, save=None, backup=None, stop_at=None, shuffle=True):
    """One run: weights, History, evaluate, predict, describe and the local shapes of the kernels and slots."""
    build, x, y, _ = MODELS[name]
    model = build()
    if split:
        model = distkeras.distribute(model, 2, strategy="model", layout_map=layout, model_shards=2)
    callbacks = []
    if backup is not None:
        callbacks.append(distkeras.callbacks.BackupAndRestore(backup, delete_checkpoint=False))
    if stop_at is not None:
        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: (_ for _ in ()).throw(KeyboardInterrupt) if epoch == stop_at else None))
    try:
        history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks, shuffle=shuffle).history
    except KeyboardInterrupt:
        return None
    local = {v.path: tuple(v._value.shape) for v in model.trainable_weights}  # the storage torch holds
    slots = {v.path: tuple(v._value.shape) for v in model.optimizer.variables if len(v.shape) > 1}
    result = {"weights": model.get_weights(), "history": history, "evaluate": model.evaluate(x, y, verbose=0),
              "predict": model.predict(x[:5], verbose=0), "local": local, "slots": slots,
              "describe": distkeras.describe(model) if split else None}
    if save is not None:
        model.save(save)
    return result


def assert_same(one, split, atol=2e-5):
    assert len(one["weights"]) == len(split["weights"])
    for a, b in zip(one["weights"], split["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    for key in one["history"]:
        np.testing.assert_allclose(one["history"][key], split["history"][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one["evaluate"], split["evaluate"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one["predict"], split["predict"], rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name, layout", [("mlp", "given"), ("block", "given"), ("block", "default"),
                                          ("mlp-l2", "given")])
def test_split_over_two_processes_trains_as_one_device(name, layout, tmp_path):
    one = train(name, split=False)
    given = MODELS[name][3] if layout == "given" else None
    outcomes = job(2).run(train, name, True, given, save=str(tmp_path / "model.keras"))
    ranks = [o.result for o in outcomes]
    for result in ranks:
        assert_same(one, result)
        assert result["describe"]["replicas"] == 1 and result["describe"]["model_shards"] == 2
    full = {v.path: tuple(v.shape) for v in MODELS[name][0]().trainable_weights}
    # Each process holds half of every split kernel (and of its Adam slots); the rest whole.
    halved = {"mlp": ["up/kernel", "up/bias", "down/kernel", "alone/kernel", "alone/bias"],
              "block": ["attn/query/kernel", "attn/key/kernel", "attn/value/kernel", "attn/attention_output/kernel",
                        "attn/query/bias", "attn/key/bias", "attn/value/bias", "ff1/kernel", "ff1/bias", "ff2/kernel"] + (["embed/embeddings"] if layout == "given" else [])}[name.replace("-l2", "")]
    for path, shape in ranks[0]["local"].items():
        if path in halved:
            assert np.prod(shape) * 2 == np.prod(full[path]), (path, shape, full[path])
        else:
            assert shape == full[path], (path, shape)
    assert any(np.prod(shape) * 2 == np.prod(full["ff1/kernel" if name == "block" else "up/kernel"])
               for shape in ranks[0]["slots"].values())
    if layout == "default":
        return  # the saved model is checked once per model (below)
    # The saved file is the plain model: a process without distkeras loads it and predicts the same.
    script = ("import sys, numpy as np, keras; m = keras.saving.load_model(sys.argv[1]); "
              "np.save(sys.argv[2], m.predict(np.load(sys.argv[3]), verbose=0)); assert 'distkeras' not in sys.modules")
    np.save(tmp_path / "x.npy", MODELS[name][1][:5])
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.keras"), str(tmp_path / "p.npy"),
                    str(tmp_path / "x.npy")], check=True, env=dict(os.environ, KERAS_BACKEND="torch"), timeout=120)
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), one["predict"], rtol=1e-4, atol=2e-5)


def test_two_replicas_of_two_model_shards_on_four_processes_train_as_one_device():
    """A 2 x 2 mesh over 2 simulated hosts: processes 0-1 and 2-3 each hold one replica split in two, each half of
    the global batch; the shards' gradients are all-reduced among the replicas (groups 0,2 and 1,3)."""
    one = train("block", split=False)
    outcomes = job(4, local_size=2).run(train, "block", True, BLOCK_LAYOUT)  # 2 hosts x 2, as test_torch.py's
    for outcome in outcomes:
        assert_same(one, outcome.result)
        assert outcome.result["describe"]["replicas"] == 2 and outcome.result["describe"]["model_shards"] == 2
    assert outcomes[0].result["local"]["ff1/kernel"] == (8, 8) and outcomes[3].result["local"]["ff1/kernel"] == (8, 8)
    # verify=True on the mesh: each replica's rows gathered, the metrics summed over the replicas only; nothing
    # found, and the training is the unchecked one's bit for bit.
    pool = job(4, local_size=2)
    checked = [o.result for o in pool.run(verified, "block", True)]
    plain = [o.result for o in pool.run(verified, "block", False)]
    for on, off in zip(checked, plain):
        assert "error" not in on and on["checked"] == 1 and on["skipped"] is None, on
        for a, b in zip(on["weights"], off["weights"]):
            np.testing.assert_array_equal(a, b)


def test_backup_and_restore_resumes_a_split_model_to_the_uninterrupted_run(tmp_path):
    # Unshuffled: an epoch-end checkpoint keeps no random state (Keras' BackupAndRestore neither).
    one = train("mlp", split=False, epochs=3, shuffle=False)
    backup = str(tmp_path / "backup")
    assert job(2).run(train, "mlp", True, MLP_LAYOUT, 3, None, backup, 2, False)[0].result is None  # stopped
    resumed = job(2).run(train, "mlp", True, MLP_LAYOUT, 3, None, backup, None, False)[0].result
    for a, b in zip(one["weights"], resumed["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    assert len(resumed["history"]["loss"]) == 1  # only the epoch left ran


def refused(options, model="mlp"):
    try:
        name = model.replace("-clipped", "").replace("-orthogonal", "")
        built = MODELS[name][0]() if name in MODELS else block(0.1)
        if model.endswith("-clipped"):
            built.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0), loss="mse")
        if model == "mlp-orthogonal":  # a regularizer that doesn't add up over the kernel's elements
            built.get_layer("up").kernel.regularizer = keras.regularizers.OrthogonalRegularizer(0.01)
        distkeras.distribute(built, 2, strategy="model", **options)
    except distkeras.DistKerasError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("options, model, expected", [
    ({"model_shards": 3}, "mlp", "Expected model_shards to be a positive int that divides the 2 devices"),
    ({"shard": "all"}, "mlp", "shard applies to strategy='data' on PyTorch"),
    ({"layout_map": {"up/kernel": (None, "model"), "head/.*": ("model",)}}, "mlp",
     "Expected 2 axes for head/kernel"),
    ({"layout_map": {"up/kernel": ("rows", None)}}, "mlp", "Expected layout_map['up/kernel'] to be axes"),
    ({"layout_map": {"attn/query/kernel": (None, "model", None)}}, "dropout", "with dropout=0.1"),
    ({}, "mlp-clipped", "has global_clipnorm=1.0, a norm over whole gradients"),
    ({"layout_map": MLP_LAYOUT}, "mlp-orthogonal", "Received: OrthogonalRegularizer on 'up/kernel'"),
], ids=["model_shards", "shard", "rank", "axes", "attention dropout", "global_clipnorm", "regularizer"])
def test_what_cant_be_split_is_a_clear_error(options, model, expected):
    kind, message = job(2).run(refused, options, model)[0].result
    assert kind == "OptionError" and expected in message, message


def conv():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.Conv1D(4, 3, name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(1, name="out")], name="convnet")
    model.compile(optimizer="sgd", loss="mse")
    try:
        distkeras.distribute(model, 2, strategy="model", layout_map={"convnet/conv/kernel": (None, None, "model")})
    except distkeras.DistKerasError as exc:
        return str(exc)


def test_a_layer_it_cant_split_is_named():
    message = job(2).run(conv)[0].result
    assert "layout_map splits convnet/conv/kernel, which it can't" in message, message


def test_the_keras_privates_it_reads_are_there():
    """Pins what distkeras.backends.torch.tensor reads of Keras (privates: no public way exists): a variable's
    torch storage and shape, MultiHeadAttention's sub-layers and settings, a layer's graph nodes."""
    model = block()
    attention = model.get_layer("attn")
    for name in ("_query_dense", "_key_dense", "_value_dense", "_output_dense"):
        assert isinstance(getattr(attention, name), keras.layers.EinsumDense)
    assert attention._num_heads == 2 and attention._dropout == 0.0
    variable = model.get_layer("ff1").kernel
    assert tuple(variable._value.shape) == variable._shape == (8, 16)
    dense = model.get_layer("ff1")
    assert [node.input_tensors[0]._keras_history.operation for node in dense._inbound_nodes] == [model.get_layer("ln1")]
    assert dense in list(model._flatten_layers(include_self=False))


def causal_lm(kind, split):
    """A tiny KerasHub causal LM (from its config, no preset) trained on token ids, split by its own backbone's
    get_layout_map(mesh) where ``split``: weights, History, evaluate."""
    import keras_hub

    keras.utils.set_random_seed(4)
    common = dict(vocabulary_size=32, num_layers=2, num_query_heads=2, num_key_value_heads=2, hidden_dim=8,
                  intermediate_dim=16)
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(head_dim=4, dropout=0.0, **common)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(**common)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(0.01), weighted_metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if split:
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
        model = distkeras.distribute(model, 2, strategy="model", layout_map=backbone.get_layout_map(mesh))
    tokens = np.random.default_rng(0).integers(1, 32, size=(16, 7)).astype("int32")
    x, y = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 6), "int32")}, tokens[:, 1:]
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    local = {v.path: tuple(v._value.shape) for v in model.trainable_weights}
    return {"weights": model.get_weights(), "history": history, "evaluate": model.evaluate(x, y, verbose=0),
            "local": local}


@pytest.mark.parametrize("kind", ["gemma", "llama"])
def test_a_kerashub_causal_lm_split_by_its_own_layout_map_trains_as_one_device(kind):
    pytest.importorskip("keras_hub")
    one = causal_lm(kind, False)
    split = job(2).run(causal_lm, kind, True)[0].result
    for a, b in zip(one["weights"], split["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(one["history"]["loss"], split["history"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(one["evaluate"], split["evaluate"], rtol=1e-5)
    assert split["local"]["token_embedding/embeddings"] == (16, 8)  # the vocabulary split in two


def shard_storage():
    """The bytes each split variable's torch storage holds after the split (a view of the whole would hold it all)."""
    model = block()
    distkeras.distribute(model, 2, strategy="model", layout_map=BLOCK_LAYOUT)
    return {v.path: (v._value.untyped_storage().nbytes(), v._value.numel() * v._value.element_size())
            for v in model.weights}


def test_a_shard_holds_only_its_own_memory():
    for path, (storage, shard) in job(2).run(shard_storage)[0].result.items():
        assert storage == shard, path  # a row split (its first axis) was a view keeping the whole kernel alive


def verified(name, verify, revert=False):
    """Two epochs split over the 2 processes with ``verify``: the weights, the steps the check compared and why it
    skipped any, or the VerifyError. ``revert``: the regularization of a split variable left unsummed over the
    model shards (the fix of c737ff8 reverted: the loss each shard computes and logs leaves the other parts out)."""
    from distkeras.backends.torch import tensor

    build, x, y, layout = MODELS[name]
    model = build()
    summed = tensor.sum_regularization
    if revert:
        tensor.sum_regularization = lambda model, splits: None
    try:
        distkeras.distribute(model, 2, strategy="model", layout_map=layout, model_shards=2, verify=verify)
    finally:
        tensor.sum_regularization = summed  # the job's processes serve later tests too
    try:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    except distkeras.VerifyError as error:
        return {"error": str(error)}
    check = model.__dict__.get("_distkeras_check")
    return {"weights": model.get_weights(), "checked": check.checked if check else None,
            "skipped": check.skipped if check else None, "local": [tuple(v._value.shape) for v in model.weights]}


@pytest.mark.parametrize("name", ["mlp", "block"])
def test_the_one_device_check_replays_a_split_model_and_changes_nothing(name):
    """verify=True on model shards: each fit's first step is replayed as one device (every split variable and slot
    gathered whole on every process, in new Parameters), nothing is found, the training is bit for bit the
    unchecked one's, and the next steps still run split (autograd kept no whole shape of a split Parameter)."""
    pool = job(2)
    checked = [o.result for o in pool.run(verified, name, True)]
    plain = [o.result for o in pool.run(verified, name, False)]
    for on, off in zip(checked, plain):
        assert "error" not in on, on.get("error")
        assert on["checked"] == 1 and on["skipped"] is None, on
        assert on["local"] == off["local"]  # still split after the check
        for a, b in zip(on["weights"], off["weights"]):
            np.testing.assert_array_equal(a, b)


def test_the_one_device_check_catches_a_split_regularizer_left_unsummed():
    """The defect c737ff8 fixed, reverted: each model shard adds only its own part's L2 to the loss. Training
    steps are the same (each part's gradient is its own), but the loss the step reports is not one device's; the
    check names it on every process."""
    outcomes = [o.result for o in job(2).run(verified, "mlp-l2", True, True)]
    for result in outcomes:
        assert "error" in result, result
        assert "loss" in result["error"], result["error"]
