"""Ray Train: Ray starts the workers, and each worker's train loop is the ordinary Keras script with distribute().
Lines marked `# distkeras:` are the only changes from the single-device train loop.

    KERAS_BACKEND=torch python examples/ray_train.py                            # a local Ray instance, 2 workers
    KERAS_BACKEND=torch python examples/ray_train.py --address auto --workers 8 --use-gpu --storage /shared/ray

KERAS_BACKEND picks the trainer: PyTorch runs under TorchTrainer (Ray forms the torch.distributed group),
TensorFlow under TensorflowTrainer (Ray writes TF_CONFIG), JAX under a DataParallelTrainer whose loop first calls
distkeras.environments.ray.prepare_jax() (Ray's JaxTrainer starts no jax.distributed on CPUs). distkeras reads
the rest from the variables Ray sets in each worker. Every worker gets all the data and the same global batch; a
failed worker restarts the group (FailureConfig) and BackupAndRestore resumes it from the last epoch, in a folder
every node sees (--storage). Needs `pip install "ray[train]"`. The data is scikit-learn's digits (shipped with it).
On PyTorch, Ray forms the process group before distkeras runs: on hosts whose name resolves to a loopback address
(stock Debian and Ubuntu), add "GLOO_SOCKET_IFNAME": "eth0" (your interface) to the env_vars below.
"""

import argparse
import os

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig

parser = argparse.ArgumentParser()
parser.add_argument("--address", default=None, help="a running Ray cluster ('auto', 'host:6379'); default: start one")
parser.add_argument("--workers", type=int, default=2, help="Ray Train workers: one replica each")
parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--storage", default=os.path.abspath("ray_results"), help="a folder every node sees")
args = parser.parse_args()
BACKEND = os.environ.get("KERAS_BACKEND", "torch")


def train_loop(config):
    if config["backend"] == "jax":
        from distkeras.environments.ray import prepare_jax  # distkeras: form the JAX job through Ray

        prepare_jax()
    import distkeras  # distkeras: import before Keras
    import keras
    from distkeras.callbacks import BackupAndRestore
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target

    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model = distkeras.distribute(model)  # distkeras: one replica per Ray worker (its GPU, or its CPU)
    batch_size = distkeras.global_batch_size(32, model)  # distkeras: 32 samples per worker

    history = model.fit(x, y, batch_size=batch_size, epochs=config["epochs"], verbose=0,
                        callbacks=[BackupAndRestore(os.path.join(config["storage"], "backup"))])  # distkeras:
    if distkeras.describe(model)["rank"] == 0:  # distkeras: one writer
        print("trained on {} worker(s), accuracy {:.4f}".format(distkeras.describe(model)["workers"],
                                                                history.history["accuracy"][-1]))
        model.save(os.path.join(config["storage"], "model.keras"))


if BACKEND == "torch":
    from ray.train.torch import TorchTrainer as Trainer
elif BACKEND == "tensorflow":
    from ray.train.tensorflow import TensorflowTrainer as Trainer
else:  # jax: a plain DataParallelTrainer (see prepare_jax above)
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as Trainer

ray.init(address=args.address, runtime_env={"env_vars": {"KERAS_BACKEND": BACKEND}})
trainer = Trainer(
    train_loop,
    train_loop_config={"backend": BACKEND, "epochs": args.epochs, "storage": args.storage},
    scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.use_gpu),
    run_config=RunConfig(storage_path=args.storage, name="distkeras-example",
                         failure_config=FailureConfig(max_failures=3)),  # restarts resume from the backup
)
result = trainer.fit()
if result.error is not None:
    raise SystemExit("Ray Train failed: {}".format(result.error))
print("saved", os.path.join(args.storage, "model.keras"))
