"""The keras-mxnet multi-GPU CIFAR-10 recipe, made data-parallel by distkeras instead of multi_gpu_model.

A small CNN (two conv blocks of 32 and 64 filters with max-pooling and dropout, Dense 512, softmax),
RMSprop, real-time augmentation with ImageDataGenerator, 32 images per device per step. Lines marked
`# distkeras:` are the only changes from the single-device script. The data is synthetic (32x32x3
images whose class shows in their colour), so nothing is downloaded.

    KERAS_BACKEND=mxnet DISTKERAS_CPU_DEVICES=2 python examples/cifar10_cnn_mxnet.py --quick

On a machine with GPUs, leave DISTKERAS_CPU_DEVICES unset and every GPU is used. Needs keras-mxnet
2.2.4.3 and mxnet 1.9.1 (scripts/mxnet-env.sh makes such an environment).
"""

import argparse

import distkeras  # distkeras: import before keras (on Python >= 3.10 keras-mxnet imports only after it)
import keras
import numpy as np
from keras.preprocessing.image import ImageDataGenerator

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="512 images, 3 epochs: well under a minute on a CPU")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--out", default="cifar10_cnn_mxnet.h5")
args = parser.parse_args()
train_size, test_size, epochs = (512, 128, 3) if args.quick else (10000, 2000, 10)
epochs = args.epochs or epochs
num_classes = 10


def synthetic_cifar(count, seed):
    """Noise images whose mean colour depends on the class, shaped for keras' image data format."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(num_classes, size=count)
    palette = np.random.RandomState(0).uniform(0.2, 0.8, size=(num_classes, 1, 1, 3))  # the same for every split
    images = np.clip(palette[labels] + rng.normal(scale=0.2, size=(count, 32, 32, 3)), 0, 1).astype("float32")
    if keras.backend.image_data_format() == "channels_first":
        images = images.transpose(0, 3, 1, 2)
    return images, keras.utils.to_categorical(labels, num_classes)


x_train, y_train = synthetic_cifar(train_size, seed=1)
x_test, y_test = synthetic_cifar(test_size, seed=2)

model = keras.models.Sequential([
    keras.layers.Conv2D(32, (3, 3), padding="same", activation="relu", input_shape=x_train.shape[1:]),
    keras.layers.Conv2D(32, (3, 3), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Dropout(0.25),
    keras.layers.Conv2D(64, (3, 3), padding="same", activation="relu"),
    keras.layers.Conv2D(64, (3, 3), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Dropout(0.25),
    keras.layers.Flatten(),
    keras.layers.Dense(512, activation="relu"),
    keras.layers.Dropout(0.5),
    keras.layers.Dense(num_classes, activation="softmax"),
])
model.compile(optimizer=keras.optimizers.RMSprop(lr=0.0001, decay=1e-6), loss="categorical_crossentropy", metrics=["accuracy"])

model = distkeras.distribute(model)  # distkeras: every GPU, else every CPU context; replaces multi_gpu_model
batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 images per device per step

augment = ImageDataGenerator(width_shift_range=0.1, height_shift_range=0.1, horizontal_flip=True)
model.fit_generator(
    augment.flow(x_train, y_train, batch_size=batch_size),
    steps_per_epoch=int(np.ceil(train_size / float(batch_size))),
    epochs=epochs,
    validation_data=(x_test, y_test),
    verbose=2,
)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
print("test loss {:.4f}, accuracy {:.4f}".format(loss, accuracy))
model.save(args.out)  # the plain model: keras.models.load_model() needs no distkeras, and nothing nests
