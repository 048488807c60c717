"""RayTrain: Ray Train's workers, read from the exact variables Ray 2.60 sets in them (TorchTrainer's and
TensorflowTrainer's backends, ray/train/torch/config.py and ray/train/tensorflow/config.py, on top of the
raylet's RAY_RAYLET_PID / RAY_JOB_ID)."""

import json
import sys

import pytest

from distkeras.environments.ray import RayTrain
from distkeras.errors import ClusterError

# What a Ray worker process has before any Train backend runs (a TorchTrainer worker's, recorded).
RAY_WORKER = {
    "RAY_AUTH_MODE": "token", "RAY_CLIENT_MODE": "0", "RAY_JOB_ID": "01000000", "RAY_LD_PRELOAD_ON_WORKERS": "0",
    "RAY_RAYLET_PID": "6010", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
    "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace", "SPT_NOENV": "1",
}


def torch_worker(rank, local_rank=None, node_rank=0, local_world=2, world=2, master=("10.47.0.1", "38199")):
    env = dict(RAY_WORKER)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank if local_rank is None else local_rank),
               LOCAL_WORLD_SIZE=str(local_world), NODE_RANK=str(node_rank), ACCELERATE_TORCH_DEVICE="cpu")
    if master:
        env.update(MASTER_ADDR=master[0], MASTER_PORT=master[1])
    return env


def tensorflow_worker(index, addresses=("10.47.0.1:41235", "10.47.0.2:39021")):
    env = dict(RAY_WORKER)
    # json.dumps as _setup_tensorflow_environment writes it.
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}})
    env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def test_torch_trainer_worker_one_per_node():
    env = torch_worker(1, local_rank=0, node_rank=1, local_world=1)
    assert RayTrain.detect(env)
    assert not RayTrain.generic(env)
    cluster = RayTrain().read(env)
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (1, 2, 0, 1)
    assert cluster.coordinator == "10.47.0.1:38199"
    assert cluster.source == "ray"
    assert cluster.workers is None  # torch needs none: Ray formed the process group
    assert cluster.variables["RAY_RAYLET_PID"] == "6010"
    assert cluster.variables["NODE_RANK"] == "1"
    assert "OMP_NUM_THREADS" not in cluster.variables


def test_torch_trainer_two_workers_on_one_node():
    cluster = RayTrain().read(torch_worker(1))
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (1, 2, 1, 2)


def test_torch_config_tcp_init_sets_no_master():
    cluster = RayTrain().read(torch_worker(0, master=None))
    assert cluster.coordinator is None and cluster.world_size == 2


def test_tensorflow_trainer_worker():
    env = tensorflow_worker(1)
    assert RayTrain.detect(env)
    cluster = RayTrain().read(env)
    assert (cluster.rank, cluster.world_size, cluster.local_rank, cluster.local_world_size) == (1, 2, 0, 1)
    assert cluster.workers == ("10.47.0.1:41235", "10.47.0.2:39021")
    assert cluster.coordinator == "10.47.0.1:41235"
    assert cluster.source == "ray"
    assert set(cluster.variables) == {"RAY_JOB_ID", "RAY_RAYLET_PID", "TF_CONFIG", "TF_USE_LEGACY_KERAS"}


def test_tensorflow_trainer_workers_sharing_a_node():
    cluster = RayTrain().read(tensorflow_worker(1, ("10.0.0.5:1000", "10.0.0.5:1001", "10.0.0.6:1000")))
    assert (cluster.rank, cluster.local_rank, cluster.local_world_size) == (1, 1, 2)


def test_not_a_train_worker():
    assert not RayTrain.detect(RAY_WORKER)  # a plain Ray task or actor, or a JaxTrainer worker
    assert not RayTrain.detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert not RayTrain.detect({"TF_CONFIG": tensorflow_worker(0)["TF_CONFIG"]})
    driver = dict(RAY_WORKER, RAY_RAYLET_PID="")  # Ray strips its internal flags from a submitted job's driver
    assert not RayTrain.detect(dict(driver, RANK="0", WORLD_SIZE="2"))


@pytest.mark.parametrize("value", ["two", ""])
def test_bad_rank_names_the_variable(value):
    env = dict(torch_worker(0), WORLD_SIZE=value)
    with pytest.raises(ClusterError, match="WORLD_SIZE"):
        RayTrain().read(env)


@pytest.mark.parametrize("config", [
    "{not json",
    json.dumps({"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "worker", "index": 0}}),
    json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}),
    json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}),
])
def test_tf_config_not_written_by_ray_is_an_error(config):
    env = dict(RAY_WORKER, TF_CONFIG=config)
    assert RayTrain.detect(env)
    with pytest.raises(ClusterError, match="Expected TF_CONFIG as Ray Train's TensorflowTrainer writes it"):
        RayTrain().read(env)


def test_prepare_jax_outside_ray_train_is_an_error():
    pytest.importorskip("ray")
    from distkeras.environments.ray import prepare_jax

    with pytest.raises(ClusterError, match="inside a Ray Train worker"):
        prepare_jax()


class _Context(object):
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def get_world_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world


class _RayTrain(object):
    """Stands in for ``ray.train`` in sys.modules: only its get_context() is asked (inside a train loop Ray
    returns the worker's context; outside one it raises)."""

    def __init__(self, context):
        self.context = context

    def get_context(self):
        if self.context is None:
            raise RuntimeError("`get_context` can only be called inside a Ray Train worker")
        return self.context


@pytest.mark.parametrize("context, env, expected", [
    (_Context(1, 2), RAY_WORKER, (1, 2)),  # JaxTrainer on CPU, a plain DataParallelTrainer: nothing set
    (_Context(0, 1), RAY_WORKER, None),  # one worker: training alone is what was asked
    (None, RAY_WORKER, None),  # a plain Ray task or actor
    (_Context(1, 2), torch_worker(1), None),  # TorchTrainer: RayTrain reads it
    (_Context(1, 2), {"PATH": "/bin"}, None),  # not a Ray worker process
])
def test_unread_train_worker(monkeypatch, context, env, expected):
    from distkeras.environments.ray import unread_train_worker

    monkeypatch.setitem(sys.modules, "ray.train", _RayTrain(context))
    assert unread_train_worker(env) == expected


def test_unread_train_worker_imports_nothing(monkeypatch):
    from distkeras.environments.ray import unread_train_worker

    monkeypatch.delitem(sys.modules, "ray.train", raising=False)
    assert unread_train_worker(RAY_WORKER) is None
    assert "ray.train" not in sys.modules
