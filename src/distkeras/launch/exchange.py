"""What TensorFlow and JAX workers under torchrun exchange through the rendezvous torchrun already made.

torchrun (torchelastic) gives every worker RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR:MASTER_PORT, the
address of a ``torch.distributed.TCPStore``. With ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's default
with its c10d rendezvous, which ``--standalone`` uses) the agent on node 0 serves that store itself and every
worker connects to it as a client; PyTorch's ``init_process_group`` does exactly that. The other engines need
something the variables don't say:

- **JAX**: ``jax.distributed`` runs its own coordinator service on rank 0, and MASTER_PORT is taken by the
  agent's store. Rank 0 picks a free port on its address that reaches MASTER_ADDR and publishes
  ``host:port`` in the store; every other rank reads it (:func:`jax_coordinator`).
- **TensorFlow**: TF_CONFIG names every worker's ``host:port``. Every rank publishes a free port on its own
  routed address, and all read all, in rank order (:func:`tf_workers`).

A worker on node 0 whose route to MASTER_ADDR is a loopback address (MASTER_ADDR is its own host name, which
stock Debian and Ubuntu hosts resolve to 127.0.1.1) publishes MASTER_ADDR instead: the other nodes reached the
store under that name (:func:`own_host`).

Keys live under ``distkeras/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/exchange/``: the agent keeps
its store across the restarts ``--max-restarts`` makes, and a restarted job must never read the previous
attempt's addresses. Where torchrun doesn't share its store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
``TORCHELASTIC_USE_AGENT_STORE=False``) MASTER_PORT is a free port meant for rank 0: JAX's coordinator takes it
directly, and for TensorFlow rank 0 serves a store there only while the addresses are exchanged.

Every wait is bounded (:data:`TIMEOUT_ENV` seconds, default :data:`DEFAULT_TIMEOUT`) and ends in a
:class:`~distkeras.errors.ClusterError` that names what it waited for. torch is imported here only, and only
when an exchange happens: torchrun is PyTorch's, so torch is installed wherever it runs. Part of the Python
3.6-compatible core: no framework import at module level.
"""

import datetime
import ipaddress
import os
import socket
import time
from typing import Mapping, Optional, Tuple

from . import network
from ..cluster import Cluster
from ..errors import ClusterError

#: Seconds a worker waits for the store and for the other ranks' addresses.
TIMEOUT_ENV = "DISTKERAS_EXCHANGE_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
#: torchrun's variables that mark a worker it started (the run id) and its attempt (the restart count).
RUN_ID = "TORCHELASTIC_RUN_ID"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def applies(cluster: Cluster, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``cluster`` is a multi-worker job torchrun started, its coordinator torchrun's
    MASTER_ADDR:MASTER_PORT (so the engines other than PyTorch's need the exchange)."""
    env = os.environ if environ is None else environ
    if not cluster.is_multi_worker or not env.get(RUN_ID) or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return False
    return cluster.coordinator == "{}:{}".format(env["MASTER_ADDR"], env["MASTER_PORT"])


def attempt(environ: Optional[Mapping[str, str]] = None) -> str:
    """The key prefix of this attempt of this torchrun job in its agent's store:
    ``distkeras/<run id>/<restart count>`` (a ``torch.distributed.PrefixStore`` adds the ``/``).

    The agent keeps one store for all the attempts ``--max-restarts`` makes, so every key a worker writes there
    (PyTorch's process group's too: Gloo's addresses) must be this attempt's, or a restarted job reads the dead
    one's."""
    env = os.environ if environ is None else environ
    return "distkeras/{}/{}".format(env.get(RUN_ID, "none"), env.get(RESTART_COUNT, "0") or "0")


def namespace(environ: Optional[Mapping[str, str]] = None) -> str:
    """The key prefix of the exchange: ``distkeras/<run id>/<restart count>/exchange``."""
    return attempt(environ) + "/exchange"


def timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """:data:`TIMEOUT_ENV` seconds, else :data:`DEFAULT_TIMEOUT`."""
    env = os.environ if environ is None else environ
    value = env.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ClusterError(
            "Expected a number of seconds > 0 in {}. Received: {}={!r}".format(TIMEOUT_ENV, TIMEOUT_ENV, value)
        )
    return seconds


def address(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return "[{}]:{}".format(host, port) if ":" in host else "{}:{}".format(host, port)


def own_host(master_addr: str, routed: str) -> str:
    """The host name under which the other workers reach this one.

    ``routed`` is this host's address that reaches MASTER_ADDR (:func:`distkeras.launch.network.choose`). On node 0 that
    can be a loopback address: MASTER_ADDR is node 0's own name, which stock Debian and Ubuntu hosts resolve to
    127.0.1.1 themselves. The other nodes reached node 0's store under that very name, so it is the one to
    publish; a job on one host (MASTER_ADDR "localhost" or a loopback address) publishes the loopback address.
    """
    if _is_loopback(routed) and not _is_loopback(master_addr):
        return master_addr
    return routed


def _is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _own_address(env):
    """(the host others reach this worker at, the local address to find a free port on)."""
    routed = network.choose(env["MASTER_ADDR"], environ=env).address
    return own_host(env["MASTER_ADDR"], routed), routed


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now (the kernel's pick; the engine binds it soon after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def jax_coordinator(cluster: Cluster, environ: Optional[Mapping[str, str]] = None) -> str:
    """The ``host:port`` of jax.distributed's coordinator service for this torchrun job.

    Rank 0 picks a free port on its address that reaches MASTER_ADDR and publishes it; the other ranks read
    it. Where torchrun doesn't serve its store at MASTER_PORT, that port itself (free, meant for rank 0).

    Raises:
        ClusterError: the store can't be reached, or rank 0's address doesn't come within the timeout.
        NetworkError: no interface of this host reaches MASTER_ADDR.
    """
    env = os.environ if environ is None else environ
    if env.get(USE_AGENT_STORE) != "True":
        return cluster.coordinator
    key = "jax/coordinator"
    with _Store(cluster, env) as store:
        if cluster.rank == 0:
            host, local = _own_address(env)
            store.set(key, address(host, free_port(local)))
        return store.get_all([key], "rank 0's jax.distributed coordinator address")[0]


def tf_workers(cluster: Cluster, environ: Optional[Mapping[str, str]] = None) -> Tuple[str, ...]:
    """Every rank's ``host:port`` for TF_CONFIG, in rank order, exchanged through torchrun's store.

    Each rank publishes a free port on its own address that reaches MASTER_ADDR, then reads every rank's.

    Raises:
        ClusterError: the store can't be reached, or some ranks' addresses don't come within the timeout
            (the message names them).
        NetworkError: no interface of this host reaches MASTER_ADDR.
    """
    env = os.environ if environ is None else environ
    host, local = _own_address(env)
    keys = ["tf/worker/{}".format(rank) for rank in range(cluster.world_size)]
    with _Store(cluster, env, serve=env.get(USE_AGENT_STORE) != "True") as store:
        store.set(keys[cluster.rank], address(host, free_port(local)))
        return tuple(store.get_all(keys, "every rank's TensorFlow worker address"))


class _Store(object):
    """A client of torchrun's store at MASTER_ADDR:MASTER_PORT, keys under :func:`namespace`; with
    ``serve``, rank 0 serves the store itself and keeps it until every rank has read what it needs."""

    def __init__(self, cluster, env, serve=False):
        self.cluster = cluster
        self.env = env
        self.seconds = timeout(env)
        self.serve = serve and cluster.rank == 0
        self.prefix = namespace(env)
        self.where = "{}:{}".format(env["MASTER_ADDR"], env["MASTER_PORT"])
        self.store = None

    def __enter__(self):
        import torch.distributed as dist

        wait = datetime.timedelta(seconds=self.seconds)
        host, port = self.env["MASTER_ADDR"], int(self.env["MASTER_PORT"])
        try:
            if self.serve:
                store = dist.TCPStore(host, port, self.cluster.world_size, True, wait, wait_for_workers=False)
            else:
                store = dist.TCPStore(host, port, self.cluster.world_size, False, wait)
        except Exception as exc:  # torch raises RuntimeError / DistNetworkError / DistStoreError
            raise ClusterError(
                "Expected torchrun's store at MASTER_ADDR:MASTER_PORT={} (rank {} of {}, {}={}), to exchange the "
                "addresses TensorFlow and JAX need. Received: {}: {}. Check that torchrun's agent on node 0 runs and "
                "is reachable from this host, or set {} longer.".format(
                    self.where, self.cluster.rank, self.cluster.world_size, USE_AGENT_STORE,
                    self.env.get(USE_AGENT_STORE), type(exc).__name__, str(exc).rstrip("."), TIMEOUT_ENV,
                )
            )
        self.store = dist.PrefixStore(self.prefix, store)
        self._server = store
        return self

    def set(self, key, value):
        self.store.set(key, value)

    def get_all(self, keys, what):
        """The values of ``keys``, waiting at most the timeout for all of them."""
        deadline = time.time() + self.seconds
        while True:
            missing = [k for k in keys if not self.store.check([k])]
            if not missing:
                break
            if time.time() > deadline:
                raise ClusterError(
                    "Waited {:.0f} s in torchrun's store at {} for {}; still missing: {} (keys under {!r}). "
                    "Expected every one of the {} workers of this attempt to start and publish its address. "
                    "Check that every worker runs distkeras with the same Keras backend; set {} to wait longer."
                    .format(self.seconds, self.where, what, ", ".join(missing), self.prefix, self.cluster.world_size,
                            TIMEOUT_ENV)
                )
            time.sleep(0.05)
        values = [self.store.get(k).decode("utf-8") for k in keys]
        self.store.add("read/" + keys[0], 1)
        self.read = "read/" + keys[0]
        return values

    def __exit__(self, *exc_info):
        if self.serve and exc_info[0] is None:
            # Others read from this process' store: keep it until all have (bounded, like every wait here).
            deadline = time.time() + self.seconds
            while self.store.add(self.read, 0) < self.cluster.world_size and time.time() < deadline:
                time.sleep(0.05)
        self.store = self._server = None
        return False
