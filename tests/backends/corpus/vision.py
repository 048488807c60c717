"""Vision programs of keras-io's examples/vision, shrunk to 8x8 generated images and a few steps."""

import os

import numpy as np

import distkeras
from tests.backends.corpus.common import ALL, BN_ADAM, shared_folder, evaluate, fit, images, keras, labels, normal, predict, result

K = "examples/vision/"


def image_classification_from_scratch(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(1)
    data_augmentation_layers = [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]

    def data_augmentation(images):
        for layer in data_augmentation_layers:
            images = layer(images)
        return images

    def make_model(input_shape, num_classes):
        inputs = k.Input(shape=input_shape)
        x = data_augmentation(inputs)  # option 1: augmentation inside the model
        x = layers.Rescaling(1.0 / 255)(x)
        x = layers.Conv2D(4, 3, strides=2, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        previous_block_activation = x
        for size in [8]:
            x = layers.Activation("relu")(x)
            x = layers.SeparableConv2D(size, 3, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.Activation("relu")(x)
            x = layers.SeparableConv2D(size, 3, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
            residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
            x = layers.add([x, residual])
            previous_block_activation = x
        x = layers.SeparableConv2D(8, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.GlobalAveragePooling2D()(x)
        units = 1 if num_classes == 2 else num_classes
        x = layers.Dropout(0.25)(x)
        outputs = layers.Dense(units, activation=None)(x)
        return k.Model(inputs, outputs)

    model = make_model(input_shape=(8, 8, 3), num_classes=2)
    model.compile(optimizer=k.optimizers.Adam(3e-4), loss=k.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[k.metrics.BinaryAccuracy(name="acc")])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x, y = images(24, seed=2, channels=3, classes=2)
    history = fit(model, x * 255.0, y.astype("float32"))
    return result(model, history, evaluate(model, x * 255.0, y.astype("float32")), predict(model, x * 255.0))


def _patches_class(k):
    ops = k.ops

    class Patches(k.layers.Layer):
        def __init__(self, patch_size):
            super().__init__()
            self.patch_size = patch_size

        def call(self, images):
            input_shape = ops.shape(images)
            batch_size = input_shape[0]
            height, width, channels = input_shape[1], input_shape[2], input_shape[3]
            num_patches_h = height // self.patch_size
            num_patches_w = width // self.patch_size
            patches = k.ops.image.extract_patches(images, size=self.patch_size)
            return ops.reshape(patches, (batch_size, num_patches_h * num_patches_w,
                                         self.patch_size * self.patch_size * channels))

    return Patches


def vision_transformer(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(2)
    x_train, y_train = images(24, seed=3, channels=3, classes=4)
    x_test, y_test = images(12, seed=4, channels=3, classes=4)
    image_size, patch_size, projection_dim, num_heads = 8, 4, 8, 2
    num_patches = (image_size // patch_size) ** 2
    transformer_units = [projection_dim * 2, projection_dim]
    data_augmentation = k.Sequential([layers.Normalization(), layers.Resizing(image_size, image_size),
                                      layers.RandomFlip("horizontal"), layers.RandomRotation(factor=0.02),
                                      layers.RandomZoom(height_factor=0.2, width_factor=0.2)], name="data_augmentation")
    data_augmentation.layers[0].adapt(x_train)
    Patches = _patches_class(k)

    class PatchEncoder(layers.Layer):
        def __init__(self, num_patches, projection_dim):
            super().__init__()
            self.num_patches = num_patches
            self.projection = layers.Dense(units=projection_dim)
            self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

        def call(self, patch):
            positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
            return self.projection(patch) + self.position_embedding(positions)

    def mlp(x, hidden_units, dropout_rate):
        for units in hidden_units:
            x = layers.Dense(units, activation=k.activations.gelu)(x)
            x = layers.Dropout(dropout_rate)(x)
        return x

    inputs = k.Input(shape=(8, 8, 3))
    augmented = data_augmentation(inputs)
    encoded_patches = PatchEncoder(num_patches, projection_dim)(Patches(patch_size)(augmented))
    for _ in range(1):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
        attention_output = layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention_output, encoded_patches])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
        encoded_patches = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
    representation = layers.Flatten()(representation)
    representation = layers.Dropout(0.5)(representation)
    features = mlp(representation, hidden_units=[8], dropout_rate=0.5)
    logits = layers.Dense(4)(features)
    model = k.Model(inputs=inputs, outputs=logits)
    model.compile(optimizer=k.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[k.metrics.SparseCategoricalAccuracy(name="accuracy"),
                           k.metrics.SparseTopKCategoricalAccuracy(2, name="top-2-accuracy")])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    history = fit(model, x_train, y_train)
    return result(model, history, evaluate(model, x_test, y_test), predict(model, x_test))


def mlp_mixer(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(3)
    x_train, y_train = images(24, seed=5, channels=3, classes=4)
    patch_size, embedding_dim = 4, 8
    num_patches = (8 // patch_size) ** 2
    Patches = _patches_class(k)

    class MLPMixerLayer(layers.Layer):
        def __init__(self, num_patches, hidden_units, dropout_rate, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.mlp1 = k.Sequential([layers.Dense(units=num_patches, activation="gelu"), layers.Dense(units=num_patches),
                                      layers.Dropout(rate=dropout_rate)])
            self.mlp2 = k.Sequential([layers.Dense(units=num_patches, activation="gelu"), layers.Dense(units=hidden_units),
                                      layers.Dropout(rate=dropout_rate)])
            self.normalize = layers.LayerNormalization(epsilon=1e-6)

        def build(self, input_shape):
            return super().build(input_shape)

        def call(self, inputs):
            x = self.normalize(inputs)
            x_channels = ops.transpose(x, axes=(0, 2, 1))
            mlp1_outputs = self.mlp1(x_channels)
            mlp1_outputs = ops.transpose(mlp1_outputs, axes=(0, 2, 1))
            x = mlp1_outputs + inputs
            x_patches = self.normalize(x)
            mlp2_outputs = self.mlp2(x_patches)
            return x + mlp2_outputs

    data_augmentation = k.Sequential([layers.Normalization(), layers.Resizing(8, 8), layers.RandomFlip("horizontal"),
                                      layers.RandomZoom(height_factor=0.2, width_factor=0.2)], name="data_augmentation")
    data_augmentation.layers[0].adapt(x_train)
    mlpmixer_blocks = k.Sequential([MLPMixerLayer(num_patches, embedding_dim, 0.2) for _ in range(2)])
    inputs = layers.Input(shape=(8, 8, 3))
    augmented = data_augmentation(inputs)
    patches = Patches(patch_size)(augmented)
    x = layers.Dense(units=embedding_dim)(patches)
    x = mlpmixer_blocks(x)
    representation = layers.GlobalAveragePooling1D()(x)
    representation = layers.Dropout(rate=0.2)(representation)
    logits = layers.Dense(4)(representation)
    model = k.Model(inputs=inputs, outputs=logits)
    model.compile(optimizer=k.optimizers.AdamW(learning_rate=0.005, weight_decay=0.0001),
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[k.metrics.SparseCategoricalAccuracy(name="acc"),
                           k.metrics.SparseTopKCategoricalAccuracy(2, name="top2-acc")])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    reduce_lr = k.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=5)
    early_stopping = k.callbacks.EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    history = fit(model, x_train, y_train, validation_split=0.5, callbacks=[early_stopping, reduce_lr])
    return result(model, history)


def convmixer(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(4)

    def activation_block(x):
        x = layers.Activation("gelu")(x)
        return layers.BatchNormalization()(x)

    def conv_stem(x, filters, patch_size):
        x = layers.Conv2D(filters, kernel_size=patch_size, strides=patch_size)(x)
        return activation_block(x)

    def conv_mixer_block(x, filters, kernel_size):
        x0 = x
        x = layers.DepthwiseConv2D(kernel_size=kernel_size, padding="same")(x)
        x = layers.Add()([activation_block(x), x0])
        x = layers.Conv2D(filters, kernel_size=1)(x)
        return activation_block(x)

    def get_conv_mixer_256_8(image_size=8, filters=4, depth=2, kernel_size=3, patch_size=2, num_classes=4):
        inputs = k.Input((image_size, image_size, 3))
        x = layers.Rescaling(scale=1.0 / 255)(inputs)
        x = conv_stem(x, filters, patch_size)
        for _ in range(depth):
            x = conv_mixer_block(x, filters, kernel_size)
        x = layers.GlobalAvgPool2D()(x)
        outputs = layers.Dense(num_classes, activation="softmax")(x)
        return k.Model(inputs, outputs)

    model = get_conv_mixer_256_8()
    model.compile(optimizer=k.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x, y = images(24, seed=6, channels=3, classes=4)
    x_val, y_val = images(12, seed=7, channels=3, classes=4)
    with shared_folder(devices) as folder:
        checkpoint_callback = k.callbacks.ModelCheckpoint(os.path.join(folder, "checkpoint.weights.h5"),
                                                          monitor="val_accuracy", save_best_only=True,
                                                          save_weights_only=True)
        history = fit(model, x * 255, y, validation_data=(x_val * 255, y_val), callbacks=[checkpoint_callback])
    return result(model, history, evaluate(model, x_val * 255, y_val))


def denoising_autoencoder(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(5)
    train_data = images(24, seed=8)
    noisy_train_data = np.clip(train_data + 0.4 * normal(9, *train_data.shape), 0.0, 1.0)
    test_data = images(12, seed=10)
    input = layers.Input(shape=(8, 8, 1))
    x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(input)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(x)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    autoencoder = k.Model(input, x)
    autoencoder.compile(optimizer="adam", loss="binary_crossentropy")
    if devices > 1:
        autoencoder = distkeras.distribute(autoencoder, devices)
    history = fit(autoencoder, train_data, train_data, epochs=1, validation_data=(test_data, test_data))
    history2 = fit(autoencoder, noisy_train_data, train_data, epochs=1, validation_data=(test_data, test_data))
    from tests.backends.corpus.common import merged

    return result(autoencoder, merged(history, history2), predicted=predict(autoencoder, test_data))


def oxford_pets_segmentation(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(6)

    def get_model(img_size, num_classes):
        inputs = k.Input(shape=img_size + (3,))
        x = layers.Conv2D(4, 3, strides=2, padding="same")(inputs)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        previous_block_activation = x
        for filters in [8]:
            x = layers.Activation("relu")(x)
            x = layers.SeparableConv2D(filters, 3, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.Activation("relu")(x)
            x = layers.SeparableConv2D(filters, 3, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
            residual = layers.Conv2D(filters, 1, strides=2, padding="same")(previous_block_activation)
            x = layers.add([x, residual])
            previous_block_activation = x
        for filters in [8, 4]:
            x = layers.Activation("relu")(x)
            x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.Activation("relu")(x)
            x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
            x = layers.BatchNormalization()(x)
            x = layers.UpSampling2D(2)(x)
            residual = layers.UpSampling2D(2)(previous_block_activation)
            residual = layers.Conv2D(filters, 1, padding="same")(residual)
            x = layers.add([x, residual])
            previous_block_activation = x
        outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)
        return k.Model(inputs, outputs)

    model = get_model((8, 8), 3)
    model.compile(optimizer=k.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x = images(24, seed=11, channels=3)
    y = labels(12, 24 * 64, 3).reshape(24, 8, 8, 1)
    history = fit(model, x, y)
    return result(model, history, predicted=predict(model, x[:12]))


def pointnet(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(7)

    def conv_bn(x, filters):
        x = layers.Conv1D(filters, kernel_size=1, padding="valid")(x)
        x = layers.BatchNormalization(momentum=0.0)(x)
        return layers.Activation("relu")(x)

    def dense_bn(x, filters):
        x = layers.Dense(filters)(x)
        x = layers.BatchNormalization(momentum=0.0)(x)
        return layers.Activation("relu")(x)

    class OrthogonalRegularizer(k.regularizers.Regularizer):
        def __init__(self, num_features, l2reg=0.001):
            self.num_features = num_features
            self.l2reg = l2reg
            self.eye = ops.eye(num_features)

        def __call__(self, x):
            x = ops.reshape(x, (-1, self.num_features, self.num_features))
            xxt = ops.tensordot(x, x, axes=(2, 2))
            xxt = ops.reshape(xxt, (-1, self.num_features, self.num_features))
            return ops.sum(self.l2reg * ops.square(xxt - self.eye))

    def tnet(inputs, num_features):
        bias = k.initializers.Constant(np.eye(num_features).flatten())
        reg = OrthogonalRegularizer(num_features)
        x = conv_bn(inputs, 4)
        x = conv_bn(x, 8)
        x = layers.GlobalMaxPooling1D()(x)
        x = dense_bn(x, 8)
        x = layers.Dense(num_features * num_features, kernel_initializer="zeros", bias_initializer=bias,
                         activity_regularizer=reg)(x)
        feat_T = layers.Reshape((num_features, num_features))(x)
        return layers.Dot(axes=(2, 1))([inputs, feat_T])

    inputs = k.Input(shape=(16, 3))
    x = tnet(inputs, 3)
    x = conv_bn(x, 4)
    x = tnet(x, 4)
    x = conv_bn(x, 8)
    x = layers.GlobalMaxPooling1D()(x)
    x = dense_bn(x, 8)
    x = layers.Dropout(0.3)(x)
    outputs = layers.Dense(3, activation="softmax")(x)
    model = k.Model(inputs=inputs, outputs=outputs, name="pointnet")
    model.compile(loss="sparse_categorical_crossentropy", optimizer=k.optimizers.Adam(learning_rate=0.001),
                  metrics=["sparse_categorical_accuracy"])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x_train, y_train = normal(12, 24, 16, 3), labels(13, 24, 3)
    history = fit(model, x_train, y_train)
    return result(model, history, evaluate(model, x_train[:12], y_train[:12]))


def image_classification_3d(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(8)
    inputs = k.Input((8, 8, 4, 1))
    x = layers.Conv3D(filters=4, kernel_size=3, activation="relu", padding="same")(inputs)
    x = layers.MaxPool3D(pool_size=2)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Conv3D(filters=8, kernel_size=3, activation="relu", padding="same")(x)
    x = layers.MaxPool3D(pool_size=2)(x)
    x = layers.BatchNormalization()(x)
    x = layers.GlobalAveragePooling3D()(x)
    x = layers.Dense(units=8, activation="relu")(x)
    x = layers.Dropout(0.3)(x)
    outputs = layers.Dense(units=1, activation="sigmoid")(x)
    model = k.Model(inputs, outputs, name="3dcnn")
    lr_schedule = k.optimizers.schedules.ExponentialDecay(0.0001, decay_steps=100000, decay_rate=0.96, staircase=True)
    model.compile(loss="binary_crossentropy", optimizer=k.optimizers.Adam(learning_rate=lr_schedule), metrics=["acc"],
                  run_eagerly=True)
    if devices > 1:
        model = distkeras.distribute(model, devices)
    rng = np.random.default_rng(14)
    x_train = rng.uniform(size=(24, 8, 8, 4, 1)).astype("float32")
    y_train = rng.integers(0, 2, size=(24,)).astype("float32")
    x_val, y_val = x_train[:12], y_train[:12]
    with shared_folder(devices) as folder:
        checkpoint_cb = k.callbacks.ModelCheckpoint(os.path.join(folder, "3d_image_classification.keras"),
                                                    save_best_only=True)
        early_stopping_cb = k.callbacks.EarlyStopping(monitor="val_acc", patience=15)
        history = fit(model, x_train, y_train, validation_data=(x_val, y_val), callbacks=[checkpoint_cb, early_stopping_cb])
    return result(model, history, predicted=predict(model, x_val))


def conv_lstm(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(9)
    rng = np.random.default_rng(15)
    frames = (rng.uniform(size=(24, 4, 6, 6, 1)) > 0.5).astype("float32")
    x_train, y_train = frames[:, :-1], frames[:, 1:]
    inp = layers.Input(shape=(None, 6, 6, 1))
    x = layers.ConvLSTM2D(filters=4, kernel_size=(3, 3), padding="same", return_sequences=True, activation="relu")(inp)
    x = layers.BatchNormalization()(x)
    x = layers.ConvLSTM2D(filters=4, kernel_size=(1, 1), padding="same", return_sequences=True, activation="relu")(x)
    x = layers.Conv3D(filters=1, kernel_size=(3, 3, 3), activation="sigmoid", padding="same")(x)
    model = k.models.Model(inp, x)
    model.compile(loss=k.losses.binary_crossentropy, optimizer=k.optimizers.Adam())
    if devices > 1:
        model = distkeras.distribute(model, devices)
    early_stopping = k.callbacks.EarlyStopping(monitor="val_loss", patience=10)
    reduce_lr = k.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=5)
    history = fit(model, x_train, y_train, validation_data=(x_train[:12], y_train[:12]),
                  callbacks=[early_stopping, reduce_lr])
    return result(model, history, predicted=predict(model, x_train[:12]))


def _stochastic_depth_class(k):
    class StochasticDepth(k.layers.Layer):
        def __init__(self, drop_prop, **kwargs):
            super().__init__(**kwargs)
            self.drop_prob = drop_prop
            self.seed_generator = k.random.SeedGenerator(1337)

        def call(self, x, training=None):
            if training:
                keep_prob = 1 - self.drop_prob
                shape = (k.ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
                random_tensor = keep_prob + k.random.uniform(shape, 0, 1, seed=self.seed_generator)
                random_tensor = k.ops.floor(random_tensor)
                return (x / keep_prob) * random_tensor
            return x

    return StochasticDepth


def cct(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(10)
    projection_dim, num_heads = 8, 2
    StochasticDepth = _stochastic_depth_class(k)

    class CCTTokenizer(layers.Layer):
        def __init__(self, kernel_size=3, stride=1, padding=1, pooling_kernel_size=3, pooling_stride=2,
                     num_conv_layers=2, num_output_channels=(4, 8), **kwargs):
            super().__init__(**kwargs)
            self.conv_model = k.Sequential()
            for i in range(num_conv_layers):
                self.conv_model.add(layers.Conv2D(num_output_channels[i], kernel_size, stride, padding="valid",
                                                  use_bias=False, activation="relu", kernel_initializer="he_normal"))
                self.conv_model.add(layers.ZeroPadding2D(padding))
                self.conv_model.add(layers.MaxPooling2D(pooling_kernel_size, pooling_stride, "same"))

        def call(self, images):
            outputs = self.conv_model(images)
            return k.ops.reshape(outputs, (-1, k.ops.shape(outputs)[1] * k.ops.shape(outputs)[2],
                                           k.ops.shape(outputs)[-1]))

    class SequencePooling(layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = layers.Dense(1)

        def call(self, x):
            attention_weights = k.ops.softmax(self.attention(x), axis=1)
            attention_weights = k.ops.transpose(attention_weights, axes=(0, 2, 1))
            weighted_representation = k.ops.matmul(attention_weights, x)
            return k.ops.squeeze(weighted_representation, -2)

    def mlp(x, hidden_units, dropout_rate):
        for units in hidden_units:
            x = layers.Dense(units, activation=k.ops.gelu)(x)
            x = layers.Dropout(dropout_rate)(x)
        return x

    data_augmentation = k.Sequential([layers.Rescaling(scale=1.0 / 255), layers.RandomCrop(8, 8),
                                      layers.RandomFlip("horizontal")], name="data_augmentation")
    inputs = layers.Input((8, 8, 3))
    augmented = data_augmentation(inputs)
    encoded_patches = CCTTokenizer()(augmented)
    dpr = [x for x in np.linspace(0, 0.1, 2)]
    for i in range(2):
        x1 = layers.LayerNormalization(epsilon=1e-5)(encoded_patches)
        attention_output = layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim, dropout=0.1)(x1, x1)
        attention_output = StochasticDepth(dpr[i])(attention_output)
        x2 = layers.Add()([attention_output, encoded_patches])
        x3 = layers.LayerNormalization(epsilon=1e-5)(x2)
        x3 = mlp(x3, hidden_units=[projection_dim, projection_dim], dropout_rate=0.1)
        x3 = StochasticDepth(dpr[i])(x3)
        encoded_patches = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-5)(encoded_patches)
    weighted_representation = SequencePooling()(representation)
    logits = layers.Dense(4)(weighted_representation)
    model = k.Model(inputs=inputs, outputs=logits)
    model.compile(optimizer=k.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
                  loss=k.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
                  metrics=[k.metrics.CategoricalAccuracy(name="accuracy"),
                           k.metrics.TopKCategoricalAccuracy(2, name="top-2-accuracy")])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    x, y = images(24, seed=16, channels=3, classes=4)
    y = k.utils.to_categorical(y, 4)
    history = fit(model, x * 255, y)
    return result(model, history, evaluate(model, x[:12] * 255, y[:12]))


CONTIGUOUS = ("not-one-device: the distributed run fails in backward with torch's \"RuntimeError: grad_input must "
              "be contiguous\" (one device trains). A Keras and torch bug reached by another memory layout: Keras' "
              "torch sparse_categorical_crossentropy moves the class axis of a (batch, h, w, classes) probability map "
              "to axis 1 and torch's nll_loss backward then rejects the strided gradient; a plain two-Conv2D softmax "
              "map with (batch, h, w, 1) labels fails the same way on one device. Which layout reaches the loss "
              "depends on the ops before it")
ORTHOGONAL = ("not-one-device: OrthogonalRegularizer's ops.tensordot(x, x, axes=(2, 2)) pairs every row of the batch "
              "with every other and ops.sum adds them up, so each replica's penalty covers only its own pairs of rows")

#: name -> (keras-io source, tolerance, backends, speed, expected: "pass", "not-one-device: why", or per backend)
PROGRAMS = {
    "image_classification_from_scratch": (K + "image_classification_from_scratch.py", BN_ADAM, ALL, "slow", "pass"),
    "vision_transformer": (K + "image_classification_with_vision_transformer.py", BN_ADAM, ALL, "slow", "pass"),
    "mlp_mixer": (K + "mlp_image_classification.py", 1e-5, ALL, "slow", "pass"),
    "convmixer": (K + "convmixer.py", 1e-5, ALL, "slow", "pass"),
    "denoising_autoencoder": (K + "autoencoder.py", 1e-5, ALL, "slow", "pass"),
    # 2e-4: its weights agree to BN_ADAM; its softmax map after BatchNormalization doubles that (TensorFlow: 1.5e-4).
    "oxford_pets_segmentation": (K + "oxford_pets_image_segmentation.py", 2e-4, ALL, "slow", {"torch": CONTIGUOUS}),
    "pointnet": (K + "pointnet.py", 5e-4, ALL, "fast", {"tensorflow": ORTHOGONAL, "torch": ORTHOGONAL}),
    "image_classification_3d": (K + "3D_image_classification.py", BN_ADAM, ALL, "slow", "pass"),
    "conv_lstm": (K + "conv_lstm.py", 1e-5, ALL, "slow", "pass"),
    "cct": (K + "cct.py", BN_ADAM, ALL, "slow", "pass"),
}
