"""A job forms the way hosts really come: late, twice, or after a restart, at the default timeouts. Each joining
host is a real process (``rendezvous.join``, the launcher's own code, without the workers), node 0 ``gather`` in a
thread; loopback only, bounded in time. The whole-launcher versions: tests/core/test_rendezvous.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from distkeras.launch import command as launch, rendezvous
from tests.core.test_launch import SRC, distkeras_launch, finish
from tests.core.test_rendezvous import WORKER
from tests.core.test_rendezvous_security import KEY, Node0, connect, me, read_all, read_line, signed_hello

HOST = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r})
    from distkeras.launch import rendezvous
    coordinator, node, nnodes, address, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    hello = rendezvous.hello(node, nnodes, 1, "torch", None, address)
    try:
        supervisor = rendezvous.join(coordinator, hello, 120.0, 15.0, key=key.encode() if key else None)
    except Exception as exc:
        print("error", type(exc).__name__, exc, flush=True)
        sys.exit(2)
    print("plan", ",".join(supervisor.plan["addresses"]), flush=True)
    deadline = time.monotonic() + float(sys.argv[6])
    while time.monotonic() < deadline:  # the job runs: heartbeats both ways, the other hosts' news
        verdict = supervisor.poll()
        if verdict is not None:
            print("verdict", verdict, flush=True)
            sys.exit(1)
        time.sleep(0.1)
    print("ran", flush=True)
""")


def host(coordinator, node, nnodes=3, address="127.0.0.1", key=KEY, run=3.0):
    return subprocess.Popen([sys.executable, "-c", HOST.format(src=SRC), coordinator, str(node), str(nnodes), address,
                             key.decode() if key else "", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_node0(supervisor, seconds):
    """Node 0's job for ``seconds``: its verdict (None: every host stayed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        verdict = supervisor.poll()
        if verdict is not None:
            return verdict
        time.sleep(0.1)
    return None


def stop(*processes):
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=30))
        finally:
            process.kill()
    return outputs


def test_a_host_20_s_late_and_one_restarted_before_the_plan_form_one_job_at_the_default_timeouts(tmp_path):
    """Three `distkeras launch` hosts: node 1 joins, is killed (-9) and started again; node 2 comes 20 s after node
    1, longer than the peer timeout (15 s). Before, node 0 took the healthy node 1 for lost, and the restarted one
    for a second node 1 that ended the job."""
    port = launch.free_port()
    common = ["--nproc-per-node", "1", "--nnodes", "3", "--coordinator", "127.0.0.1:{}".format(port),
              "--backend", "torch"]
    node0 = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "0")
    first = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "1")
    processes = [node0, first]
    try:
        time.sleep(4)  # node 1 joined, beating, waiting for the plan
        assert first.poll() is None
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        restarted = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "1")
        processes.append(restarted)
        time.sleep(20)
        assert node0.poll() is None and restarted.poll() is None, "node 0 gave up, or the restarted host was refused"
        late = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "2")
        processes.append(late)
        results = [finish(process, timeout=90) for process in (node0, restarted, late)]
    finally:
        for process in processes:
            process.kill()
    for code, _, err in results:
        assert code == 0, err
    (_, out0, err0), (_, out1, _), (_, out2, _) = results
    assert "rank 0 of 3" in out0 and "rank 1 of 3" in out1 and "rank 2 of 3" in out2
    assert "node rank 1 (127.0.0.1) left before the job formed (its connection closed" in err0


def test_a_silent_host_frees_its_slot_for_its_restart_and_a_live_hosts_rank_is_refused_alone():
    """Without a secret: a second hello for node rank 1 while node 1 beats is refused on its own link and the job
    goes on; once node 1 goes silent (SIGSTOP: no FIN, as a machine that lost power), the same rank takes the slot
    after :data:`rendezvous.STALE` seconds."""
    node0 = Node0(nnodes=3, key=None, timeout=60.0)
    node0.start()
    first = host(node0.coordinator, 1, key=None, address="127.0.0.2")
    time.sleep(4)  # node 1 joined: started, connected, said its hello
    stranger = connect(node0.coordinator)
    read_line(stranger)
    stranger.sendall(json.dumps({"hello": me(1, 3, "127.0.0.9"), "nonce": "ab" * 16}).encode() + b"\n")
    answer = read_all(stranger)
    assert b"taken by a live host (127.0.0.2)" in answer and b"addresses" not in answer and node0.is_alive()
    os.kill(first.pid, signal.SIGSTOP)
    try:
        time.sleep(rendezvous.STALE + 1.5)
        restarted = host(node0.coordinator, 1, key=None, address="127.0.0.4", run=4.0)
        time.sleep(3)  # it takes the stale slot (a plan with a silent host would form, and fail in the job instead)
        late = host(node0.coordinator, 2, key=None, address="127.0.0.3", run=4.0)
        supervisor = node0.outcome(timeout=40)
        assert isinstance(supervisor, rendezvous.Supervisor), supervisor
        assert supervisor.plan == {"addresses": ["127.0.0.1", "127.0.0.4", "127.0.0.3"]}
        assert run_node0(supervisor, 2.0) is None
        supervisor.close()
        (out1, err1), (out2, _) = stop(restarted, late)
        assert "plan 127.0.0.1,127.0.0.4,127.0.0.3" in out1 and "plan" in out2, err1
    finally:
        os.kill(first.pid, signal.SIGCONT)
        first.kill()
        first.wait(10)


def test_a_malformed_field_of_either_side_closes_that_link_never_a_traceback():
    """A MAC of 64 non-ASCII characters ended node 0 with a TypeError (``hmac.compare_digest`` on ``str``); the same
    for every field of every message, at node 0 and at a joining host."""
    node0 = Node0(nnodes=2)
    node0.start()
    good = me(1)
    bad_hellos = [dict(signed_hello("x", good), mac="é" * 64), dict(signed_hello("x", good), mac=12345),
                  dict(signed_hello("x", good), mac=["a"] * 64), {"hello": good, "nonce": "é" * 32, "mac": "0" * 64},
                  {"hello": dict(good, address="\x1b[31mred"), "nonce": "ab" * 16},
                  {"hello": dict(good, address="hôte"), "nonce": "ab" * 16},
                  {"hello": dict(good, node_rank="1"), "nonce": "ab" * 16},
                  {"hello": dict(good, nnodes=2.0), "nonce": "ab" * 16},
                  {"hello": dict(good, backend=["torch"]), "nonce": "ab" * 16},
                  {"hello": dict(good, hosts=[1, 2]), "nonce": "ab" * 16}]
    for line in bad_hellos:
        sock = connect(node0.coordinator)
        read_line(sock)
        sock.sendall(json.dumps(line).encode() + b"\n")
        assert b"addresses" not in read_all(sock, timeout=2.0)
        assert node0.is_alive(), "node 0 died of {!r}".format(line)
    real = host(node0.coordinator, 1, nnodes=2, run=1.0)
    supervisor = node0.outcome()
    assert isinstance(supervisor, rendezvous.Supervisor), supervisor
    supervisor.close()
    stop(real)
