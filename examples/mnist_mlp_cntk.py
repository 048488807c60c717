"""Scenario 1, the Keras 2 CNTK recipe for many GPUs and machines, made data-parallel by distkeras.

An MNIST MLP (784 -> 512 relu -> dropout 0.2 -> 512 relu -> dropout 0.2 -> 10 softmax, RMSprop,
categorical cross-entropy). The recipe forces Keras to make its train function, wraps the CNTK
trainer's learner in ``data_parallel_distributed_learner``, installs a new trainer, partitions the data
by ``Communicator.rank()``/``num_workers()`` and calls ``Communicator.finalize()``; here
``distkeras.distribute(model)`` does all of it, and every worker also starts from rank 0's weights and
steps as one process would at the same global batch. Lines marked ``# distkeras:`` are the only changes
from the single-device script. The data is generated (MNIST-shaped), so nothing is downloaded.

    distkeras launch --backend cntk --nproc-per-node 2 examples/mnist_mlp_cntk.py --quick

Needs CNTK 2.7 and Keras 2.3.1 (CPython 3.5/3.6) and mpiexec (Open MPI: 1.10, which CNTK 2.7 links, or
4.x with the two links scripts/cntk-env.sh makes). Across machines, run mpiexec yourself: ``mpiexec -n 8 --hostfile hosts python examples/mnist_mlp_cntk.py``.
"""

import argparse

import numpy as np

import distkeras  # distkeras: before keras
import keras
from keras.layers import Dense, Dropout
from keras.models import Sequential
from keras.optimizers import RMSprop

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="4096 images, 2 epochs: seconds on a CPU")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--out", default="mnist_mlp_cntk.h5")
args = parser.parse_args()
train_size, test_size, epochs = (4096, 1024, 2) if args.quick else (60000, 10000, 20)
epochs = args.epochs or epochs
num_classes = 10


def synthetic_mnist(count, seed):
    """Noisy 28x28 grey images, flattened, whose class is a bright band of rows; the same on every worker."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(num_classes, size=count)
    images = rng.uniform(0, 0.3, size=(count, 28, 28))
    for c in range(num_classes):
        images[labels == c, 2 * c + 4:2 * c + 7, 4:24] += 0.7
    return images.reshape(count, 784).astype("float32"), keras.utils.to_categorical(labels, num_classes)


x_train, y_train = synthetic_mnist(train_size, seed=1)
x_test, y_test = synthetic_mnist(test_size, seed=2)

model = Sequential()
model.add(Dense(512, activation="relu", input_shape=(784,)))
model.add(Dropout(0.2))
model.add(Dense(512, activation="relu"))
model.add(Dropout(0.2))
model.add(Dense(num_classes, activation="softmax"))
model.compile(loss="categorical_crossentropy", optimizer=RMSprop(), metrics=["accuracy"])
model = distkeras.distribute(model)  # distkeras: the distributed learner and trainer, rank 0's weights, the data split
rank = distkeras.describe(model)["rank"]  # distkeras: rank 0 prints
if rank == 0:  # distkeras: rank 0 prints
    model.summary()

# The full arrays on every worker: fit() gives each its part of every global batch of 128 (64 on 2 workers).
history = model.fit(x_train, y_train, batch_size=distkeras.global_batch_size(64, model),  # distkeras: 64 per worker
                    epochs=epochs, verbose=1, validation_data=(x_test, y_test))
score = model.evaluate(x_test, y_test, verbose=0)
if rank == 0:  # distkeras: rank 0 prints
    print("Test loss:", score[0])
    print("Test accuracy:", score[1])
model.save(args.out)  # rank 0 writes it; Communicator.finalize() runs at exit
