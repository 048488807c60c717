"""An ordinary Keras script made data-parallel by distkeras. Lines marked `# distkeras:` are the only
changes from the single-device script; the rest runs unchanged on TensorFlow, JAX or PyTorch.

    KERAS_BACKEND=jax DISTKERAS_CPU_DEVICES=2 python examples/digits_mlp.py

On a machine with GPUs, leave DISTKERAS_CPU_DEVICES unset and every GPU is used.
"""

import argparse

import distkeras  # distkeras: import before Keras, so DISTKERAS_CPU_DEVICES can split the CPU
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--out", default="digits_mlp.keras")
args = parser.parse_args()

digits = load_digits()  # 1,797 8x8 images shipped with scikit-learn: nothing to download
x = (digits.data / 16.0).astype("float32")
x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input(shape=(64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

model = distkeras.distribute(model)  # distkeras: every GPU, else every (virtual) CPU device
batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 samples per replica

model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
print("test accuracy: {:.4f}".format(accuracy))
model.save(args.out)  # a plain Keras model: keras.saving.load_model() needs no distkeras
