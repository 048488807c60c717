"""Audio programs of keras-io's examples/audio, on generated waveforms and embeddings."""

import numpy as np

import distkeras
from tests.backends.corpus.common import ALL, evaluate, fit, keras, labels, normal, predict, result

K = "examples/audio/"


def speaker_recognition_using_cnn(devices):
    k = keras()
    k.utils.set_random_seed(100)
    sampling_rate, num_classes = 64, 3
    audio = normal(101, 24, sampling_rate)
    # audio_to_fft: the magnitude of the first half of the FFT, computed here with numpy instead of tf.signal
    x = np.abs(np.fft.fft(audio, axis=1))[:, : sampling_rate // 2, None].astype("float32")
    y = labels(102, 24, num_classes)

    def residual_block(x, filters, conv_num=3, activation="relu"):
        s = k.layers.Conv1D(filters, 1, padding="same")(x)
        for _ in range(conv_num - 1):
            x = k.layers.Conv1D(filters, 3, padding="same")(x)
            x = k.layers.Activation(activation)(x)
        x = k.layers.Conv1D(filters, 3, padding="same")(x)
        x = k.layers.Add()([x, s])
        x = k.layers.Activation(activation)(x)
        return k.layers.MaxPool1D(pool_size=2, strides=2)(x)

    def build_model(input_shape, num_classes):
        inputs = k.layers.Input(shape=input_shape, name="input")
        x = residual_block(inputs, 4, 2)
        x = residual_block(x, 8, 3)
        x = k.layers.AveragePooling1D(pool_size=3, strides=3)(x)
        x = k.layers.Flatten()(x)
        x = k.layers.Dense(8, activation="relu")(x)
        x = k.layers.Dense(8, activation="relu")(x)
        outputs = k.layers.Dense(num_classes, activation="softmax", name="output")(x)
        return k.models.Model(inputs=inputs, outputs=outputs)

    model = build_model((sampling_rate // 2, 1), num_classes)
    model.compile(optimizer="Adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    earlystopping_cb = k.callbacks.EarlyStopping(patience=10, restore_best_weights=True)
    history = fit(model, x, y, validation_data=(x[:12], y[:12]), callbacks=[earlystopping_cb])
    return result(model, history, evaluate(model, x[:12], y[:12]))


def uk_ireland_accent_recognition(devices):
    k = keras()
    k.utils.set_random_seed(103)
    num_classes = 3
    embeddings = normal(104, 24, 16)  # stands in for YAMNet's 1024-wide embeddings
    y = k.utils.to_categorical(labels(105, 24, num_classes), num_classes)
    inputs = k.layers.Input(shape=(16,), name="embedding")
    x = k.layers.Dense(8, activation="relu", name="dense_1")(inputs)
    x = k.layers.Dropout(0.15, name="dropout_1")(x)
    x = k.layers.Dense(8, activation="relu", name="dense_2")(x)
    x = k.layers.Dropout(0.2, name="dropout_2")(x)
    logits = k.layers.Dense(num_classes, name="logits")(x)
    outputs = k.layers.Activation("softmax", name="softmax")(logits)
    model = k.Model(inputs=inputs, outputs=outputs, name="accent_recognition")
    model.compile(optimizer=k.optimizers.Adam(learning_rate=1e-3), loss=k.losses.CategoricalCrossentropy(),
                  metrics=["accuracy", k.metrics.AUC(name="auc")])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    class_counts = y.sum(axis=0)
    class_weight = {i: float(y.shape[0] / (num_classes * c)) for i, c in enumerate(class_counts)}
    early_stopping_cb = k.callbacks.EarlyStopping(monitor="val_auc", patience=10, restore_best_weights=True)
    history = fit(model, embeddings, y, validation_data=(embeddings[:12], y[:12]), class_weight=class_weight,
                  callbacks=[early_stopping_cb])
    return result(model, history, evaluate(model, embeddings[:12], y[:12]))


def stft_spectrogram_classification(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(106)
    audio = normal(107, 24, 128, 1)
    y = labels(108, 24, 2)
    inputs = layers.Input(shape=(128, 1))
    x = layers.STFTSpectrogram(mode="log", frame_length=16, frame_step=8, fft_length=16, trainable=False,
                               expand_dims=True)(inputs)
    x = layers.Conv2D(4, 3, activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.2)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = k.Model(inputs, outputs)
    model.compile(optimizer=k.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    history = fit(model, audio, y)
    return result(model, history, predicted=predict(model, audio[:12]))


PROGRAMS = {
    "speaker_recognition_using_cnn": (K + "speaker_recognition_using_cnn.py", 1e-5, ALL, "slow", "pass"),
    "uk_ireland_accent_recognition": (K + "uk_ireland_accent_recognition.py", 1e-5, ALL, "fast", "pass"),
    "stft_spectrogram_classification": (K + "stft.py", 1e-5, ALL, "slow", "pass"),
}
