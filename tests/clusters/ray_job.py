"""The Ray driver of the Ray cluster tests (see test_ray.py): trains the equivalence model with Ray Train.

    python -m tests.clusters.ray_job ADDRESS OUT_DIR FRAMEWORK MODE

ADDRESS: the head's ``host:port``. FRAMEWORK: "torch" (TorchTrainer), "tensorflow" (TensorflowTrainer) or
"jax" (a DataParallelTrainer whose workers take JAX_* from distkeras.environments.ray.prepare_jax()), or
"jaxtrainer" (Ray's JaxTrainer, which distribute() refuses with a ClusterError).
MODE: "train" (2 workers, one per node), "kill" (like train, with FailureConfig(max_failures=1) and
distkeras.callbacks.BackupAndRestore in OUT_DIR/ckpt; on the first attempt rank 1 SIGKILLs itself mid-epoch 2).
Every worker writes its final weights to OUT_DIR/rank{R}.npz and what its framework counts (replicas, rank),
its node and what distkeras' RayTrain environment reads there to OUT_DIR/rank{R}.json; the driver itself then
trains the same model alone at the same global batch (KERAS_BACKEND=FRAMEWORK) and writes OUT_DIR/single.npz.
"""

import json
import os
import signal
import sys
import time

SAMPLES, BATCH, EPOCHS = 48, 12, 3


def framework_facts(model):
    """The replica count and rank as the framework itself reports them, not distkeras."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        resolver = model.distribute_strategy.cluster_resolver
        return {"replicas": model.distribute_strategy.num_replicas_in_sync, "rank": resolver.task_id}
    if backend == "jax":
        import jax

        return {"replicas": jax.device_count(), "rank": jax.process_index()}
    import torch.distributed

    return {"replicas": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank()}


def build(keras):
    """The equivalence model of tests/backends/scenarios.py, its initial weights drawn from seeded initializers:
    keras.utils.set_random_seed would import TensorFlow (tens of seconds per worker) in torch and JAX workers."""
    init = keras.initializers.GlorotUniform

    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed=1)),
        keras.layers.Dense(3, kernel_initializer=init(seed=2)),
    ])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    return model


def train_loop(config):
    """One Ray Train worker: build, distribute, fit, save."""
    started = time.time()
    if config["framework"] == "jax":
        from distkeras.environments.ray import prepare_jax

        prepare_jax()  # JAX_* for distkeras' JAX environment, before JAX's first computation
    import distkeras  # first: a multi-worker engine starts before the backend's first op
    import keras
    import numpy as np

    from distkeras.callbacks import BackupAndRestore
    from tests.backends import scenarios

    out_dir, mode = config["out_dir"], config["mode"]
    rank = distkeras.cluster.from_env().rank
    marker = os.path.join(out_dir, "killed")

    class KillRankOne(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 2 and rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    model = distkeras.distribute(build(keras))
    x, y = scenarios.data(SAMPLES)
    callbacks = []
    if mode == "kill":
        callbacks = [BackupAndRestore(os.path.join(out_dir, "ckpt")), KillRankOne()]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(os.path.join(out_dir, "rank{}.npz".format(rank)), *model.get_weights())
    facts = framework_facts(model)
    from tests.backends.multiworker_job import data_checks

    facts["data_checks"] = data_checks(model)
    facts.update(source=distkeras.cluster.from_env().source, killed=os.path.exists(marker),
                 tensorflow_imported="tensorflow" in sys.modules)
    from distkeras.environments.ray import RayTrain

    if RayTrain.detect(os.environ):  # distkeras' Ray environment, on the variables Ray really set here
        facts["ray_environment"] = RayTrain().read(os.environ)._asdict()
    import ray.util

    facts["node"] = ray.util.get_node_ip_address()
    facts["seconds"] = time.time() - started
    with open(os.path.join(out_dir, "rank{}.json".format(rank)), "w") as f:
        json.dump(facts, f)


def single_process(out_dir):
    import keras
    import numpy as np

    from tests.backends import scenarios

    model = build(keras)
    x, y = scenarios.data(SAMPLES)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    np.savez(os.path.join(out_dir, "single.npz"), *model.get_weights())


def main(address, out_dir, framework, mode):
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    variables = {"KERAS_BACKEND": "jax" if framework == "jaxtrainer" else framework}
    if framework == "torch":
        # Ray forms the torch.distributed group itself, before the train loop (and distkeras) runs, and gloo
        # advertises the address the host name resolves to: a loopback one on these hosts (as on stock
        # Debian/Ubuntu). Name the interface, as a Ray user on such hosts must.
        variables["GLOO_SOCKET_IFNAME"] = "eth0"
    ray.init(address=address or None, runtime_env={"env_vars": variables}, log_to_driver=True)
    if framework == "torch":
        from ray.train.torch import TorchTrainer as Trainer
    elif framework == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer as Trainer
    elif framework == "jax":  # JaxTrainer starts jax.distributed itself: a plain DataParallelTrainer instead
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as Trainer
    elif framework == "jaxtrainer":  # what distkeras refuses with a ClusterError (see api.distribute)
        from ray.train.v2.jax import JaxTrainer as Trainer
    else:
        raise SystemExit("Expected a framework in torch, tensorflow, jax, jaxtrainer. Received: {!r}".format(framework))
    # One worker per node: STRICT_SPREAD places the two workers' bundles on different nodes.
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}, placement_strategy="STRICT_SPREAD")
    run = RunConfig(storage_path=os.path.join(out_dir, "ray"), name="job",
                    failure_config=FailureConfig(max_failures=1 if mode == "kill" else 0))
    config = {"out_dir": out_dir, "mode": mode, "framework": framework}
    trainer = Trainer(train_loop, train_loop_config=config, scaling_config=scaling, run_config=run)
    started = time.time()
    result = trainer.fit()
    print("fit took {:.1f} s".format(time.time() - started))
    print("ray result error:", result.error)
    ray.shutdown()
    if result.error is not None:
        sys.exit(1)
    os.environ["KERAS_BACKEND"] = framework
    single_process(out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:5])
