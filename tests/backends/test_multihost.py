"""Two hosts over a real network: Linux network namespaces with their own addresses (tests/netns.py), one
`distkeras launch` per host, started with the README's own two-host commands.

On the active backend: 2 hosts x 1 (in the full run, DISTKERAS_FULL_TESTS=1) and x 2 processes train to the weights of one process at the same global
batch, every rank ends identical, and the framework counts every replica; a host lost mid-epoch (its link
goes down, then its processes die: the survivors get no reset, only silence) ends the job on the other host
within the bound, naming the lost rank, and the job then resumes from its checkpoint to the uninterrupted
run's weights; a coordinator nobody listens on, a wrong --nnodes, mismatched --hosts, or no route to the
coordinator fail with a clear message before any worker starts. Needs root and iproute2; skips elsewhere,
saying why.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import netns
from tests.full import FULL, only_in_full
from tests.backends.harness import BACKEND
from tests.backends.test_multiworker import ROOT, assert_close, rank_weights, single_process_weights

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
PORT = 29500
#: The default bound on noticing a lost host (rendezvous.DEFAULT_PEER_TIMEOUT) is what is tested.
PEER_TIMEOUT = 15.0
STOP_TIMEOUT = 10


def readme_commands():
    """The README's two-host commands, in node-rank order (the test runs what users are told to run)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    lines = [line.split("#")[0].strip() for line in text.splitlines() if "--nnodes 2 --node-rank" in line]
    lines = [line for line in lines if line.startswith("distkeras launch")]
    assert len(lines) == 2, lines
    return lines


def commands(hosts, nproc, out_dir, mode, extra=()):
    """The README's commands for these hosts: its address, this test's process count and job."""
    example = readme_commands()[0].split("--coordinator ")[1].split(":")[0]
    token = os.path.join(str(out_dir), "job.token")  # the README's secret: the launchers authenticate each other
    with open(token, "w") as f:
        f.write(os.urandom(32).hex())
    result = []
    for line in readme_commands():
        assert "--token-file job.token" in line, line
        line = line.replace(example, hosts.addresses[0]).replace("job.token", token)
        line = re.sub(r"--nproc-per-node \d+", "--nproc-per-node {}".format(nproc), line)
        words = line.split()
        assert words[-1] == "train.py", line
        result.append([sys.executable, "-m", "distkeras"] + words[1:-1] + list(extra) +
                      ["--stop-timeout", str(STOP_TIMEOUT), "--backend", BACKEND,
                       "-m", "tests.backends.multiworker_job", str(out_dir), mode])
    return result


def environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND=BACKEND)
    return env


def start(hosts, lines, which=None):
    which = range(len(lines)) if which is None else which
    return {i: hosts.popen(i, lines[i], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env=environment()) for i in which}


def finish(processes, timeout=400):
    """Every launcher's (exit code, stdout, stderr); a launcher still running after ``timeout`` fails the test."""
    results = {}
    deadline = time.time() + timeout
    for i, process in processes.items():
        try:
            out, err = process.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            pytest.fail("host {}'s launcher still ran after {} s:\n{}".format(i, timeout, err[-3000:]))
        results[i] = (process.returncode, out, err)
    return results


@pytest.fixture
def hosts():
    with netns.Hosts(2) as made:
        yield made


def test_the_host_name_resolves_to_loopback_inside_the_hosts(hosts):
    """The trap these tests exist for: an engine that trusts the host name advertises a loopback address."""
    import socket

    done = hosts.run(1, [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"],
                     capture_output=True, text=True)
    assert done.stdout.strip().startswith("127."), (done.stdout, socket.gethostname())


@pytest.mark.parametrize("nproc", [
    pytest.param(1, marks=only_in_full("2 hosts x 2 processes check the same across hosts, and the lost-host test "
                                       "trains 2 hosts x 1 process to one process' weights")),
    2,
])
def test_two_hosts_train_as_one_process(hosts, tmp_path, nproc):
    results = finish(start(hosts, commands(hosts, nproc, tmp_path, "train")))
    for i, (code, out, err) in results.items():
        assert code == 0, "host {}:\n{}\n{}".format(i, out[-2000:], err[-4000:])
        # Each launcher says which interface it picked: the namespace's own, not loopback.
        assert "on eth0 ({})".format(hosts.addresses[i]) in err
    world = 2 * nproc
    weights = [rank_weights(tmp_path, rank) for rank in range(world)]
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_array_equal(a, b)  # identical on every rank of both hosts
    assert_close(single_process_weights(), weights[0])
    out = results[0][1] + results[1][1]
    for rank in range(world):
        assert "[rank {}] framework replicas {}".format(rank, world) in out
        assert "'rank': {}, 'workers': {}".format(rank, world) in out
        # The data check (on by default in a job) compared the workers' batches across the hosts.
        assert re.search(r"\[rank {}\] data checks [1-9]".format(rank), out), out[-2000:]


@pytest.mark.skipif(not FULL and BACKEND != "tensorflow", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): the launchers end the job on a silent host whatever the backend (the "
    "peer timeout: tests/core/test_rendezvous.py, with no framework), each engine's ending on a lost worker is "
    "test_multiworker's (every backend) and the resume from a checkpoint is test_preemption's on every backend; the default run "
    "keeps this one on TensorFlow (its collectives wait the longest for a peer)"))
def test_a_lost_host_ends_the_job_within_the_bound_naming_its_rank_and_the_job_resumes(hosts, tmp_path):
    lines = commands(hosts, 1, tmp_path, "stall")
    began = time.time()
    running = start(hosts, lines)
    marker = os.path.join(str(tmp_path), "stalled-rank1")
    deadline = time.time() + 300
    while not os.path.exists(marker):  # rank 1 sits mid-epoch 2, rank 0 waits for it in a collective
        assert time.time() < deadline and running[0].poll() is None, finish(running, 5)
        time.sleep(0.2)
    lost = time.time()
    print("rank 1 stalled {:.1f} s after the start".format(lost - began))
    hosts.lose(1)
    code, out, err = finish({0: running[0]}, timeout=120)[0]
    elapsed = time.time() - lost
    print("host 1 lost: host 0's launcher exited {:.1f} s later".format(elapsed))
    running[1].wait(10)
    assert code != 0
    # Named by host 0's launcher, or first by the engine's own failure detector where it has a faster one
    # (TensorFlow's and JAX's coordination service: "tasks are unhealthy (stopped sending heartbeats): .../task:1",
    # JAX naming the task by its number alone).
    named = [r"node rank 1 \({}, rank 1\) is lost".format(re.escape(hosts.addresses[1])),
             r"unhealthy \(stopped sending heartbeats\):\s*(\[rank \d+\] )?(/job:worker/replica:0/task:)?1\b"]
    assert re.search("|".join(named), err + out), err[-3000:] + out[-3000:]  # the engine's words: a worker's, on stdout
    assert elapsed <= 45 and elapsed <= PEER_TIMEOUT + STOP_TIMEOUT + 5, err[-3000:]
    assert os.path.exists(os.path.join(str(tmp_path), "ckpt", "checkpoint.json"))
    hosts.reconnect(1)
    again = time.time()
    results = finish(start(hosts, commands(hosts, 1, tmp_path, "resume")))
    print("resumed job ran {:.1f} s".format(time.time() - again))
    for i, (code, _out, err) in results.items():
        assert code == 0, "host {}:\n{}".format(i, err[-4000:])
    assert "[rank 0] Epoch 3/4" in results[0][1] and "Epoch 1/4" not in results[0][1]
    assert_close(single_process_weights(), rank_weights(tmp_path, 0))
    assert_close(rank_weights(tmp_path, 0), rank_weights(tmp_path, 1))


@pytest.mark.skipif(not FULL and BACKEND != "torch", reason=(
    "full run only (DISTKERAS_FULL_TESTS=1): the launchers' part is backend-neutral (tests/core/test_rendezvous.py), "
    "each engine's ending on a killed worker is test_multiworker's, and a lost host's is the test above; the default "
    "run keeps this one on PyTorch"))
def test_a_worker_dying_on_one_host_ends_the_other_host_naming_it(hosts, tmp_path):
    results = finish(start(hosts, commands(hosts, 1, tmp_path, "kill")), timeout=300)
    assert results[1][0] == 128 + 9 and "rank 1 died (killed by SIGKILL)" in results[1][2]
    assert results[0][0] == 1, results[0][2][-3000:]
    assert "rank 1 on node rank 1 ({}) died (killed by SIGKILL)".format(hosts.addresses[1]) in results[0][2]


def _fails_early(results, host, *messages):
    code, out, err = results[host]
    assert code == 2, "host {} exited {}:\n{}".format(host, code, err[-3000:])
    assert "[rank" not in out + err, "a worker started on host {}:\n{}".format(host, err[-3000:])
    for message in messages:
        assert message in err, err[-3000:]


def with_options(line, *options):
    """``line`` (python -m distkeras launch ...) with ``options`` right after ``launch``."""
    return line[:4] + list(options) + line[4:]


def alone(hosts, host, line):
    return finish({host: hosts.popen(host, line, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     env=environment())}, timeout=60)


def test_bad_setups_fail_before_any_worker_starts(hosts, tmp_path):
    lines = commands(hosts, 1, tmp_path, "train")
    # Nobody listens at the coordinator: host 1 alone.
    results = alone(hosts, 1, with_options(lines[1], "--join-timeout", "3"))
    _fails_early(results, 1, "No launcher of node rank 0 answered at {}:{} within 3 s (Connection refused)".format(
        hosts.addresses[0], PORT))
    # A wrong --nnodes on one host: both hosts say what disagrees.
    wrong = [w if w != "2" or lines[1][i - 1] != "--nnodes" else "3" for i, w in enumerate(lines[1])]
    results = finish(start(hosts, [lines[0], wrong]), timeout=120)
    for host in (0, 1):
        _fails_early(results, host, "node rank 1 ({}) was given --nnodes 3, node rank 0 was given 2".format(
            hosts.addresses[1]))
    # --hosts in the wrong order: this host's entry is not one of its addresses.
    results = alone(hosts, 1, with_options(lines[1], "--hosts", "{},{}".format(hosts.addresses[1], hosts.addresses[0])))
    _fails_early(results, 1, "--hosts names '{}' for node rank 1 (this host), and that is not an address of this "
                 "host".format(hosts.addresses[0]))
    # A coordinator no route leads to (nothing is sent: the kernel has no route for it).
    results = alone(hosts, 1, [w.replace(hosts.addresses[0], "10.99.0.1") for w in lines[1]])
    _fails_early(results, 1, "No interface of this host reaches the coordinator 10.99.0.1 (Network is unreachable)")
    # Node rank 0 given a coordinator that is not its own address.
    results = alone(hosts, 0, [w.replace(hosts.addresses[0], hosts.addresses[1]) for w in lines[0]])
    _fails_early(results, 0, "Node rank 0 runs the coordinator, and --coordinator {}:{} is not an address of this "
                 "host".format(hosts.addresses[1], PORT))
    # An interface this host doesn't have.
    results = alone(hosts, 1, with_options(lines[1], "--interface", "eth9"))
    _fails_early(results, 1, "Expected --interface to name an interface of this host or one of its addresses. "
                 "Received: --interface='eth9'. This host has: eth0 ({}".format(hosts.addresses[1]))
