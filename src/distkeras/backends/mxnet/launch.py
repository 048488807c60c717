"""How ``distkeras launch`` starts an MXNet job: MXNet's parameter server (ps-lite) is the engine, configured by
``DMLC_*`` variables; the launchers start its scheduler (on node rank 0) and one server per host beside the workers.
Framework-free: the launcher imports no MXNet. Python 3.6 compatible.
"""

import os
import sys
from typing import Dict, List, Optional, Tuple

from ...launch.network import parse_address
from ...launch.processes import LAUNCHER_ENV


def dmlc_env(role: str, engine: str, nnodes: int, world_size: int, node_host: Optional[str] = None) -> Dict[str, str]:
    """The ``DMLC_*`` variables MXNet's parameter server (ps-lite) reads, for a process of ``role``.

    Every process meets the scheduler at ``engine`` (HOST:PORT); the job has one server per host and
    ``world_size`` workers. ``DMLC_NODE_HOST`` is the address this process tells the others to reach it at:
    the address of this host the launchers agreed on (``node_host``), or on one host the engine's
    (loopback) -- never what ps-lite would guess from the host's interfaces.
    """
    host, port = parse_address(engine)
    return {
        "DMLC_ROLE": role,
        "DMLC_PS_ROOT_URI": host,
        "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NUM_SERVER": str(nnodes),
        "DMLC_NUM_WORKER": str(world_size),
        "DMLC_NODE_HOST": node_host or host,
    }


def ps_roles(engine: str,
             nnodes: int,
             node_rank: int,
             world_size: int,
             node_host: Optional[str] = None,
             python: Optional[str] = None,
             environ: Optional[Dict[str, str]] = None) -> List[Tuple[List[str], Dict[str, str], str]]:
    """``(command, env, label)`` of this host's MXNet parameter-server processes: on node rank 0 the
    scheduler, on every host one server (server ``node_rank``). Each is a Python importing mxnet with its
    ``DMLC_ROLE``: ``mxnet/kvstore/kvstore_server.py`` then runs the role until the workers finish, and exits."""
    base = dict(os.environ if environ is None else environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES",
                 "JAX_COORDINATOR_ADDRESS", "TF_CONFIG"):
        base.pop(name, None)
    base["PYTHONUNBUFFERED"] = "1"
    base[LAUNCHER_ENV] = str(os.getpid())
    command = [python or sys.executable, "-c", "import mxnet"]
    roles = []
    for role, label in ([("scheduler", "scheduler")] if node_rank == 0 else []) + [("server", "server {}".format(node_rank))]:
        env = dict(base)
        env.update(dmlc_env(role, engine, nnodes, world_size, node_host))
        roles.append((command, env, label))
    return roles
