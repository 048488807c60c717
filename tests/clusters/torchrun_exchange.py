"""distkeras.launch.exchange against a real torch.distributed.TCPStore, ranks as threads of one process (see
test_torchrun.py, which runs this file and checks the JSON it prints).

    python tests/clusters/torchrun_exchange.py

Cases: two ranks exchange TF_CONFIG's workers and JAX's coordinator through a store served as torchrun's agent
serves it; the next attempt (TORCHELASTIC_RESTART_COUNT=1) never reads the first one's addresses; a rank that
doesn't come, and a store nobody serves, end in a ClusterError within the timeout; with the agent's store not
shared (TORCHELASTIC_USE_AGENT_STORE=False) rank 0 serves the exchange itself.
"""

import datetime
import json
import os
import socket
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]

import torch.distributed as dist  # noqa: E402

from distkeras.launch import exchange  # noqa: E402
from distkeras.cluster import Cluster  # noqa: E402
from distkeras.errors import ClusterError  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(port, restart=0, agent=True, timeout=20):
    return {"TORCHELASTIC_RUN_ID": "run-1", "TORCHELASTIC_RESTART_COUNT": str(restart), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": str(agent), exchange.TIMEOUT_ENV: str(timeout)}


def cluster(rank, port, world=2):
    return Cluster(rank, world, rank, world, "127.0.0.1:{}".format(port), "torchrun")


def on_ranks(function, port, ranks=(0, 1), world=2, **env_options):
    """``function(cluster, env)`` on each rank, in threads; {rank: result or "ClusterError: ..."}."""
    results = {}

    def run(rank):
        started = time.time()
        try:
            results[rank] = function(cluster(rank, port, world), env(port, **env_options))
        except ClusterError as exc:
            results[rank] = "ClusterError: {}".format(exc)
        results["seconds{}".format(rank)] = round(time.time() - started, 1)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def main():
    out = {}
    port = free_port()
    # torchrun's agent: a multi-tenant server the workers reach as clients, kept across restarts.
    agent = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False,
                          multi_tenant=True)
    out["applies"] = exchange.applies(cluster(0, port), env(port))
    out["tf"] = on_ranks(lambda c, e: list(exchange.tf_workers(c, e)), port)
    out["jax"] = on_ranks(exchange.jax_coordinator, port)
    out["tf_restart"] = on_ranks(lambda c, e: list(exchange.tf_workers(c, e)), port, restart=1)
    out["missing"] = on_ranks(lambda c, e: list(exchange.tf_workers(c, e)), port, ranks=(0,), restart=2, timeout=2)
    out["keys"] = sorted(k for k in ("distkeras/run-1/0/exchange/tf/worker/0", "distkeras/run-1/1/exchange/tf/worker/0",
                                    "distkeras/run-1/2/exchange/tf/worker/1")
                         if agent.check([k]))
    nobody = free_port()
    out["no_store"] = on_ranks(exchange.jax_coordinator, nobody, ranks=(1,), timeout=2)
    out["served"] = on_ranks(lambda c, e: list(exchange.tf_workers(c, e)), free_port(), agent=False)
    out["jax_unshared"] = on_ranks(exchange.jax_coordinator, nobody, ranks=(0,), agent=False)
    out["port"] = port
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
