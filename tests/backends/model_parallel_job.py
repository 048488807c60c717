"""Model parallelism on JAX, the cases of test_jax_model_parallel.py: the models (built the same way in the test
process, for the one-device reference) and one worker of a multi-process job that trains them.

    DISTKERAS_CPU_DEVICES=N distkeras launch --nproc-per-node 2 -m tests.backends.model_parallel_job OUT_DIR CASE...

CASE is ``<model>-<model_shards>`` (model: "mlp", "block", "gemma", "llama"; every process' devices together form
the mesh), or ``resume-<model_shards>`` (the MLP stopped after epoch 1 with distkeras' BackupAndRestore, a new model
then resumed from the checkpoint). For each case every rank writes OUT_DIR/<case>-rank<R>.npz: the weights after
fit() (``get_weights()``), the History losses, evaluate()'s loss and predict()'s outputs (not for "resume"), and
describe() as JSON; every rank calls ``save(OUT_DIR/<case>.keras)`` (rank 0 writes it; not for "resume").
"""

import json
import os
import sys

import distkeras  # first: jax.distributed starts before JAX's first computation

import keras  # noqa: E402
import numpy as np  # noqa: E402

from distkeras.callbacks import BackupAndRestore  # noqa: E402

EPOCHS = 2
BATCH = 8
SAMPLES = 32
VOCAB, LENGTH, HIDDEN = 64, 8, 16


def mlp():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="d1"),
        keras.layers.Dense(8, activation="tanh", name="d2"),
        keras.layers.Dense(4, name="d3"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


#: Megatron's pairs: d1 by columns, d2 by rows; d3 left to the default (replicated here).
MLP_LAYOUT = {".*/d1/kernel": (None, "model"), ".*/d1/bias": ("model",), ".*/d2/kernel": ("model", None)}


def block():
    """A transformer block over token ids: embedding, 4-head attention, a feed-forward pair, a vocabulary head."""
    keras.utils.set_random_seed(7)
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, HIDDEN, name="emb")(tokens)
    a = keras.layers.MultiHeadAttention(4, HIDDEN // 4, name="mha")(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="ln1")(h + a)
    f = keras.layers.Dense(2 * HIDDEN, activation="gelu", name="ff1")(h)
    h = keras.layers.LayerNormalization(name="ln2")(h + keras.layers.Dense(HIDDEN, name="ff2")(f))
    logits = keras.layers.Dense(VOCAB, name="head")(h)
    model = keras.Model(tokens, logits)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


#: Heads split (Q/K/V by heads, the output projection by its heads axis), the feed-forward pair column then row.
BLOCK_LAYOUT = {
    "emb/embeddings": (None, "model"),
    "mha/(query|key|value)/kernel": (None, "model", None),
    "mha/(query|key|value)/bias": ("model", None),
    "mha/attention_output/kernel": ("model", None, None),
    "ff1/kernel": (None, "model"),
    "ff1/bias": ("model",),
    "ff2/kernel": ("model", None),
    "head/kernel": (None, "model"),
}


def hub(kind):
    """A tiny KerasHub causal LM (no preprocessor, no preset): Gemma or Llama."""
    import keras_hub

    keras.utils.set_random_seed(7)
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=4, hidden_dim=HIDDEN,
            intermediate_dim=32, head_dim=4, dtype="float32")
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=4, hidden_dim=HIDDEN,
            intermediate_dim=32, dtype="float32")
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[])
    return model


def hub_layout(model, replicas, model_shards):
    """The backbone's own ``get_layout_map`` for a ("batch", "model") mesh of that shape (only its axes' names and
    sizes matter to distkeras, which lays the model over its own mesh)."""
    devices = np.array(keras.distribution.list_devices()[:replicas * model_shards])
    mesh = keras.distribution.DeviceMesh((replicas, model_shards), ["batch", "model"], devices)
    return model.backbone.get_layout_map(mesh)


def data(name):
    rng = np.random.default_rng(3)
    if name == "mlp" or name == "resume":
        x = rng.normal(size=(SAMPLES, 8)).astype("float32")
        return x, np.tanh(x[:, :4] * 2 + x[:, 4:]).astype("float32")
    tokens = rng.integers(0, VOCAB, size=(SAMPLES, LENGTH + 1)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    if name in ("gemma", "llama"):
        return {"token_ids": x, "padding_mask": np.ones_like(x, dtype=bool)}, y
    return x, y


def build(name):
    return {"mlp": mlp, "resume": mlp, "block": block}[name]() if name not in ("gemma", "llama") else hub(name)


def options(name, model, devices, model_shards):
    """distribute()'s options for ``name`` on a mesh of ``devices`` devices (every process' together)."""
    layout = {"mlp": MLP_LAYOUT, "resume": MLP_LAYOUT, "block": BLOCK_LAYOUT}.get(name)
    if layout is None:
        layout = hub_layout(model, devices // model_shards, model_shards)
    return {"strategy": "model", "model_shards": model_shards, "layout_map": layout}


def distributed(name, model_shards, devices=None):
    """``name``'s model built and distributed over ``devices`` (default: every device of every process)."""
    count = devices or len(keras.distribution.list_devices())
    model = build(name)
    return distkeras.distribute(model, devices=devices, **options(name, model, count, model_shards))


def train(model, name, callbacks=(), epochs=EPOCHS):
    x, y = data(name)
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))


def results(model, name, history):
    """What a case compares with one device: weights, History losses, evaluate() and predict()."""
    x, y = data(name)
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "loss": np.asarray(history.history["loss"]),
        "evaluate": np.asarray(model.evaluate(x, y, batch_size=BATCH, verbose=0)),
        "predict": np.asarray(model.predict(x, batch_size=BATCH, verbose=0)),
    }


class StopAfterEpoch(keras.callbacks.Callback):
    """A run that dies after its first epoch's checkpoint (every rank alike)."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt("stopped after epoch 1")


def run_case(out_dir, case):
    name, _, shards = case.rpartition("-")
    rank = distkeras.cluster.from_env().rank
    model = distributed(name, int(shards))
    if name == "resume":
        backup = os.path.join(out_dir, case + "-ckpt")
        try:
            train(model, name, [BackupAndRestore(backup), StopAfterEpoch()])
        except KeyboardInterrupt:
            pass
        model = build(name)
        model.set_weights([w + 1.0 for w in model.get_weights()])  # not the weights to resume from
        model = distkeras.distribute(model, **options(name, model, len(keras.distribution.list_devices()),
                                                      int(shards)))
        callback = BackupAndRestore(backup)
        history = train(model, name, [callback])
        history.history["restored_epoch"] = [callback.restored_epoch]
        found = {"weights": model.get_weights(), "loss": np.asarray(history.history["loss"]), "evaluate": np.zeros(()),
                 "predict": np.zeros(())}
    else:
        history = train(model, name)
        found = results(model, name, history)
        model.save(os.path.join(out_dir, case + ".keras"))
    arrays = {"arr_{}".format(i): w for i, w in enumerate(found["weights"])}
    np.savez(os.path.join(out_dir, "{}-rank{}.npz".format(case, rank)), loss=found["loss"],
             evaluate=found["evaluate"], predict=found["predict"], **arrays)
    with open(os.path.join(out_dir, "{}-rank{}.json".format(case, rank)), "w") as f:
        json.dump({"describe": distkeras.describe(model), "history": {k: list(map(float, v)) for k, v in
                                                                     history.history.items()}}, f)


def main():
    out_dir = sys.argv[1]
    for case in sys.argv[2:]:
        run_case(out_dir, case)


if __name__ == "__main__":
    main()
