"""TensorFlow's Keras tutorials (github.com/tensorflow/docs, ``site/en/tutorials/keras/``), on Keras 3: each
notebook's model, preprocessing layers, ``compile()``, callbacks and fit/evaluate/predict calls, on generated data
in place of the datasets they download (auto-mpg, Higgs, IMDB, MNIST), small widths, a global batch of 12 and no
shuffling (one order on every run). They need TensorFlow for ``tf.data`` and string ops only, and ``tf.data``
feeds every backend's fit(), so they run on all three, but for the text classifier (TensorFlow only: a
``TextVectorization`` in its ``tf.data`` map and a model on raw strings)."""

import os

import numpy as np

from tests.backends.corpus.common import ALL, BATCH, TF_ONLY, distribute, evaluate, fit, keras, labels, merged, \
    predict, result, rng, shared_folder

TT = "tf-tutorials:"


def regression(devices):
    """regression.ipynb: the DNN on every auto-mpg feature, a ``Normalization`` layer ``adapt()``ed to the training
    features, two Dense(64, relu), mean absolute error, Adam(0.001), ``validation_split=0.2``; evaluate on the test
    split, predict."""
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(140)
    r = rng(141)
    train_features = r.normal(loc=[5.0, 190.0, 100.0, 2970.0, 15.0, 76.0, 0.2, 0.2, 0.6],
                              scale=[1.7, 100.0, 38.0, 840.0, 2.7, 3.6, 0.4, 0.4, 0.5], size=(36, 9)).astype("float32")
    train_labels = (46.0 - train_features[:, 3] / 150.0 + r.normal(size=36)).astype("float32")
    test_features, test_labels = train_features[:12] * 1.01, train_labels[:12]
    normalizer = layers.Normalization(axis=-1)
    normalizer.adapt(np.array(train_features))

    def build_and_compile_model(norm):
        model = k.Sequential([
            norm,
            layers.Dense(16, activation="relu"),
            layers.Dense(16, activation="relu"),
            layers.Dense(1)
        ])
        model.compile(loss="mean_absolute_error", optimizer=k.optimizers.Adam(0.001))
        return model

    dnn_model = build_and_compile_model(normalizer)
    dnn_model = distribute(dnn_model, devices)
    history = fit(dnn_model, train_features, train_labels, validation_split=0.2, epochs=3)
    evaluated = evaluate(dnn_model, test_features, test_labels)
    test_predictions = predict(dnn_model, test_features).flatten()
    return result(dnn_model, history, evaluated=evaluated, predicted=test_predictions)


def overfit_and_underfit(devices):
    """overfit_and_underfit.ipynb's ``combined_model`` (L2 weight regularization and dropout): ``InverseTimeDecay``
    for Adam, ``BinaryCrossentropy(from_logits=True)`` as loss and metric, accuracy, a repeated ``tf.data``
    training set with ``steps_per_epoch``, a validation set, ``EarlyStopping`` on ``val_binary_crossentropy``."""
    import tensorflow as tf

    k = keras()
    layers, regularizers = k.layers, k.regularizers
    k.utils.set_random_seed(142)
    FEATURES, N_TRAIN = 28, 36
    STEPS_PER_EPOCH = N_TRAIN // BATCH
    r = rng(143)
    features = r.normal(size=(N_TRAIN + 12, FEATURES)).astype("float32")
    label = (features[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")  # (rows, 1): Keras 3's loss shapes
    packed_ds = tf.data.Dataset.from_tensor_slices((features, label))
    validate_ds = packed_ds.take(12).batch(BATCH)
    train_ds = packed_ds.skip(12).take(N_TRAIN).repeat().batch(BATCH)

    lr_schedule = k.optimizers.schedules.InverseTimeDecay(
        0.001, decay_steps=STEPS_PER_EPOCH * 1000, decay_rate=1, staircase=False)

    def get_optimizer():
        return k.optimizers.Adam(lr_schedule)

    def get_callbacks(name):
        return [k.callbacks.EarlyStopping(monitor="val_binary_crossentropy", patience=200)]

    combined_model = k.Sequential([
        layers.Input((FEATURES,)),
        layers.Dense(32, kernel_regularizer=regularizers.l2(0.0001), activation="elu"),
        layers.Dropout(0.5),
        layers.Dense(32, kernel_regularizer=regularizers.l2(0.0001), activation="elu"),
        layers.Dropout(0.5),
        layers.Dense(1)
    ])
    combined_model.compile(optimizer=get_optimizer(), loss=k.losses.BinaryCrossentropy(from_logits=True),
                           metrics=[k.metrics.BinaryCrossentropy(from_logits=True, name="binary_crossentropy"),
                                    "accuracy"])
    combined_model = distribute(combined_model, devices)
    history = combined_model.fit(train_ds, steps_per_epoch=STEPS_PER_EPOCH, epochs=3, validation_data=validate_ds,
                                 callbacks=get_callbacks("regularizers/combined"), verbose=0)
    return result(combined_model, history, evaluated=evaluate(combined_model, validate_ds))


def text_classification(devices):
    """text_classification.ipynb: a ``TextVectorization`` layer with the notebook's ``custom_standardization``
    (lower case, no ``<br />``, no punctuation), ``adapt()``ed to the training text and mapped over ``tf.data``
    ahead of the model; Embedding, Dropout, GlobalAveragePooling1D, Dropout, Dense(1) logits, binary cross-entropy,
    ``BinaryAccuracy(threshold=0.0)``; then the export model with the layer inside and a sigmoid, evaluated on the
    raw test set. TensorFlow only, as the notebook: on JAX the layer fails in the ``tf.data`` map on one device
    ("Cannot convert a symbolic tf.Tensor to a numpy array")."""
    import re
    import string

    import tensorflow as tf

    k = keras()
    layers, losses = k.layers, k.losses
    k.utils.set_random_seed(144)
    words = ["great", "awful", "movie", "the", "plot", "acting", "<br />", "bad", "good", "film", "Boring!", "fun."]
    r = rng(145)
    texts = np.array([" ".join(r.choice(words, size=8)) for _ in range(36)])
    text_labels = np.array([int("good" in t or "great" in t) for t in texts])
    raw_train_ds = tf.data.Dataset.from_tensor_slices((texts[:24], text_labels[:24])).batch(BATCH)
    raw_val_ds = tf.data.Dataset.from_tensor_slices((texts[24:], text_labels[24:])).batch(BATCH)
    raw_test_ds = raw_val_ds

    def custom_standardization(input_data):
        lowercase = tf.strings.lower(input_data)
        stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
        return tf.strings.regex_replace(stripped_html, "[%s]" % re.escape(string.punctuation), "")

    max_features, sequence_length = 20, 10
    vectorize_layer = layers.TextVectorization(standardize=custom_standardization, max_tokens=max_features,
                                               output_mode="int", output_sequence_length=sequence_length)
    train_text = raw_train_ds.map(lambda x, y: x)
    vectorize_layer.adapt(train_text)

    def vectorize_text(text, label):
        text = tf.expand_dims(text, -1)
        return vectorize_layer(text), label

    train_ds = raw_train_ds.map(vectorize_text)
    val_ds = raw_val_ds.map(vectorize_text)
    test_ds = raw_test_ds.map(vectorize_text)
    embedding_dim = 8
    model = k.Sequential([
        layers.Embedding(max_features, embedding_dim),
        layers.Dropout(0.2),
        layers.GlobalAveragePooling1D(),
        layers.Dropout(0.2),
        layers.Dense(1)])
    model.compile(loss=losses.BinaryCrossentropy(from_logits=True), optimizer="adam",
                  metrics=[k.metrics.BinaryAccuracy(threshold=0.0)])
    model = distribute(model, devices)
    history = model.fit(train_ds, validation_data=val_ds, epochs=3, verbose=0)
    evaluated = evaluate(model, test_ds)
    export_model = k.Sequential([vectorize_layer, model, layers.Activation("sigmoid")])
    export_model.compile(loss=losses.BinaryCrossentropy(from_logits=False), optimizer="adam", metrics=["accuracy"])
    exported = export_model.evaluate(raw_test_ds, verbose=0, return_dict=True)
    evaluated.update({"export/" + key: value for key, value in exported.items()})
    return result(model, history, evaluated=evaluated, predicted=predict(model, test_ds))


def save_and_load(devices):
    """save_and_load.ipynb: ``create_model()`` (Dense(512, relu), Dropout(0.2), Dense(10) logits, Adam, sparse
    cross-entropy from logits), trained with a ``ModelCheckpoint(save_weights_only=True)``; a new model evaluated
    untrained, then after ``load_weights()`` of the checkpoint; the whole model saved (``.keras``), loaded with
    ``load_model()`` and evaluated."""
    k = keras()
    k.utils.set_random_seed(146)
    r = rng(147)
    train_images = r.random((24, 64)).astype("float32")
    train_labels = labels(148, 24, 10)
    test_images, test_labels = r.random((12, 64)).astype("float32"), labels(149, 12, 10)

    def create_model():
        model = k.models.Sequential([
            k.layers.Input((64,)),
            k.layers.Dense(32, activation="relu"),
            k.layers.Dropout(0.2),
            k.layers.Dense(10)
        ])
        model.compile(optimizer="adam", loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[k.metrics.SparseCategoricalAccuracy()])
        return model

    with shared_folder(devices, "save_and_load") as folder:
        checkpoint_path = os.path.join(folder, "training_1", "cp.weights.h5")
        cp_callback = k.callbacks.ModelCheckpoint(filepath=checkpoint_path, save_weights_only=True, verbose=0)
        model = distribute(create_model(), devices)
        history = fit(model, train_images, train_labels, epochs=3, validation_data=(test_images, test_labels),
                      callbacks=[cp_callback])
        fresh = distribute(create_model(), devices)
        untrained = evaluate(fresh, test_images, test_labels)
        fresh.load_weights(checkpoint_path)
        restored = evaluate(fresh, test_images, test_labels)
        model.save(os.path.join(folder, "my_model.keras"))
        new_model = k.models.load_model(os.path.join(folder, "my_model.keras"))
        loaded = evaluate(new_model, test_images, test_labels)
    np.testing.assert_allclose(restored["loss"], loaded["loss"], rtol=1e-5)
    evaluated = dict(restored, **{"untrained/" + key: value for key, value in untrained.items()})
    evaluated.update({"loaded/" + key: value for key, value in loaded.items()})
    return result(model, merged(history), evaluated=evaluated, predicted=predict(new_model, test_images))


PROGRAMS = {
    "regression": (TT + "regression.ipynb", 1e-5, ALL, "slow", "pass"),
    "overfit_and_underfit": (TT + "overfit_and_underfit.ipynb", 1e-5, ALL, "slow", "pass"),
    "text_classification": (TT + "text_classification.ipynb", 1e-5, TF_ONLY, "slow", "pass"),
    "save_and_load": (TT + "save_and_load.ipynb", 1e-5, ALL, "slow", "pass"),
}
