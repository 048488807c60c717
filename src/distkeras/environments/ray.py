"""Ray Train's workers: TorchTrainer and TensorflowTrainer (Ray 2.x, Train v1 and v2).

Ray starts every worker process from a raylet and gives it ``RAY_RAYLET_PID`` and ``RAY_JOB_ID`` (Ray's
internal flags, ``ray._private.ray_constants.RAY_INTERNAL_FLAGS``, which Ray strips from a submitted job's
driver: only Ray's own worker processes have them). Ray Train's backends then set, in each worker, before
the train loop runs:

- TorchTrainer (``ray.train.torch.config``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``NODE_RANK`` and, with the default ``TorchConfig(init_method="env")``, ``MASTER_ADDR`` / ``MASTER_PORT``
  (rank 0's torch.distributed store). Ray has already formed the torch.distributed process group; the torch
  adapter joins it as it is.
- TensorflowTrainer (``ray.train.tensorflow.config``): ``TF_CONFIG`` = ``{"cluster": {"worker": [every
  worker's "ip:port"]}, "task": {"type": "worker", "index": rank}}`` (and ``TF_USE_LEGACY_KERAS=1``, which
  only points ``tf.keras`` at tf_keras).

A Ray worker with neither is a plain Ray task or actor (one process), or a worker of a trainer that sets no
variable at all (JaxTrainer: on CPUs it doesn't even start jax.distributed; a plain ``DataParallelTrainer``).
:func:`prepare_jax` gives distkeras' JAX environment what it reads from a ``DataParallelTrainer`` loop, and
:func:`unread_train_worker` lets distribute() refuse the rest, rather than train alone. Part of the Python
3.6-compatible core: Ray is imported only by :func:`prepare_jax`, inside a Ray Train worker.
"""

import json
import sys
from typing import Dict, List, Mapping, Optional, Tuple

from ..cluster.record import Cluster
from ..errors import ClusterError
from .base import Environment

#: What Ray gives every process a raylet starts (and nothing else has).
RAY_WORKER = ("RAY_RAYLET_PID", "RAY_JOB_ID")
#: What TorchTrainer sets in each worker.
TORCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
#: What TensorflowTrainer sets in each worker.
TENSORFLOW = ("TF_CONFIG", "TF_USE_LEGACY_KERAS")


def _picked(env: Mapping[str, str], names: tuple) -> Dict[str, str]:
    return {name: env[name] for name in sorted(names) if name in env}


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ClusterError("Expected an integer in {} (set by Ray Train). Received: {}={!r}".format(name, name, value))


def _workers_of(text: str) -> Tuple[List[str], int]:
    """TF_CONFIG as TensorflowTrainer writes it -> (every worker's ``host:port``, this worker's index)."""
    try:
        config = json.loads(text)
        members = config["cluster"]["worker"]
        task = config["task"]
        index = task["index"]
        valid = (task["type"] == "worker" and isinstance(members, list) and isinstance(index, int)
                 and not isinstance(index, bool) and 0 <= index < len(members) and set(config["cluster"]) == {"worker"})
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise ClusterError(
            'Expected TF_CONFIG as Ray Train\'s TensorflowTrainer writes it, {{"cluster": {{"worker": ["ip:port", '
            '...]}}, "task": {{"type": "worker", "index": i}}}}, in this Ray worker process. Received: TF_CONFIG={!r}. '
            "Unset TF_CONFIG in the Ray job's environment (runtime_env) and let TensorflowTrainer write it."
            .format(text)
        )
    return [str(m) for m in members], index


class RayTrain(Environment):
    """A Ray Train worker: Ray's worker variables with TorchTrainer's or TensorflowTrainer's."""

    name = "ray"
    launcher = True
    requires = "RAY_RAYLET_PID and RAY_JOB_ID (a Ray worker) with RANK and WORLD_SIZE, or TF_CONFIG"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        in_ray = all(env.get(name, "") != "" for name in RAY_WORKER)
        return in_ray and (("RANK" in env and "WORLD_SIZE" in env) or env.get("TF_CONFIG", "").strip() != "")

    @staticmethod
    def generic(env: Mapping[str, str]) -> bool:
        return False  # Ray names itself (RAY_RAYLET_PID): it describes the workers, not a plain RANK reader

    def read(self, env: Mapping[str, str]) -> Cluster:
        if "RANK" in env and "WORLD_SIZE" in env:
            return self._torch(env)
        return self._tensorflow(env)

    def _torch(self, env: Mapping[str, str]) -> Cluster:
        rank, world = _integer(env, "RANK"), _integer(env, "WORLD_SIZE")
        local_rank = _integer(env, "LOCAL_RANK") if env.get("LOCAL_RANK", "") != "" else rank
        local_world = _integer(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE", "") != "" else world
        host, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        # TorchConfig(init_method="tcp") sets no MASTER_*: Ray has formed the process group all the same.
        coordinator = "{}:{}".format(host, port) if host and port else None
        return Cluster(rank, world, local_rank, local_world, coordinator, self.name,
                       variables=_picked(env, RAY_WORKER + TORCH))

    def _tensorflow(self, env: Mapping[str, str]) -> Cluster:
        members, rank = _workers_of(env["TF_CONFIG"])
        host = members[rank].rsplit(":", 1)[0]
        local = [i for i, m in enumerate(members) if m.rsplit(":", 1)[0] == host]
        return Cluster(rank, len(members), local.index(rank), len(local), members[0], self.name,
                       workers=tuple(members), variables=_picked(env, RAY_WORKER + TENSORFLOW))


def unread_train_worker(env: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    """``(rank, world size)`` of a Ray Train worker of several that set no variable distkeras reads, else None.

    Ray's JaxTrainer on CPU starts nothing and sets nothing (it starts ``jax.distributed`` for TPUs and GPUs
    only), and a plain ``DataParallelTrainer`` sets nothing: each worker would train alone. Only Ray Train's
    own context (``ray.train.get_context()``, in the train loop) knows; it is asked only where Ray Train is
    already imported in a Ray worker process, so this imports nothing.
    """
    if not all(env.get(name, "") != "" for name in RAY_WORKER) or RayTrain.detect(env):
        return None
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        context = train.get_context()
        rank, world = int(context.get_world_rank()), int(context.get_world_size())
    except Exception:  # not inside a train loop: a plain Ray task or actor
        return None
    return (rank, world) if world > 1 else None


def prepare_jax() -> Dict[str, str]:
    """Form a JAX job out of a Ray Train ``DataParallelTrainer``'s workers; call it first in the train loop.

    Ray's JaxTrainer starts ``jax.distributed`` itself on GPUs and TPUs only (on CPUs, not at all), and sets
    no variable a process could read its place from. With a plain ``DataParallelTrainer`` instead, this
    gives distkeras' JAX environment its variables, ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
    ``JAX_PROCESS_ID``, in ``os.environ``, and lets distkeras start ``jax.distributed`` with them, as
    ``import distkeras`` does in a job that had them from the start. Every worker must call it (a
    collective), before JAX's first computation::

        def train_loop(config):
            from distkeras.environments.ray import prepare_jax
            prepare_jax()
            import distkeras, keras
            ...

        DataParallelTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2)).fit()

    Rank 0 chooses a free port on its node's address (Ray's ``get_node_ip_address``); Ray Train's
    ``broadcast_from_rank_zero`` hands it to every worker.

    Returns:
        The three variables set, as strings.

    Raises:
        ClusterError: not inside a Ray Train worker's train loop.
    """
    import os
    import socket

    import ray.train
    import ray.util
    from ray.train.collective import broadcast_from_rank_zero

    from .. import worker

    try:
        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
    except Exception as exc:  # Ray raises RuntimeError / its own errors outside a train loop
        raise ClusterError("Expected a call inside a Ray Train worker's train loop (ray.train.get_context()). "
                           "Received: {}: {}".format(type(exc).__name__, exc))
    coordinator = None
    if rank == 0:
        host = ray.util.get_node_ip_address()
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        finally:
            probe.close()
        coordinator = "[{}]:{}".format(host, port) if ":" in host else "{}:{}".format(host, port)
    coordinator = broadcast_from_rank_zero(coordinator)
    variables = {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(world), "JAX_PROCESS_ID": str(rank)}
    os.environ.update(variables)
    # ``import distkeras`` (this module's own import included) read the environment before these were set.
    worker.prepare_multi_worker()
    return variables
