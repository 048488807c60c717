"""Generative programs of keras-io's examples/generative, on generated data."""

import numpy as np

import distkeras
from tests.backends.corpus.common import ALL, TF_ONLY, BATCH, fit, images, keras, predict, result, rng, tokens
from tests.backends.realcode import _transformer_layers  # TokenAndPositionEmbedding, as the example's

K = "examples/generative/"
#: The miniature GPT fails on one device already on JAX (its causal mask tiles with multiples built from the traced
#: batch size: "Non-hashable static arguments ... reps") and on TensorFlow (OperatorNotAllowedInGraphError in
#: TransformerBlock.call): PyTorch only.
TORCH_ONLY = ("torch",)
WGAN_GP = ("not-one-device: tf.random.normal draws the latent vectors and the gradient-penalty weights inside "
           "train_step; each replica draws for its half batch, so the replicas together don't draw one device's "
           "values (issue 34, defect 3)")


def text_generation_with_miniature_gpt(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(80)
    vocab_size, maxlen, embed_dim, num_heads, feed_forward_dim = 20, 6, 8, 2, 8
    _, TokenAndPositionEmbedding = _transformer_layers(k)

    def causal_attention_mask(batch_size, n_dest, n_src, dtype):
        i = ops.arange(n_dest)[:, None]
        j = ops.arange(n_src)
        m = i >= j - n_src + n_dest
        mask = ops.cast(m, dtype)
        mask = ops.reshape(mask, [1, n_dest, n_src])
        mult = ops.concatenate([ops.expand_dims(batch_size, -1), ops.convert_to_tensor([1, 1])], 0)
        return ops.tile(mask, mult)

    class TransformerBlock(layers.Layer):
        def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
            super().__init__()
            self.att = layers.MultiHeadAttention(num_heads, embed_dim)
            self.ffn = k.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
            self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
            self.dropout1 = layers.Dropout(rate)
            self.dropout2 = layers.Dropout(rate)

        def call(self, inputs):
            input_shape = ops.shape(inputs)
            batch_size, seq_len = input_shape[0], input_shape[1]
            causal_mask = causal_attention_mask(batch_size, seq_len, seq_len, "bool")
            attention_output = self.att(inputs, inputs, attention_mask=causal_mask)
            attention_output = self.dropout1(attention_output)
            out1 = self.layernorm1(inputs + attention_output)
            ffn_output = self.dropout2(self.ffn(out1))
            return self.layernorm2(out1 + ffn_output)

    class TextGenerator(k.callbacks.Callback):
        """The example's callback, greedy and short: predict() on one prompt at each epoch's end."""

        def __init__(self, start_tokens):
            super().__init__()
            self.start_tokens = list(start_tokens)
            self.generated = []

        def on_epoch_end(self, epoch, logs=None):
            start_tokens = list(self.start_tokens)
            for _ in range(2):
                pad_len = maxlen - len(start_tokens)
                x = np.array([start_tokens + [0] * pad_len])
                y, _ = self.model.predict(x, verbose=0)
                start_tokens.append(int(np.argmax(y[0][len(start_tokens) - 1])))
            self.generated.append(start_tokens)

    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, feed_forward_dim)(x)
    outputs = layers.Dense(vocab_size)(x)
    model = k.Model(inputs=inputs, outputs=[outputs, x])
    loss_fn = k.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("adam", loss=[loss_fn, None])
    if devices > 1:
        model = distkeras.distribute(model, devices)
    text = tokens(81, 24, maxlen + 1, vocab_size, low=1)
    generator = TextGenerator([3, 4])
    history = fit(model, text[:, :-1], text[:, 1:], callbacks=[generator])
    return result(model, history, generated=np.array(generator.generated))


def lstm_character_level_text_generation(devices):
    k = keras()
    layers = k.layers
    k.utils.set_random_seed(82)
    maxlen, chars = 6, 10
    ids = rng(83).integers(0, chars, size=(24, maxlen + 1))
    onehot = np.eye(chars, dtype="float32")
    x, y = onehot[ids[:, :-1]], onehot[ids[:, -1]]
    model = k.Sequential([k.Input(shape=(maxlen, chars)), layers.LSTM(8), layers.Dense(chars, activation="softmax")])
    optimizer = k.optimizers.RMSprop(learning_rate=0.01)
    model.compile(loss="categorical_crossentropy", optimizer=optimizer)
    if devices > 1:
        model = distkeras.distribute(model, devices)
    history = fit(model, x, y)
    return result(model, history, predicted=predict(model, x[:12]))


def pixelcnn(devices):
    k = keras()
    layers, ops = k.layers, k.ops
    k.utils.set_random_seed(84)

    class PixelConvLayer(layers.Layer):
        def __init__(self, mask_type, **kwargs):
            super().__init__()
            self.mask_type = mask_type
            self.conv = layers.Conv2D(**kwargs)

        def build(self, input_shape):
            self.conv.build(input_shape)
            kernel_shape = ops.shape(self.conv.kernel)
            self.mask = np.zeros(shape=kernel_shape)
            self.mask[: kernel_shape[0] // 2, ...] = 1.0
            self.mask[kernel_shape[0] // 2, : kernel_shape[1] // 2, ...] = 1.0
            if self.mask_type == "B":
                self.mask[kernel_shape[0] // 2, kernel_shape[1] // 2, ...] = 1.0

        def call(self, inputs):
            self.conv.kernel.assign(self.conv.kernel * self.mask)
            return self.conv(inputs)

    class ResidualBlock(layers.Layer):
        def __init__(self, filters, **kwargs):
            super().__init__(**kwargs)
            self.conv1 = layers.Conv2D(filters=filters, kernel_size=1, activation="relu")
            self.pixel_conv = PixelConvLayer(mask_type="B", filters=filters // 2, kernel_size=3, activation="relu",
                                             padding="same")
            self.conv2 = layers.Conv2D(filters=filters, kernel_size=1, activation="relu")

        def call(self, inputs):
            x = self.conv1(inputs)
            x = self.pixel_conv(x)
            x = self.conv2(x)
            return layers.add([inputs, x])

    inputs = k.Input(shape=(8, 8, 1), batch_size=BATCH)
    x = PixelConvLayer(mask_type="A", filters=4, kernel_size=5, activation="relu", padding="same")(inputs)
    for _ in range(1):
        x = ResidualBlock(filters=4)(x)
    for _ in range(2):
        x = PixelConvLayer(mask_type="B", filters=4, kernel_size=1, strides=1, activation="relu", padding="valid")(x)
    out = layers.Conv2D(filters=1, kernel_size=1, strides=1, activation="sigmoid", padding="valid")(x)
    pixel_cnn = k.Model(inputs, out)
    adam = k.optimizers.Adam(learning_rate=0.0005)
    pixel_cnn.compile(optimizer=adam, loss="binary_crossentropy")
    if devices > 1:
        pixel_cnn = distkeras.distribute(pixel_cnn, devices)
    data = (images(24, seed=85) > 0.5).astype("float32")
    history = fit(pixel_cnn, data, data)
    return result(pixel_cnn, history)


def wgan_gp(devices):
    k = keras()
    layers = k.layers
    import tensorflow as tf

    k.utils.set_random_seed(86)
    noise_dim = 4

    class WGAN(k.Model):
        def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3, gp_weight=10.0):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_steps = discriminator_extra_steps
            self.gp_weight = gp_weight

        def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.d_loss_fn = d_loss_fn
            self.g_loss_fn = g_loss_fn

        def gradient_penalty(self, batch_size, real_images, fake_images):
            alpha = tf.random.normal([batch_size, 1, 1, 1], 0.0, 1.0)
            diff = fake_images - real_images
            interpolated = real_images + alpha * diff
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                pred = self.discriminator(interpolated, training=True)
            grads = gp_tape.gradient(pred, [interpolated])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
            return tf.reduce_mean((norm - 1.0) ** 2)

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = tf.shape(real_images)[0]
            for _ in range(self.d_steps):
                random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
                with tf.GradientTape() as tape:
                    fake_images = self.generator(random_latent_vectors, training=True)
                    fake_logits = self.discriminator(fake_images, training=True)
                    real_logits = self.discriminator(real_images, training=True)
                    d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                    gp = self.gradient_penalty(batch_size, real_images, fake_images)
                    d_loss = d_cost + gp * self.gp_weight
                d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
                self.d_optimizer.apply_gradients(zip(d_gradient, self.discriminator.trainable_variables))
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                generated_images = self.generator(random_latent_vectors, training=True)
                gen_img_logits = self.discriminator(generated_images, training=True)
                g_loss = self.g_loss_fn(gen_img_logits)
            gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
            self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
            return {"d_loss": d_loss, "g_loss": g_loss}

    d_model = k.Sequential([layers.Input((8, 8, 1)), layers.Conv2D(4, 3, strides=2, padding="same"),
                            layers.LeakyReLU(0.2), layers.Flatten(), layers.Dropout(0.2), layers.Dense(1)],
                           name="discriminator")
    g_model = k.Sequential([layers.Input((noise_dim,)), layers.Dense(4 * 4 * 4, use_bias=False),
                            layers.BatchNormalization(), layers.LeakyReLU(0.2), layers.Reshape((4, 4, 4)),
                            layers.UpSampling2D((2, 2)), layers.Conv2D(1, 3, padding="same", use_bias=False),
                            layers.Activation("tanh")], name="generator")

    def discriminator_loss(real_img, fake_img):
        return tf.reduce_mean(fake_img) - tf.reduce_mean(real_img)

    def generator_loss(fake_img):
        return -tf.reduce_mean(fake_img)

    wgan = WGAN(discriminator=d_model, generator=g_model, latent_dim=noise_dim, discriminator_extra_steps=3)
    wgan.compile(d_optimizer=k.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
                 g_optimizer=k.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
                 g_loss_fn=generator_loss, d_loss_fn=discriminator_loss)
    if devices > 1:
        wgan = distkeras.distribute(wgan, devices)
    train_images = (images(24, seed=87) - 0.5) / 0.5
    history = fit(wgan, train_images, epochs=1)
    return result(wgan, history)


PROGRAMS = {
    "text_generation_with_miniature_gpt": (K + "text_generation_with_miniature_gpt.py", 1e-5, TORCH_ONLY, "slow", "pass"),
    "lstm_character_level_text_generation": (K + "lstm_character_level_text_generation.py", 1e-5, ALL, "slow",
                                             "pass"),
    "pixelcnn": (K + "pixelcnn.py", 1e-5, ALL, "slow", "pass"),
    "wgan_gp": (K + "wgan_gp.py", 1e-5, TF_ONLY, "slow", WGAN_GP),
}
