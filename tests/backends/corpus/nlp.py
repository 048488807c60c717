"""NLP programs of keras-io's examples/nlp, on generated token ids (no downloads, no TextVectorization corpus)."""

import numpy as np

import distkeras
from tests.backends.corpus.common import ALL, BN_ADAM, evaluate, fit, keras, labels, predict, result, rng, tokens
from tests.backends.realcode import _transformer_layers  # the TransformerBlock both suites' examples share

K = "examples/nlp/"
#: nmt_transformer fails on one device already on TensorFlow (TransformerDecoder.call unpacks its ``mask``, which
#: TensorFlow's graph can't iterate) and on JAX (ops.tile with multiples built from a traced batch size): PyTorch only.
RATIO = ("not-one-device: CustomNonPaddingTokenLoss returns ops.sum(loss) / ops.sum(mask), a ratio of sums over the "
         "batch, so each replica divides by its own count of non-padding tokens")
HAND_SUM = ("not-one-device: compute_loss returns keras.ops.sum(loss) of per-token losses: a sum written by hand "
            "over each replica's rows, where one device sums over the global batch")


def text_classification_from_scratch(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(20)
    max_features, embedding_dim = 40, 8
    inputs = k.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(max_features, embedding_dim)(inputs)
    x = layers.Dropout(0.5)(x)
    x = layers.Conv1D(8, 3, padding="valid", activation="relu", strides=2)(x)
    x = layers.Conv1D(8, 3, padding="valid", activation="relu", strides=2)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = k.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x_train, y_train = tokens(21, 24, 16, max_features), labels(22, 24, 2).astype("float32")
    history = fit(model, x_train, y_train, validation_data=(x_train[:12], y_train[:12]))
    return result(model, history, evaluate(model, x_train[:12], y_train[:12]))


def bidirectional_lstm_imdb(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(21)
    max_features, maxlen = 30, 10
    r = rng(23)
    sequences = [list(r.integers(1, max_features, size=int(n))) for n in r.integers(4, 14, size=36)]
    x = k.utils.pad_sequences(sequences, maxlen=maxlen)
    y = labels(24, 36, 2).astype("float32")
    x_train, y_train, x_val, y_val = x[:24], y[:24], x[24:], y[24:]
    inputs = k.Input(shape=(None,), dtype="int32")
    h = layers.Embedding(max_features, 8)(inputs)
    h = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(h)
    h = layers.Bidirectional(layers.LSTM(4))(h)
    outputs = layers.Dense(1, activation="sigmoid")(h)
    model = k.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    history = fit(model, x_train, y_train, validation_data=(x_val, y_val))
    return result(model, history, predicted=predict(model, x_val))


def pretrained_word_embeddings(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(22)
    num_tokens, embedding_dim, num_classes = 30, 6, 4
    embedding_matrix = rng(25).normal(size=(num_tokens, embedding_dim)).astype("float32")  # "GloVe", generated
    embedding_layer = layers.Embedding(num_tokens, embedding_dim, trainable=False)
    embedding_layer.build((1,))
    embedding_layer.set_weights([embedding_matrix])
    int_sequences_input = k.Input(shape=(None,), dtype="int32")
    embedded_sequences = embedding_layer(int_sequences_input)
    x = layers.Conv1D(8, 3, activation="relu")(embedded_sequences)
    x = layers.MaxPooling1D(2)(x)
    x = layers.Conv1D(8, 3, activation="relu")(x)
    x = layers.MaxPooling1D(2)(x)
    x = layers.Conv1D(8, 3, activation="relu")(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    preds = layers.Dense(num_classes, activation="softmax")(x)
    model = k.Model(int_sequences_input, preds)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="rmsprop", metrics=["acc"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x_train, y_train = tokens(26, 24, 24, num_tokens), labels(27, 24, num_classes)
    history = fit(model, x_train, y_train, validation_data=(x_train[:12], y_train[:12]))
    return result(model, history, predicted=predict(model, x_train[:12]))


def _nmt_layers(k):
    layers, ops = k.layers, k.ops

    class TransformerEncoder(layers.Layer):
        def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
            super().__init__(**kwargs)
            self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.dense_proj = k.Sequential([layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm_1 = layers.LayerNormalization()
            self.layernorm_2 = layers.LayerNormalization()
            self.supports_masking = True

        def call(self, inputs, mask=None):
            padding_mask = ops.cast(mask[:, None, :], dtype="int32") if mask is not None else None
            attention_output = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
            proj_input = self.layernorm_1(inputs + attention_output)
            proj_output = self.dense_proj(proj_input)
            return self.layernorm_2(proj_input + proj_output)

    class PositionalEmbedding(layers.Layer):
        def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.position_embeddings = layers.Embedding(input_dim=sequence_length, output_dim=embed_dim)

        def call(self, inputs):
            length = ops.shape(inputs)[-1]
            positions = ops.arange(0, length, 1)
            return self.token_embeddings(inputs) + self.position_embeddings(positions)

        def compute_mask(self, inputs, mask=None):
            return ops.not_equal(inputs, 0)

    class TransformerDecoder(layers.Layer):
        def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
            super().__init__(**kwargs)
            self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.dense_proj = k.Sequential([layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm_1 = layers.LayerNormalization()
            self.layernorm_2 = layers.LayerNormalization()
            self.layernorm_3 = layers.LayerNormalization()
            self.supports_masking = True

        def call(self, inputs, mask=None):
            inputs, encoder_outputs = inputs
            causal_mask = self.get_causal_attention_mask(inputs)
            if mask is None:
                inputs_padding_mask, encoder_outputs_padding_mask = None, None
            else:
                inputs_padding_mask, encoder_outputs_padding_mask = mask
            attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs, attention_mask=causal_mask,
                                                  query_mask=inputs_padding_mask)
            out_1 = self.layernorm_1(inputs + attention_output_1)
            attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs, key=encoder_outputs,
                                                  query_mask=inputs_padding_mask,
                                                  key_mask=encoder_outputs_padding_mask)
            out_2 = self.layernorm_2(out_1 + attention_output_2)
            proj_output = self.dense_proj(out_2)
            return self.layernorm_3(out_2 + proj_output)

        def get_causal_attention_mask(self, inputs):
            input_shape = ops.shape(inputs)
            batch_size, sequence_length = input_shape[0], input_shape[1]
            i = ops.arange(sequence_length)[:, None]
            j = ops.arange(sequence_length)
            mask = ops.cast(i >= j, dtype="int32")
            mask = ops.reshape(mask, (1, input_shape[1], input_shape[1]))
            mult = ops.concatenate([ops.expand_dims(batch_size, -1), ops.convert_to_tensor([1, 1])], axis=0)
            return ops.tile(mask, mult)

    return TransformerEncoder, PositionalEmbedding, TransformerDecoder


def _padded(seed, samples, length, vocab):
    """Token ids 1..vocab-1 followed by 0-padding of a random length per row (at least 2 tokens)."""
    r = rng(seed)
    x = r.integers(1, vocab, size=(samples, length)).astype("int64")
    for row, n in zip(x, r.integers(2, length + 1, size=samples)):
        row[n:] = 0
    return x


def nmt_transformer(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(23)
    TransformerEncoder, PositionalEmbedding, TransformerDecoder = _nmt_layers(k)
    embed_dim, latent_dim, num_heads, vocab_size, sequence_length = 8, 8, 2, 20, 6
    encoder_inputs = k.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    decoder_inputs = k.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)([x, encoder_outputs])
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(vocab_size, activation="softmax")(x)
    transformer = k.Model({"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs}, decoder_outputs,
                          name="transformer")
    transformer.compile("rmsprop", loss=k.losses.SparseCategoricalCrossentropy(ignore_class=0), metrics=["accuracy"])
    if devices > 1:
        transformer = distkeras.distribute(transformer, devices)
    eng, spa = _padded(28, 24, sequence_length, vocab_size), _padded(29, 24, sequence_length + 1, vocab_size)
    inputs = {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}
    history = fit(transformer, inputs, spa[:, 1:], validation_data=(inputs, spa[:, 1:]))
    return result(transformer, history)


def lstm_seq2seq(devices):
    k = keras()
    k.utils.set_random_seed(24)
    num_encoder_tokens, num_decoder_tokens, latent_dim = 7, 6, 8
    r = rng(30)
    encoder_input_data = np.eye(num_encoder_tokens, dtype="float32")[r.integers(0, num_encoder_tokens, size=(30, 5))]
    decoder_ids = r.integers(0, num_decoder_tokens, size=(30, 5))
    decoder_input_data = np.eye(num_decoder_tokens, dtype="float32")[decoder_ids]
    decoder_target_data = np.zeros_like(decoder_input_data)
    decoder_target_data[:, :-1] = decoder_input_data[:, 1:]
    encoder_inputs = k.Input(shape=(None, num_encoder_tokens))
    encoder = k.layers.LSTM(latent_dim, return_state=True)
    encoder_outputs, state_h, state_c = encoder(encoder_inputs)
    encoder_states = [state_h, state_c]
    decoder_inputs = k.Input(shape=(None, num_decoder_tokens))
    decoder_lstm = k.layers.LSTM(latent_dim, return_sequences=True, return_state=True)
    decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
    decoder_dense = k.layers.Dense(num_decoder_tokens, activation="softmax")
    decoder_outputs = decoder_dense(decoder_outputs)
    model = k.Model([encoder_inputs, decoder_inputs], decoder_outputs)
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    # validation_split=0.2 of 30 samples: 24 train (two batches of 12), 6 validation
    history = fit(model, [encoder_input_data, decoder_input_data], decoder_target_data, validation_split=0.2)
    return result(model, history)


def addition_rnn(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(25)
    chars = "0123456789+ "
    DIGITS, MAXLEN = 2, 5
    r = rng(31)
    a, b = r.integers(0, 100, size=36), r.integers(0, 100, size=36)
    questions = ["{}+{}".format(p, q).ljust(MAXLEN) for p, q in zip(a, b)]
    answers = [str(p + q).ljust(DIGITS + 1) for p, q in zip(a, b)]
    onehot = np.eye(len(chars), dtype="float32")
    x = np.stack([onehot[[chars.index(c) for c in s]] for s in questions])
    y = np.stack([onehot[[chars.index(c) for c in s]] for s in answers])
    x_train, y_train, x_val, y_val = x[:24], y[:24], x[24:], y[24:]
    model = k.Sequential()
    model.add(layers.Input((MAXLEN, len(chars))))
    model.add(layers.LSTM(8))
    model.add(layers.RepeatVector(DIGITS + 1))
    for _ in range(1):
        model.add(layers.LSTM(8, return_sequences=True))
    model.add(layers.Dense(len(chars), activation="softmax"))
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    history = fit(model, x_train, y_train, validation_data=(x_val, y_val))
    return result(model, history, predicted=predict(model, x_val))


def ner_transformers(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(26)
    TransformerBlock, TokenAndPositionEmbedding = _transformer_layers(k)

    class NERModel(k.Model):
        def __init__(self, num_tags, vocab_size, maxlen=128, embed_dim=32, num_heads=2, ff_dim=32):
            super().__init__()
            self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
            self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
            self.dropout1 = layers.Dropout(0.1)
            self.ff = layers.Dense(ff_dim, activation="relu")
            self.dropout2 = layers.Dropout(0.1)
            self.ff_final = layers.Dense(num_tags, activation="softmax")

        def call(self, inputs, training=False):
            x = self.embedding_layer(inputs)
            x = self.transformer_block(x)
            x = self.dropout1(x, training=training)
            x = self.ff(x)
            x = self.dropout2(x, training=training)
            return self.ff_final(x)

    class CustomNonPaddingTokenLoss(k.losses.Loss):
        def __init__(self, name="custom_ner_loss"):
            super().__init__(name=name)

        def call(self, y_true, y_pred):
            loss_fn = k.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=None)
            loss = loss_fn(y_true, y_pred)
            mask = ops.cast((y_true > 0), dtype="float32")
            loss = loss * mask
            return ops.sum(loss) / ops.sum(mask)

    num_tags, vocab_size, maxlen = 5, 20, 8
    ner_model = NERModel(num_tags, vocab_size, maxlen=maxlen, embed_dim=8, num_heads=2, ff_dim=8)
    ner_model.compile(optimizer="adam", loss=CustomNonPaddingTokenLoss())
    if devices > 1:
        ner_model = distkeras.distribute(ner_model, devices)
    x = _padded(32, 24, maxlen, vocab_size).astype("int32")
    y = np.where(x > 0, rng(33).integers(1, num_tags, size=x.shape), 0)  # tag 0 on padding, as the example's
    history = fit(ner_model, x, y)
    return result(ner_model, history, predicted=predict(ner_model, x[:12]))


def masked_language_modeling(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(27)
    vocab, max_len, embed_dim, num_head, ff_dim = 20, 8, 8, 2, 8
    loss_fn = k.losses.SparseCategoricalCrossentropy(reduction=None)
    loss_tracker = k.metrics.Mean(name="loss")

    class MaskedLanguageModel(k.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            loss = loss_fn(y, y_pred, sample_weight)
            loss_tracker.update_state(loss, sample_weight=sample_weight)
            return k.ops.sum(loss)

        def compute_metrics(self, x, y, y_pred, sample_weight):
            return {"loss": loss_tracker.result()}

        @property
        def metrics(self):
            return [loss_tracker]

    def get_pos_encoding_matrix(max_len, d_emb):
        pos_enc = np.array([[pos / np.power(10000, 2 * (j // 2) / d_emb) for j in range(d_emb)]
                            if pos != 0 else np.zeros(d_emb) for pos in range(max_len)])
        pos_enc[1:, 0::2] = np.sin(pos_enc[1:, 0::2])
        pos_enc[1:, 1::2] = np.cos(pos_enc[1:, 1::2])
        return pos_enc

    def bert_module(query, key, value, i):
        attention_output = layers.MultiHeadAttention(num_heads=num_head, key_dim=embed_dim // num_head,
                                                     name="encoder_{}_multiheadattention".format(i))(query, key, value)
        attention_output = layers.Dropout(0.1)(attention_output)
        attention_output = layers.LayerNormalization(epsilon=1e-6)(query + attention_output)
        ffn = k.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        ffn_output = layers.Dropout(0.1)(ffn(attention_output))
        return layers.LayerNormalization(epsilon=1e-6)(attention_output + ffn_output)

    inputs = layers.Input((max_len,), dtype="int64")
    word_embeddings = layers.Embedding(vocab, embed_dim, name="word_embedding")(inputs)
    position_embeddings = layers.Embedding(input_dim=max_len, output_dim=embed_dim, trainable=False,
                                           name="position_embedding")
    position_embeddings.build((max_len,))
    position_embeddings.set_weights([get_pos_encoding_matrix(max_len, embed_dim)])
    embeddings = word_embeddings + position_embeddings(k.ops.arange(0, max_len))
    encoder_output = bert_module(embeddings, embeddings, embeddings, 0)
    mlm_output = layers.Dense(vocab, name="mlm_cls", activation="softmax")(encoder_output)
    mlm_model = MaskedLanguageModel(inputs, mlm_output, name="masked_bert_model")
    mlm_model.compile(optimizer=k.optimizers.Adam(learning_rate=0.001))
    if devices > 1:
        mlm_model = distkeras.distribute(mlm_model, devices)
    y = tokens(34, 24, max_len, vocab, low=3)
    masked = rng(35).uniform(size=y.shape) < 0.3
    x = np.where(masked, 1, y)  # token 1 is [mask]
    sample_weights = masked.astype("float32")
    history = fit(mlm_model, x, y, sample_weight=sample_weights)
    return result(mlm_model, history)


def multi_label_classification(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(28)
    vocabulary_size, num_labels = 24, 5
    shallow_mlp_model = k.Sequential([layers.Dense(8, activation="relu"), layers.Dense(8, activation="relu"),
                                      layers.Dense(num_labels, activation="sigmoid")])
    shallow_mlp_model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["binary_accuracy"])
    if devices > 1:
        shallow_mlp_model = distkeras.distribute(shallow_mlp_model, devices)
    r = rng(36)
    x = (r.uniform(size=(24, vocabulary_size)) < 0.2).astype("float32")  # TextVectorization(output_mode="multi_hot")
    y = (r.uniform(size=(24, num_labels)) < 0.3).astype("float32")
    history = fit(shallow_mlp_model, x, y, validation_data=(x[:12], y[:12]))
    return result(shallow_mlp_model, history, evaluate(shallow_mlp_model, x[:12], y[:12]))


PROGRAMS = {
    "text_classification_from_scratch": (K + "text_classification_from_scratch.py", 1e-5, ALL, "fast", "pass"),
    "bidirectional_lstm_imdb": (K + "bidirectional_lstm_imdb.py", 1e-5, ALL, "slow", "pass"),
    "pretrained_word_embeddings": (K + "pretrained_word_embeddings.py", 1e-5, ALL, "slow", "pass"),
    # SparseCategoricalCrossentropy(ignore_class=0): each replica weighed by its share of the kept tokens (issue 52).
    "nmt_transformer": (K + "neural_machine_translation_with_transformer.py", 1e-5, ("torch",), "slow", "pass"),
    "lstm_seq2seq": (K + "lstm_seq2seq.py", 1e-5, ALL, "slow", "pass"),
    "addition_rnn": (K + "addition_rnn.py", 1e-5, ALL, "slow", "pass"),
    "ner_transformers": (K + "ner_transformers.py", 1e-5, ALL, "fast", {"tensorflow": RATIO, "torch": RATIO}),
    # BN_ADAM: the attention's key bias has a gradient of 0 on paper (softmax ignores a shift shared by a row's
    # logits), and Adam makes steps of its rounding noise (JAX: 2.9e-5 apart at the end).
    "masked_language_modeling": (K + "masked_language_modeling.py", BN_ADAM, ALL, "fast",
                                 {"tensorflow": HAND_SUM, "torch": HAND_SUM}),
    "multi_label_classification": (K + "multi_label_classification.py", 1e-5, ALL, "fast", "pass"),
}
