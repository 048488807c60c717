"""Text classification with a small transformer block, data-parallel. Lines marked `# distkeras:` are the only
changes from the single-device script; the rest runs unchanged on TensorFlow, JAX or PyTorch.

    KERAS_BACKEND=jax DISTKERAS_CPU_DEVICES=2 python examples/text_classification.py

The model is keras.io's "Text classification with Transformer" (token and position embeddings, one
self-attention block, pooling, a softmax). The data is generated, nothing is downloaded: sequences of word ids in
which a review is positive when it holds more "good" words (ids 1-10) than "bad" ones (ids 11-20). Replace
`make_reviews` with your tokenized text (`keras.layers.TextVectorization` gives such ids).
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
import numpy as np
from keras import layers, ops

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--samples", type=int, default=4000)
parser.add_argument("--out", default="text_classification.keras")
args = parser.parse_args()

VOCAB, LENGTH = 2000, 40


def make_reviews(count, seed):
    rng = np.random.default_rng(seed)
    words = rng.integers(21, VOCAB, size=(count, LENGTH))
    sentiment = rng.integers(1, 21, size=(count, 6))  # six sentiment words per review, good (1-10) or bad (11-20)
    words[:, rng.choice(LENGTH, 6, replace=False)] = sentiment
    labels = ((sentiment <= 10).sum(axis=1) > 3).astype("int32")
    return words.astype("int32"), labels


@keras.saving.register_keras_serializable(package="examples")
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.config = dict(embed_dim=embed_dim, num_heads=num_heads, ff_dim=ff_dim, rate=rate)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attention = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attention)
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1), training=training))

    def get_config(self):
        return {**super().get_config(), **self.config}


@keras.saving.register_keras_serializable(package="examples")
class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.config = dict(maxlen=maxlen, vocab_size=vocab_size, embed_dim=embed_dim)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)

    def get_config(self):
        return {**super().get_config(), **self.config}


x_train, y_train = make_reviews(args.samples, seed=0)
x_test, y_test = make_reviews(max(args.samples // 4, 64), seed=1)

inputs = layers.Input(shape=(LENGTH,), dtype="int32")
x = TokenAndPositionEmbedding(LENGTH, VOCAB, 32)(inputs)
x = TransformerBlock(32, 2, 32)(x)
x = layers.GlobalAveragePooling1D()(x)
x = layers.Dropout(0.1)(x)
x = layers.Dense(20, activation="relu")(x)
outputs = layers.Dense(2, activation="softmax")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

model = distkeras.distribute(model)  # distkeras: every GPU, else every (virtual) CPU device
batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 reviews per replica

model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
if distkeras.is_main_process():  # distkeras: one process prints and writes (PyTorch runs one per device)
    print("test accuracy: {:.4f}".format(accuracy))
    model.save(args.out)  # a plain Keras model: keras.saving.load_model() needs no distkeras
