"""Two hosts' launchers on one machine (both on 127.0.0.1, no framework): they agree before any worker
starts, hand TensorFlow every host's address, and end the whole job in bounded time when a worker dies,
when a launcher goes silent (SIGSTOP: no FIN, no reset, only silence) or when a launcher is killed.
The same over real namespace hosts, with real engines: tests/backends/test_multihost.py."""

import os
import signal
import time

import pytest

from distkeras.launch import command as launch
from tests.core.test_launch import alive, distkeras_launch, finish

WORKER = """
import json, os, sys, time
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "engine port", os.environ["MASTER_PORT"],
      "interface", os.environ.get("DISTKERAS_INTERFACE"), flush=True)
if "TF_CONFIG" in os.environ:
    print("tf workers", ",".join(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]), flush=True)
with open("pid-{}".format(os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
    time.sleep(1)
    sys.exit(int(os.environ.get("FAIL_CODE", "3")))
if os.environ.get("FAIL_CODE") == "75":  # a preemption: every rank stops after the same step, exit 75
    import signal
    signal.signal(signal.SIGTERM, lambda *_: print("sigterm", flush=True))
    time.sleep(3)
    sys.exit(75)
time.sleep(float(os.environ.get("SLEEP", "0.5")))
"""


def two_hosts(tmp_path, *options, nproc=1, env=None):
    port = launch.free_port()
    common = ["--nproc-per-node", str(nproc), "--nnodes", "2", "--coordinator", "127.0.0.1:{}".format(port),
              "--stop-timeout", "5"] + list(options)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # distkeras_launch passes this process' environment on
    try:
        node0 = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "0")
        node1 = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "1")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return node0, node1, port


def pid_of(tmp_path, rank, timeout=30):
    path = tmp_path / "pid-{}".format(rank)
    deadline = time.time() + timeout
    while not path.exists() or not path.read_text():
        assert time.time() < deadline, "rank {} never started".format(rank)
        time.sleep(0.1)
    return int(path.read_text())


def test_two_launchers_agree_then_run_one_job(tmp_path):
    node0, node1, port = two_hosts(tmp_path, "--backend", "tensorflow", nproc=2)
    (code0, out0, err0), (code1, out1, err1) = finish(node0), finish(node1)
    assert code0 == 0 and code1 == 0, err0 + err1
    # Across hosts the engines use the ports after the launchers' own.
    assert "[rank 3] rank 3 of 4 engine port {} interface lo".format(port + 1) in out1
    assert "[rank 0] rank 0 of 4 engine port {} interface lo".format(port + 1) in out0
    # TensorFlow's worker list comes from the addresses the launchers exchanged (no --hosts given).
    workers = ",".join("127.0.0.1:{}".format(port + 1 + i) for i in (0, 1, 0, 1))
    assert "[rank 2] tf workers {}".format(workers) in out1
    assert "node rank 1 of 2: ranks 2-3 on lo (127.0.0.1) (route); hosts 127.0.0.1, 127.0.0.1" in err1


def test_hosts_that_disagree_fail_before_any_worker_starts(tmp_path):
    port = launch.free_port()
    first = ["--nproc-per-node", "1", "--nnodes", "2", "--coordinator", "127.0.0.1:{}".format(port), "--backend", "torch"]
    node0 = distkeras_launch(tmp_path, WORKER, *first, "--node-rank", "0")
    node1 = distkeras_launch(tmp_path, WORKER, *(first[:1] + ["2"] + first[2:]), "--node-rank", "1")
    for code, out, err in (finish(node0), finish(node1)):
        assert code == 2 and "[rank" not in out + err, err
        assert ("node rank 1 (127.0.0.1) was given --nproc-per-node 2, node rank 0 was given 1: every host must be "
                "started with the same --nproc-per-node.") in err
    node0 = distkeras_launch(tmp_path, WORKER, *first, "--node-rank", "1", "--join-timeout", "2")
    code, out, err = finish(node0)
    assert code == 2 and "No launcher of node rank 0 answered at 127.0.0.1:{} within 2 s (Connection refused)".format(
        port) in err


def test_a_worker_dying_on_one_host_ends_the_other_host_naming_it(tmp_path):
    node0, node1, _ = two_hosts(tmp_path, "--backend", "torch", env={"FAIL_RANK": "1", "SLEEP": "60"})
    started = time.time()
    (code0, _, err0), (code1, _, err1) = finish(node0), finish(node1)
    assert code1 == 3 and "rank 1 died (exit code 3)" in err1
    assert code0 == 1 and "rank 1 on node rank 1 (127.0.0.1) died (exit code 3); stopping this host's workers" in err0
    assert time.time() - started < 20


@pytest.mark.parametrize("how", ["silent", "killed"])
def test_a_lost_host_ends_the_job_within_the_peer_timeout(tmp_path, how):
    node0, node1, _ = two_hosts(tmp_path, "--backend", "torch", "--peer-timeout", "3", env={"SLEEP": "60"})
    worker1 = pid_of(tmp_path, 1)
    pid_of(tmp_path, 0)
    lost = time.time()
    if how == "silent":
        node1.send_signal(signal.SIGSTOP)  # a host that says nothing any more: its connection stays open
    else:
        node1.kill()
    try:
        code0, _, err0 = finish(node0, timeout=30)
        elapsed = time.time() - lost
    finally:
        node1.send_signal(signal.SIGCONT)
    if how == "silent":
        assert "node rank 1 (127.0.0.1, rank 1) is lost: no word from its launcher for 3 s" in err0
        assert 2.5 < elapsed < 3 + 5 + 2
        # Once it runs again it finds the job over (node 0's word, or silence), and ends too.
        code1, _, err1 = finish(node1, timeout=30)
        assert code1 == 1 and "stopping this host's workers" in err1
    else:
        assert "node rank 1 (127.0.0.1, rank 1) closed its connection before its workers finished" in err0
        assert elapsed < 5
        deadline = time.time() + 10
        while alive(worker1) and time.time() < deadline:  # it dies with its launcher (PR_SET_PDEATHSIG)
            time.sleep(0.1)
        assert not alive(worker1)
    assert code0 == 1


def test_a_preempted_worker_on_one_host_ends_every_host_with_75_not_as_a_crash(tmp_path):
    """Exit 75 (a worker stopped after a SIGTERM, its checkpoint written) on node 1: node 0's launcher is told,
    lets its workers stop after the same step on their own (no SIGTERM), and exits 75 as well."""
    node0, node1, _ = two_hosts(tmp_path, "--backend", "torch", env={"FAIL_RANK": "1", "FAIL_CODE": "75"})
    (code0, out0, err0), (code1, _out1, err1) = finish(node0), finish(node1)
    assert code1 == launch.EXIT_PREEMPTED and code0 == launch.EXIT_PREEMPTED, err0 + err1
    assert "rank 1 was preempted (exit code 75)" in err1 and "died" not in err0 + err1
    assert "this host's workers stop after the same step" in err0 and "sigterm" not in out0
