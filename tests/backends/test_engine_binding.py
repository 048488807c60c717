"""Issue 35: in a one-host job every engine listens on the loopback address only, never on every interface.

`distkeras launch --nproc-per-node 2` on 127.0.0.1 (jobs: bind_job.py); while both workers run, the test reads
each worker's listening TCP sockets from /proc/<pid>/net/tcp{,6}, keeping those whose inode is one of the
worker's own descriptors (/proc/<pid>/fd), and asserts each is bound to 127.0.0.0/8 or ::1: JAX's coordination
service and Gloo, torch's TCPStore and Gloo. Before, JAX's service listened on [::]:PORT (jax.distributed's
default bind address) and so was reachable from any host that reaches this one.
"""

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.backends.harness import BACKEND
from tests.full import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The bound on the whole job: a hang fails the test here.
JOB_TIMEOUT = 120
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column

#: TensorFlow's gRPC server (every MultiWorkerMirroredStrategy worker runs one; the coordination service rides on
#: it) can't be told an address: GrpcServer::Init binds ``"0.0.0.0:" + port`` whatever TF_CONFIG or the
#: ServerDef name (tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc,
#: ``builder.AddListeningPort(strings::StrCat("0.0.0.0:", requested_port), ...)``, as in TF 2.21's binary).
CANNOT_BIND = {"tensorflow": (
    "TensorFlow's gRPC server binds 0.0.0.0: GrpcServer::Init in "
    "tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc calls "
    "builder.AddListeningPort(strings::StrCat(\"0.0.0.0:\", requested_port), ...); no ServerDef field, "
    "TF_CONFIG entry or environment variable names the address (gRPC makes that wildcard a dual-stack [::] socket)"
)}


def _address(hex_address):
    """``0100007F:1F90`` (tcp) or a 32-digit IPv6 one (tcp6), each 32-bit word in host order -> (host, port)."""
    host, port = hex_address.split(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    address = ipaddress.ip_address(raw)
    # An IPv6 socket bound to an IPv4 address (gRPC's, JAX's service) shows it mapped: ::ffff:192.0.2.2.
    return str(getattr(address, "ipv4_mapped", None) or address), int(port, 16)


def listening(pid):
    """The ``(host, port)`` of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir("/proc/{}/fd".format(pid)):
        try:
            target = os.readlink("/proc/{}/fd/{}".format(pid, fd))
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open("/proc/{}/net/{}".format(pid, table)) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    found.append(_address(fields[1]))
    return sorted(found)


def test_listening_reads_this_process_own_sockets():
    """The reader itself: a socket bound to 127.0.0.1 and one to every interface are told apart."""
    with socket.socket() as loop, socket.socket() as every:
        loop.bind(("127.0.0.1", 0))
        loop.listen(1)
        every.bind(("0.0.0.0", 0))
        every.listen(1)
        found = listening(os.getpid())
        assert ("127.0.0.1", loop.getsockname()[1]) in found
        assert ("0.0.0.0", every.getsockname()[1]) in found


def _is_loopback(host):
    return ipaddress.ip_address(host).is_loopback


def _stop(process):
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_job(out_dir, coordinator=None):
    """Every worker's listening sockets, read while a 2-process `distkeras launch` job of this backend runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=BACKEND)
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "--backend", BACKEND,
               "--stop-timeout", "5"] + (["--coordinator", coordinator] if coordinator else []) + [
               "-m", "tests.backends.bind_job", str(out_dir)]
    log = open(str(out_dir / "launch.log"), "w+")
    launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        deadline = time.time() + JOB_TIMEOUT
        ready = [out_dir / "ready{}".format(rank) for rank in (0, 1)]
        while not all(path.exists() for path in ready):
            if launcher.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail("the job ended or hung before both ranks trained (exit {}):\n{}".format(
                    launcher.poll(), log.read()[-6000:]))
            time.sleep(0.1)
        sockets = {rank: listening(int(path.read_text())) for rank, path in enumerate(ready)}
        (out_dir / "go").touch()
        launcher.wait(max(1, deadline - time.time()))
        log.seek(0)
        assert launcher.returncode == 0, log.read()[-6000:]
    finally:
        _stop(launcher)
        log.close()
    assert any(sockets.values()), "no worker listens at all: the reader missed the engines' sockets"
    return sockets


def check(sockets, allowed):
    """Fails, naming them, for the sockets on an address beyond loopback and ``allowed``; an expected failure on
    TensorFlow, whose gRPC servers can't be told an address."""
    exposed = {rank: [s for s in found if not _is_loopback(s[0]) and s[0] not in allowed]
               for rank, found in sockets.items()}
    exposed = {rank: found for rank, found in exposed.items() if found}
    if exposed and BACKEND in CANNOT_BIND:
        pytest.xfail(CANNOT_BIND[BACKEND] + "; listening: {}".format(sockets))
    assert not exposed, "listening beyond {}: {} (all: {})".format(
        " and ".join(["loopback"] + sorted(allowed)), exposed, sockets)


def test_every_engine_of_a_one_host_job_listens_on_loopback_only(tmp_path):
    """JAX's coordination service listened on [::]:PORT (jax.distributed's default bind address)."""
    check(run_job(tmp_path), allowed=())


@pytest.mark.skipif(not FULL and BACKEND in CANNOT_BIND, reason=(
    "full run only (DISTKERAS_FULL_TESTS=1) on TensorFlow: its gRPC server binds 0.0.0.0 whatever the coordinator "
    "(CANNOT_BIND), the expected failure test_every_engine_of_a_one_host_job_listens_on_loopback_only shows in the "
    "default run; a TensorFlow job whose coordinator is a host's own address runs in test_multihost.py"))
def test_a_job_whose_coordinator_is_this_hosts_address_listens_there_only(tmp_path):
    """--coordinator at this host's (non-loopback) address, as rank 0's host of a multi-host job: rank 0's servers
    (JAX's coordination service, torch's TCPStore) listen on that address, and Gloo on the interface holding it,
    never on every interface. torch's TCPStore listened on [::]:PORT here, JAX's service too."""
    from distkeras.launch import network

    mine = [a for addresses in network.interfaces().values() for a in addresses
            if "." in a and not ipaddress.ip_address(a).is_loopback]
    if not mine:
        pytest.skip("this host has no IPv4 address beyond loopback: {}".format(network.interfaces()))
    address = mine[0]
    sockets = run_job(tmp_path, "{}:{}".format(address, network.free_port(address)))
    check(sockets, allowed=(address,))
