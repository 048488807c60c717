"""distkeras.launch.exchange's pure parts: when it applies, its per-attempt keys, its timeout. The exchange itself runs
against a real torchrun store in tests/clusters/test_torchrun.py."""

import os
import subprocess
import sys

import pytest

from distkeras.launch import exchange
from distkeras.cluster import Cluster
from distkeras.errors import ClusterError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}


def cluster(coordinator="node0:29500", world=2):
    return Cluster(1 if world > 1 else 0, world, 0, 1, coordinator, "torchrun")


def test_it_applies_to_a_multi_worker_torchrun_job_whose_coordinator_is_master_addr_and_port():
    assert exchange.applies(cluster(), TORCHRUN)
    assert not exchange.applies(cluster(world=1), TORCHRUN)  # one worker: nothing to exchange
    assert not exchange.applies(cluster("node0:1234"), TORCHRUN)  # a coordinator another environment gave
    assert not exchange.applies(cluster(), {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"})


def test_keys_are_per_run_and_attempt():
    assert exchange.namespace(TORCHRUN) == "distkeras/abc/1/exchange"
    assert exchange.attempt(dict(TORCHRUN, TORCHELASTIC_RESTART_COUNT="0")) == "distkeras/abc/0"
    assert exchange.attempt(dict(TORCHRUN, TORCHELASTIC_RUN_ID="xyz")) != exchange.attempt(TORCHRUN)


def test_timeout_and_addresses():
    assert exchange.timeout({}) == exchange.DEFAULT_TIMEOUT
    assert exchange.timeout({exchange.TIMEOUT_ENV: "7.5"}) == 7.5
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ClusterError, match="Expected a number of seconds > 0 in DISTKERAS_EXCHANGE_TIMEOUT"):
            exchange.timeout({exchange.TIMEOUT_ENV: bad})
    assert exchange.address("10.0.0.2", 123) == "10.0.0.2:123"
    assert exchange.address("fe80::1", 123) == "[fe80::1]:123"
    port = exchange.free_port("127.0.0.1")
    assert 0 < port < 65536


def test_importing_it_imports_no_framework():
    code = ("import sys, distkeras.launch.exchange; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'jax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.stdout.strip() == "[]", done.stderr


def test_a_worker_publishes_the_address_the_others_reach_it_at():
    assert exchange.own_host("10.0.0.1", "10.0.0.2") == "10.0.0.2"  # another node: its routed address
    assert exchange.own_host("localhost", "127.0.0.1") == "127.0.0.1"  # one host
    assert exchange.own_host("127.0.0.1", "127.0.0.1") == "127.0.0.1"
    # Node 0 named by its host name, which it resolves to 127.0.1.1 itself: the others know it by that name.
    assert exchange.own_host("node0.example", "127.0.1.1") == "node0.example"
    assert exchange.own_host("node0.example", "::1") == "node0.example"
