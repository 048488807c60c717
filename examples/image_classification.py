"""Image classification with a small convnet, data-parallel. Lines marked `# distkeras:` are the only changes from
the single-device script; the rest runs unchanged on TensorFlow, JAX or PyTorch (KERAS_BACKEND picks).

    KERAS_BACKEND=tensorflow DISTKERAS_CPU_DEVICES=2 python examples/image_classification.py

The images are scikit-learn's digits (1,797 8x8 grey images that ship with the package: nothing to download),
shaped as a (height, width, channels) image batch like any other. On a machine with GPUs, leave
DISTKERAS_CPU_DEVICES unset and every GPU is used.
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--out", default="image_classification.keras")
args = parser.parse_args()

digits = load_digits()
images = (digits.images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1), in [0, 1]
x_train, x_test, y_train, y_test = train_test_split(images, digits.target, test_size=0.2, random_state=0,
                                                    stratify=digits.target)

model = keras.Sequential([
    keras.Input(shape=(8, 8, 1)),
    keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
    keras.layers.BatchNormalization(),  # statistics of the whole global batch, as on one device
    keras.layers.MaxPooling2D(2),
    keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
    keras.layers.GlobalAveragePooling2D(),
    keras.layers.Dropout(0.2),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

model = distkeras.distribute(model)  # distkeras: every GPU, else every (virtual) CPU device
batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 images per replica

model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, validation_split=0.1, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
if distkeras.is_main_process():  # distkeras: one process prints and writes (PyTorch runs one per device)
    print("test accuracy: {:.4f}".format(accuracy))
    model.save(args.out)  # a plain Keras model: keras.saving.load_model() needs no distkeras
