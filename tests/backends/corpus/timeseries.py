"""Timeseries programs of keras-io's examples/timeseries, on generated series."""

import os

import numpy as np

import distkeras
from tests.backends.corpus.common import ALL, BN_ADAM, shared_folder, BATCH, evaluate, fit, keras, labels, normal, predict, result

K = "examples/timeseries/"


def timeseries_classification_from_scratch(devices):
    k = keras()
    k.utils.set_random_seed(60)
    x_train, y_train = normal(61, 30, 16, 1), labels(62, 30, 2)
    x_test, y_test = normal(63, 12, 16, 1), labels(64, 12, 2)

    def make_model(input_shape):
        input_layer = k.layers.Input(input_shape)
        conv1 = k.layers.Conv1D(filters=4, kernel_size=3, padding="same")(input_layer)
        conv1 = k.layers.BatchNormalization()(conv1)
        conv1 = k.layers.ReLU()(conv1)
        conv2 = k.layers.Conv1D(filters=4, kernel_size=3, padding="same")(conv1)
        conv2 = k.layers.BatchNormalization()(conv2)
        conv2 = k.layers.ReLU()(conv2)
        gap = k.layers.GlobalAveragePooling1D()(conv2)
        output_layer = k.layers.Dense(2, activation="softmax")(gap)
        return k.models.Model(inputs=input_layer, outputs=output_layer)

    model = make_model(input_shape=x_train.shape[1:])
    with shared_folder(devices) as folder:
        callbacks = [k.callbacks.ModelCheckpoint(os.path.join(folder, "best_model.keras"), save_best_only=True,
                                                 monitor="val_loss"),
                     k.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001),
                     k.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=0)]
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
        if devices > 1:
            model = distkeras.distribute(model, devices)
        # validation_split=0.2 of 30 samples: 24 train, 6 validation
        history = fit(model, x_train, y_train, callbacks=callbacks, validation_split=0.2)
        best = k.models.load_model(os.path.join(folder, "best_model.keras"))
        extra = {"saved_weights": [np.asarray(w, dtype="float64") for w in best.get_weights()]}
    return result(model, history, evaluate(model, x_test, y_test), **extra)


def timeseries_classification_transformer(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(65)
    n_classes = 2

    def transformer_encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
        x = layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads, dropout=dropout)(inputs, inputs)
        x = layers.Dropout(dropout)(x)
        x = layers.LayerNormalization(epsilon=1e-6)(x)
        res = x + inputs
        x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
        x = layers.Dropout(dropout)(x)
        x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
        x = layers.LayerNormalization(epsilon=1e-6)(x)
        return x + res

    def build_model(input_shape, head_size, num_heads, ff_dim, num_transformer_blocks, mlp_units, dropout=0,
                    mlp_dropout=0):
        inputs = k.Input(shape=input_shape)
        x = inputs
        for _ in range(num_transformer_blocks):
            x = transformer_encoder(x, head_size, num_heads, ff_dim, dropout)
        x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
        for dim in mlp_units:
            x = layers.Dense(dim, activation="relu")(x)
            x = layers.Dropout(mlp_dropout)(x)
        outputs = layers.Dense(n_classes, activation="softmax")(x)
        return k.Model(inputs, outputs)

    x_train, y_train = normal(66, 30, 12, 1), labels(67, 30, n_classes)
    model = build_model(x_train.shape[1:], head_size=4, num_heads=2, ff_dim=4, num_transformer_blocks=2,
                        mlp_units=[8], mlp_dropout=0.4, dropout=0.25)
    model.compile(loss="sparse_categorical_crossentropy", optimizer=k.optimizers.Adam(learning_rate=1e-4),
                  metrics=["sparse_categorical_accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    callbacks = [k.callbacks.EarlyStopping(patience=10, restore_best_weights=True)]
    history = fit(model, x_train, y_train, validation_split=0.2, callbacks=callbacks)
    return result(model, history, evaluate(model, x_train[:12], y_train[:12]))


def timeseries_weather_forecasting(devices):
    k = keras()
    k.utils.set_random_seed(68)
    features = normal(69, 120, 3)
    past, future, step, sequence_length = 12, 4, 2, 6
    x_train = features[:90]
    y_train = features[past + future:past + future + 90, 1:2]
    dataset_train = k.preprocessing.timeseries_dataset_from_array(x_train, y_train, sequence_length=sequence_length,
                                                                  sampling_rate=step, batch_size=BATCH)
    x_val, y_val = features[90:], features[90:, 1:2]
    dataset_val = k.preprocessing.timeseries_dataset_from_array(x_val[:-past], y_val[past:], sequence_length=sequence_length,
                                                                sampling_rate=step, batch_size=BATCH)
    inputs = k.layers.Input(shape=(sequence_length, 3))
    lstm_out = k.layers.LSTM(4)(inputs)
    outputs = k.layers.Dense(1)(lstm_out)
    model = k.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=k.optimizers.Adam(learning_rate=0.001), loss="mse")
    if devices > 1:
        model = distkeras.distribute(model, devices)
    with shared_folder(devices) as folder:
        es_callback = k.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)
        modelckpt_callback = k.callbacks.ModelCheckpoint(monitor="val_loss", filepath=os.path.join(folder, "model_checkpoint.weights.h5"),
                                                         verbose=0, save_weights_only=True, save_best_only=True)
        history = model.fit(dataset_train.take(2), epochs=2, validation_data=dataset_val, verbose=0,
                            callbacks=[es_callback, modelckpt_callback])
    return result(model, history)


def timeseries_anomaly_detection(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(70)
    t = np.linspace(0, 8 * np.pi, 16 * 30).reshape(30, 16, 1)
    x_train = (np.sin(t) + 0.1 * normal(71, 30, 16, 1)).astype("float32")
    model = k.Sequential([
        layers.Input(shape=(x_train.shape[1], x_train.shape[2])),
        layers.Conv1D(filters=4, kernel_size=7, padding="same", strides=2, activation="relu"),
        layers.Dropout(rate=0.2),
        layers.Conv1D(filters=2, kernel_size=7, padding="same", strides=2, activation="relu"),
        layers.Conv1DTranspose(filters=2, kernel_size=7, padding="same", strides=2, activation="relu"),
        layers.Dropout(rate=0.2),
        layers.Conv1DTranspose(filters=4, kernel_size=7, padding="same", strides=2, activation="relu"),
        layers.Conv1DTranspose(filters=1, kernel_size=7, padding="same"),
    ])
    model.compile(optimizer=k.optimizers.Adam(learning_rate=0.001), loss="mse")
    if devices > 1:
        model = distkeras.distribute(model, devices)
    # validation_split=0.2 of 30 windows: 24 train, 6 validation
    history = fit(model, x_train, x_train, validation_split=0.2,
                  callbacks=[k.callbacks.EarlyStopping(monitor="val_loss", patience=5, mode="min")])
    x_train_pred = predict(model, x_train[:24])
    return result(model, history, predicted=x_train_pred)


PROGRAMS = {
    "timeseries_classification_from_scratch": (K + "timeseries_classification_from_scratch.py", BN_ADAM, ALL, "slow", "pass"),
    "timeseries_classification_transformer": (K + "timeseries_classification_transformer.py", 1e-5, ALL, "slow",
                                              "pass"),
    "timeseries_weather_forecasting": (K + "timeseries_weather_forecasting.py", 1e-5, ALL, "slow", "pass"),
    "timeseries_anomaly_detection": (K + "timeseries_anomaly_detection.py", 1e-5, ALL, "slow", "pass"),
}
