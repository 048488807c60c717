"""The namespace-host harness itself (tests/netns.py): hosts reach each other and nothing else, a link
can be given a bandwidth, and no namespace outlives its test, even one whose process was SIGKILLed."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

SEND = """
import socket, sys, time
data = b"x" * int(sys.argv[2])
with socket.create_connection((sys.argv[1], 5001), timeout=30) as s:
    started = time.time()
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print(time.time() - started)
"""
RECEIVE = """
import socket
with socket.create_server(("0.0.0.0", 5001)) as server:
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
    conn.sendall(b"k")
"""


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def transfer_seconds(hosts, size):
    receiver = hosts.popen(1, [sys.executable, "-c", RECEIVE])
    try:
        time.sleep(0.5)
        done = hosts.run(0, [sys.executable, "-c", SEND, hosts.addresses[1], str(size)], capture_output=True,
                         text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return float(done.stdout)
    finally:
        receiver.kill()
        receiver.wait()


def test_hosts_reach_each_other_and_a_limited_link_has_its_bandwidth():
    with netns.Hosts(2) as hosts:
        fast = transfer_seconds(hosts, 2000000)
        hosts.limit(0, "8mbit")
        slow = transfer_seconds(hosts, 2000000)  # 16 Mbit at 8 Mbit/s: about 2 s
        print("2 MB: {:.3f} s unlimited, {:.2f} s at 8 Mbit/s".format(fast, slow))
        assert 1.5 < slow < 6 and slow > 5 * fast


def test_no_namespace_outlives_its_creator():
    with netns.Hosts(2) as hosts:
        names = list(hosts.names) + [hosts.switch]
        sleeper = hosts.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        assert all(name in namespaces() for name in names)
    assert sleeper.wait(10) is not None  # its processes were killed
    assert not any(name in namespaces() for name in names)
    # A creator killed with SIGKILL can't clean up: the next Hosts() removes what it left.
    script = textwrap.dedent("""
        import os, signal, sys
        sys.path.insert(0, {root!r})
        from tests import netns
        hosts = netns.Hosts(2)
        print(" ".join(hosts.names + [hosts.switch]), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """).format(root=ROOT)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    left = done.stdout.split()
    assert left and all(name in namespaces() for name in left)
    with netns.Hosts(1):
        pass
    assert not any(name in namespaces() for name in left)
