"""One worker of the data-check job (see test_datacheck.py), started by `distkeras launch --nproc-per-node 2`.

    python -m tests.backends.datacheck_job OUT_DIR CASE[,CASE...]

The tests run it as the first mode ("datacheck") of test_multiprocess_basics.py's shared job (basics_job.py), in a
fresh process as here: no mode before it has set a global seed.

Each CASE builds its data the way a user's script would, on every worker alike except for what the case is about,
trains a fresh tiny model on it (or evaluates, predicts), and prints one line ``case CASE: ok CHECKS`` (no error;
CHECKS: how many comparisons ran) or ``case CASE: DataError MESSAGE``. Every worker runs every case, so a case that
raised on one worker only would leave the other waiting in a collective: the test then sees the job time out.

The files the cases read (PNG images in class folders, .npy files) are written by each worker into its own folder,
the same bytes on every worker, as a shared data set would be.
"""

import os
import random
import sys

import distkeras  # first: a multi-worker engine starts before the backend's first op
import keras
import numpy as np

from distkeras.errors import DataError

ROWS, BATCH = 96, 12
#: Cases whose workers draw the same batches: no DataError.
AGREE = ("seeded-shuffle", "numpy-shuffle", "image-dir-seeded", "list-files-sorted", "pydataset", "generator",
         "evaluate-predict")
#: PyTorch only: a DataLoader(shuffle=True) draws its order from torch's generator when a pass starts, and distkeras
#: gives every process rank 0's random state at fit()'s start and every epoch's: seeded or not, they agree.
TORCH_AGREE = ("torch-dataloader", "torch-dataloader-seeded", "pipeline-seeded")
#: PyTorch only: a model split over the processes (a stage each, a layer's shards each) draws apart too.
TORCH_DIFFER = ("pipeline-unseeded", "model-shards-unseeded")
#: Cases whose workers draw different batches: DataError on every worker.
DIFFER = ("unseeded-shuffle", "image-dir-unseeded", "list-files", "files-order", "length", "augment", "numpy-rank",
          "pydataset-epoch2", "generator-unseeded", "predict-unseeded")
#: An unseeded shuffle with check_data=False (trains on, no comparison) and "warn" (one warning, trains on).
SWITCHED = ("unseeded-off", "unseeded-warn")


def cases(backend):
    """Every case the job runs on ``backend``, in order."""
    return AGREE + DIFFER + SWITCHED + ((TORCH_AGREE + TORCH_DIFFER) if backend == "torch" else ())


def rank():
    return distkeras.cluster.from_env().rank


def samples(rows=ROWS):
    """One-hot rows (every sample tells itself apart) and a target per sample."""
    x = np.eye(rows, dtype="float32")[:, :32] + np.arange(rows, dtype="float32")[:, None] / rows
    y = (np.arange(rows, dtype="float32") % 7)[:, None]
    return x, y


def model(**options):
    net = keras.Sequential([keras.Input((32,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    net.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return distkeras.distribute(net, **options)


def image_folder(out_dir):
    """Two class folders of 8x8 PNGs, the same bytes on every worker (in a folder of its own)."""
    from PIL import Image

    root = os.path.join(out_dir, "images-rank{}".format(rank()))
    if not os.path.isdir(root):
        for label in ("a", "b"):
            os.makedirs(os.path.join(root, label))
        for i in range(48):
            pixels = np.full((8, 8, 3), (i * 5) % 256, np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, "ab"[i % 2], "{:03d}.png".format(i)))
    return root


def npy_files(out_dir):
    root = os.path.join(out_dir, "npy-rank{}".format(rank()))
    if not os.path.isdir(root):
        os.makedirs(root)
        x, _ = samples()
        for i in range(ROWS):
            np.save(os.path.join(root, "{:03d}.npy".format(i)), x[i])
    return root


def from_files(tf, files):
    """A dataset of (x, y) from a dataset of .npy file names: y from the file's number."""

    def read(name):
        x = tf.numpy_function(lambda n: np.load(n.decode()), [name], tf.float32)
        x.set_shape([32])
        number = tf.strings.to_number(tf.strings.substr(tf.strings.split(name, os.sep)[-1], 0, 3))
        return x, tf.reshape(tf.math.floormod(number, 7.0), [1])

    return files.map(read).batch(BATCH)


class Shuffled(keras.utils.PyDataset):
    """Batches in an order drawn at every epoch's end from ``order``'s generator (epoch 1: in order)."""

    def __init__(self, order):
        super().__init__()
        self.x, self.y = samples()
        self.index, self.order = np.arange(ROWS), order

    def __len__(self):
        return ROWS // BATCH

    def __getitem__(self, i):
        rows = self.index[i * BATCH:(i + 1) * BATCH]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.index = self.order.permutation(ROWS)


def batches(generator):
    x, y = samples()
    while True:
        rows = generator.permutation(ROWS)[:BATCH]
        yield x[rows], y[rows]


def run(out_dir, case):
    """The case's data is built first, before the model is distributed, as most scripts do (distribute() itself
    makes no draw of the workers' random state agree before fit()). NumPy's and Python's generators are seeded
    from the operating system first, as in a fresh process: an earlier case's fit() left rank 0's state on every
    worker."""
    np.random.seed(None)
    random.seed()
    x, y = samples()
    fit = dict(epochs=2, verbose=0)
    if case in SWITCHED:
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS).batch(BATCH)
        net = model(check_data=False if case == "unseeded-off" else "warn")
        net.fit(data, **fit)
    elif case in ("seeded-shuffle", "unseeded-shuffle", "augment", "length", "predict-unseeded"):
        import tensorflow as tf

        rows = ROWS - BATCH if case == "length" and rank() == 1 else ROWS
        data = tf.data.Dataset.from_tensor_slices((x[:rows], y[:rows]))
        if case == "augment":
            data = data.map(lambda a, b: (a + tf.random.uniform(tf.shape(a), maxval=0.1), b))
        if case in ("seeded-shuffle", "unseeded-shuffle", "predict-unseeded"):
            data = data.shuffle(ROWS, seed=1 if case == "seeded-shuffle" else None)
        data = data.batch(BATCH)
        if case == "predict-unseeded":
            net = model()
            net.predict(data.map(lambda a, b: a), verbose=0)
        else:
            net = model()
            net.fit(data, **fit)
    elif case in ("numpy-shuffle", "numpy-rank"):
        if case == "numpy-rank":  # drawn before fit(), unseeded: each worker its own arrays
            x = np.random.default_rng().random(x.shape).astype("float32")
        net = model()
        net.fit(x, y, batch_size=BATCH, shuffle=True, **fit)
    elif case in ("image-dir-seeded", "image-dir-unseeded"):
        import tensorflow as tf

        data = keras.utils.image_dataset_from_directory(
            image_folder(out_dir), image_size=(4, 8), batch_size=BATCH, shuffle=True,
            seed=3 if case == "image-dir-seeded" else None, verbose=False)
        data = data.map(lambda a, b: (tf.reshape(a[..., 0], (-1, 32)) / 255.0, b))
        net = model()
        net.fit(data, **fit)
    elif case in ("list-files", "list-files-sorted", "files-order"):
        import tensorflow as tf

        root = npy_files(out_dir)
        if case == "files-order":  # as os.listdir may list them on another file system
            names = sorted(os.listdir(root), reverse=rank() == 1)
            files = tf.data.Dataset.from_tensor_slices([os.path.join(root, n) for n in names])
        else:
            files = tf.data.Dataset.list_files(os.path.join(root, "*.npy"), shuffle=case == "list-files")
        net = model()
        net.fit(from_files(tf, files), **fit)
    elif case in ("pydataset", "pydataset-epoch2"):
        seed = 5 if case == "pydataset" else None  # unseeded: each worker its own order from epoch 2 on
        net = model()
        net.fit(Shuffled(np.random.default_rng(seed)), **fit)
    elif case in ("generator", "generator-unseeded"):
        seed = 5 if case == "generator" else None
        net = model()
        net.fit(batches(np.random.default_rng(seed)), steps_per_epoch=4, **fit)
    elif case == "evaluate-predict":
        net = model()
        net.fit(x, y, batch_size=BATCH, validation_data=(x[:48], y[:48]), **fit)
        net.evaluate(x, y, batch_size=BATCH, verbose=0)
        net.predict(x, batch_size=BATCH, verbose=0)
    elif case in TORCH_DIFFER + ("pipeline-seeded",):
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=1 if case == "pipeline-seeded" else None)
        net = keras.Sequential([keras.Input((32,)), keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        net.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        split = dict(strategy="model") if case == "model-shards-unseeded" else dict(pipeline_stages=2, microbatches=2)
        net = distkeras.distribute(net, **split)
        net.fit(data.batch(BATCH), **fit)
    elif case in ("torch-dataloader", "torch-dataloader-seeded"):
        import torch

        generator = torch.Generator().manual_seed(9) if case == "torch-dataloader-seeded" else None
        data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        net = model()
        net.fit(torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, generator=generator), **fit)
    else:
        raise ValueError("unknown case " + case)
    return net


def main(out_dir, cases):
    for case in cases.split(","):
        try:
            net = run(out_dir, case)
        except DataError as exc:
            print("case {}: DataError {}".format(case, exc).replace("\n", " "), flush=True)
        else:
            watch = net.__dict__.get("_distkeras_data_watch")
            print("case {}: ok {}".format(case, watch.checks if watch is not None else "unwatched"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
