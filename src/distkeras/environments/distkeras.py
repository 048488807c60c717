"""``distkeras launch``: distkeras' own launcher.

Each worker it starts gets ``DISTKERAS_LAUNCHER_PID`` (the launcher's process id, which also lets a
worker notice that its launcher died) with torch.distributed's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, jax.distributed's ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` and, for TensorFlow, ``TF_CONFIG`` (see
:func:`distkeras.launch.command.worker_env`). The coordinator is ``MASTER_ADDR:MASTER_PORT`` (the same address as
JAX_COORDINATOR_ADDRESS); the workers' addresses come from TF_CONFIG when it is set. MXNet's scheduler
and servers get the PID but no rank: they are no workers. Part of the Python 3.6-compatible core.
"""

from typing import Mapping

from ..cluster.record import Cluster
from ..errors import ClusterError
from . import tf_config, torchrun
from .base import Environment, picked

#: Set by ``distkeras launch`` in every worker (distkeras.launch.LAUNCHER_ENV).
LAUNCHER_ENV = "DISTKERAS_LAUNCHER_PID"
JAX_NAMES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


class DistKerasLaunch(Environment):
    """DISTKERAS_LAUNCHER_PID with RANK and WORLD_SIZE."""

    name = "distkeras"
    launcher = True
    requires = "DISTKERAS_LAUNCHER_PID, RANK and WORLD_SIZE"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return LAUNCHER_ENV in env and "RANK" in env and "WORLD_SIZE" in env

    def read(self, env: Mapping[str, str]) -> Cluster:
        cluster = torchrun.read_env_vars(env, self.name)
        variables = dict(cluster.variables or {})
        variables.update(picked(env, (LAUNCHER_ENV,) + JAX_NAMES))
        workers = None
        if tf_config.TFConfig.detect(env):
            tf, members = tf_config.parse(env[tf_config.VARIABLE])
            if (tf.rank, tf.world_size) != (cluster.rank, cluster.world_size):
                raise ClusterError(
                    "distkeras launch's variables disagree: RANK={} WORLD_SIZE={}, but TF_CONFIG says rank {} of {}. "
                    "Received: TF_CONFIG={!r}".format(cluster.rank, cluster.world_size, tf.rank, tf.world_size,
                                                      env[tf_config.VARIABLE]))
            workers = tuple(members)
            variables[tf_config.VARIABLE] = env[tf_config.VARIABLE]
        return cluster._replace(workers=workers, variables=dict(sorted(variables.items())))
