"""Fine-tuning a KerasHub model (a BERT text classifier), data-parallel. Lines marked `# distkeras:` are the only
changes from the single-device script; the rest runs unchanged on TensorFlow, JAX or PyTorch.

    KERAS_BACKEND=jax DISTKERAS_CPU_DEVICES=2 python examples/keras_hub_finetune.py
    KERAS_BACKEND=jax python examples/keras_hub_finetune.py --preset bert_tiny_en_uncased   # a real checkpoint

By default the backbone is a tiny BERT built from its config (random weights, nothing downloaded), standing in
for a pretrained one; `--preset` loads a KerasHub preset instead (downloaded from Kaggle or Hugging Face on first
use). The data is generated token ids (a review is positive when it holds more "good" word ids than "bad" ones),
the features a BERT preprocessor makes; with a preset, leave out `preprocessor=None` to give fit() raw strings,
which the preset's own preprocessor tokenizes. Needs keras-hub (`pip install keras-hub`).
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
import keras_hub
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default=None, help="a KerasHub preset, e.g. bert_tiny_en_uncased (downloads it)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--samples", type=int, default=2000)
parser.add_argument("--out", default="keras_hub_finetune.keras")
args = parser.parse_args()

VOCAB, LENGTH = 1000, 32

if args.preset:
    classifier = keras_hub.models.BertTextClassifier.from_preset(args.preset, num_classes=2, preprocessor=None)
else:
    backbone = keras_hub.models.BertBackbone(  # bert_tiny_en_uncased is 2 layers, 2 heads, 128 wide
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=LENGTH)
    classifier = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
classifier.compile(optimizer=keras.optimizers.AdamW(5e-4),  # fine-tuning: every weight, a small learning rate
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


def make_reviews(count, seed):
    """What the preprocessor would give: token ids, segment ids and the padding mask, and the labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(30, VOCAB, size=(count, LENGTH))
    sentiment = rng.integers(10, 30, size=(count, 6))  # good words 10-19, bad words 20-29
    ids[:, 1:7] = sentiment
    ids[:, 0] = 2  # [CLS]
    labels = ((sentiment < 20).sum(axis=1) > 3).astype("int32")
    features = {"token_ids": ids.astype("int32"), "segment_ids": np.zeros_like(ids, dtype="int32"),
                "padding_mask": np.ones_like(ids, dtype=bool)}
    return features, labels


x_train, y_train = make_reviews(args.samples, seed=0)
x_test, y_test = make_reviews(max(args.samples // 4, 64), seed=1)

classifier = distkeras.distribute(classifier)  # distkeras: every GPU, else every (virtual) CPU device
batch_size = distkeras.global_batch_size(16, classifier)  # distkeras: 16 reviews per replica

classifier.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = classifier.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
if distkeras.is_main_process():  # distkeras: one process prints and writes
    print("test accuracy: {:.4f}".format(accuracy))
    classifier.save(args.out)  # a plain KerasHub task: keras.saving.load_model() needs no distkeras
