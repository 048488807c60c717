"""The launchers' rendezvous trusts nobody (loopback only, bounded in count and time): a stranger without the
job's secret can't join, read the plan, end the job or take a real host's slot; garbage, truncated, oversized,
deeply nested, replayed and forged lines close only their own connection, at node 0 and at a joining host;
descriptors beyond 1024 and running out of descriptors don't crash node 0. Real sockets, real threads; the
whole-launcher version (`distkeras launch --token-file`) at the end."""

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from distkeras.launch import command as launch, rendezvous, wire
from distkeras.errors import LaunchError
from tests.core.test_rendezvous import WORKER, two_hosts
from tests.core.test_launch import SRC, distkeras_launch, finish

KEY = b"0123456789abcdef0123456789abcdef"


def me(node, nnodes=2, address="127.0.0.1"):
    return rendezvous.hello(node, nnodes, 1, "torch", None, address)


def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


class Node0(threading.Thread):
    """``gather`` in a thread: its Supervisor, or the exception it raised."""

    def __init__(self, nnodes=2, key=KEY, timeout=30.0):
        super().__init__(daemon=True)
        self.sock = listener()
        self.coordinator = "127.0.0.1:{}".format(self.sock.getsockname()[1])
        self.nnodes, self.key, self.timeout = nnodes, key, timeout
        self.result = None

    def run(self):
        try:
            self.result = rendezvous.gather(self.sock, me(0, self.nnodes), self.timeout, 15.0, key=self.key)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.result = exc

    def outcome(self, timeout=40):
        self.join(timeout)
        assert not self.is_alive(), "node 0 never finished gathering"
        return self.result


def joiner(coordinator, node, nnodes=2, key=KEY, timeout=20.0, address="127.0.0.1"):
    box = {}

    def run():
        try:
            box["result"] = rendezvous.join(coordinator, me(node, nnodes, address), timeout, 15.0, key=key)
        except BaseException as exc:  # noqa: BLE001
            box["result"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def connect(coordinator):
    host, port = coordinator.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.settimeout(5)
    return sock


def read_line(sock):
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def read_all(sock, timeout=3.0):
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def signed_hello(challenge, hello, key=KEY, nonce="ab" * 16):
    return {"hello": hello, "nonce": nonce,
            "mac": wire._mac(key, b"hello", challenge.encode(), nonce.encode(), wire._canonical(hello))}


def finish_job(node0, *joiners):
    sup0 = node0.outcome()
    assert isinstance(sup0, rendezvous.Supervisor), sup0
    plans = []
    for thread, box in joiners:
        thread.join(30)
        assert isinstance(box.get("result"), rendezvous.Supervisor), box.get("result")
        plans.append(box["result"].plan)
        box["result"].close()
    sup0.close()
    return sup0.plan, plans


def test_a_stranger_without_the_secret_cannot_join_read_the_plan_or_take_the_slot():
    node0 = Node0()
    node0.start()
    stranger = connect(node0.coordinator)
    challenge = json.loads(read_line(stranger))
    assert challenge["auth"] is True and set(challenge) == {"challenge", "auth", "protocol"}
    forged = signed_hello(challenge["challenge"], me(1, address="10.66.0.9"), key=b"not the job's secret, a guess!")
    stranger.sendall(json.dumps(forged).encode() + b"\n")
    answer = read_all(stranger)
    assert b"addresses" not in answer and b"10.66" not in answer and b"refused this host" in answer
    # The real node 1 then joins and gets the plan, with its own address, not the stranger's.
    real = joiner(node0.coordinator, 1, address="127.0.0.2")
    plan0, (plan1,) = finish_job(node0, real)
    assert plan0 == plan1 == {"addresses": ["127.0.0.1", "127.0.0.2"]}


def test_a_replayed_hello_from_another_session_is_refused():
    node0 = Node0()
    node0.start()
    first = connect(node0.coordinator)
    old = json.loads(read_line(first))["challenge"]
    first.close()
    stranger = connect(node0.coordinator)
    read_line(stranger)  # a new challenge: the hello signed for the old one is worthless
    stranger.sendall(json.dumps(signed_hello(old, me(1))).encode() + b"\n")
    assert b"addresses" not in read_all(stranger)
    plan0, _ = finish_job(node0, joiner(node0.coordinator, 1))
    assert plan0 == {"addresses": ["127.0.0.1", "127.0.0.1"]}


def test_a_host_with_another_secret_or_none_is_told_why_and_the_job_goes_on():
    node0 = Node0()
    node0.start()
    for key, expected in ((b"another secret, 32 bytes long!!!", "is not this job's node rank 0"),
                          (None, "requires the job's secret, and this host was given none")):
        thread, box = joiner(node0.coordinator, 1, key=key, timeout=10)
        thread.join(15)
        assert isinstance(box["result"], LaunchError) and expected in str(box["result"]), box["result"]
    plan0, _ = finish_job(node0, joiner(node0.coordinator, 1))
    assert plan0["addresses"] == ["127.0.0.1", "127.0.0.1"]
    unkeyed = Node0(key=None)
    unkeyed.start()
    thread, box = joiner(unkeyed.coordinator, 1, key=KEY, timeout=10)
    thread.join(15)
    assert "node rank 0 at {} runs without one".format(unkeyed.coordinator) in str(box["result"])
    finish_job(unkeyed, joiner(unkeyed.coordinator, 1, key=None))


def session_pair(key=KEY):
    a, b = socket.socketpair()
    node0, host = rendezvous.Link(a, "a"), rendezvous.Link(b, "b")
    node0.start_session(key, "cd" * 16, "ef" * 16, node0=True)
    host.start_session(key, "cd" * 16, "ef" * 16, node0=False)
    return node0, host


def test_forged_replayed_and_reflected_messages_on_a_session_close_it_without_effect():
    node0, host = session_pair()
    host.send({"failed": "rank 1 died"})
    assert node0.receive(wait=2) == [{"failed": "rank 1 died"}]
    # Replayed: the same line again.
    line = {"m": {"failed": "rank 1 died"}, "s": 0,
            "mac": wire._mac(KEY, host.session, b"n>0", b"0", wire._canonical({"failed": "rank 1 died"}))}
    host.send_raw(line)
    assert node0.receive(wait=2) == [] and node0.closed and "replayed" in node0.why
    # Forged: the right number, no key.
    node0, host = session_pair()
    host.send_raw({"m": {"abort": "stop"}, "s": 0, "mac": "00" * 32})
    assert node0.receive(wait=2) == [] and "signature" in node0.why
    # Reflected: node 0's own signed message sent back to it (the direction is part of what is signed).
    node0, host = session_pair()
    node0.send({"abort": "x"})
    reflected = host.receive_raw(wait=2)[0]
    host.send_raw(reflected)
    assert node0.receive(wait=2) == [] and "signature" in node0.why


GARBAGE = [b"5\n", b'"hello"\n', b'{"hello":5}\n', b"[" * 100000 + b"\n", b'{"a":' * 5000 + b"\n",
           b"\xff\xfe\x00garbage\n", b'{"hello": {"node_rank": 1}}\n', b"null\n", b"[]\n", b"{}\n",
           b'{"hello": {"node_rank": 1, "nnodes": 2}, "nonce": "x"}\n', b"x" * (2 * 1024 * 1024),
           b'{"hello": ' + json.dumps(me(1)).encode() + b', "nonce": "' + b"ab" * 16 + b'"}\n',  # no mac
           b'{"m": {"failed": "you lose"}, "s": 0}\n', b'{"hello":', b"", b"\n\n\n"] + [
    json.dumps(line).encode() + b"\n" for line in (  # non-ASCII and wrong-type fields
        {"hello": me(1, 3), "nonce": "ab" * 16, "mac": "\u00e9" * 64}, {"hello": me(1, 3), "nonce": "ab" * 16, "mac": 7},
        {"hello": me(1, 3), "nonce": "\u00e9" * 32}, {"hello": dict(me(1, 3), node_rank=True), "nonce": "ab" * 16},
        {"hello": dict(me(1, 3), address="\u00e9\u0000"), "nonce": "ab" * 16},
        {"hello": dict(me(1, 3), hosts="127.0.0.1"), "nonce": "ab" * 16}, {"hello": me(1, 3), "nonce": None})]


def throw(coordinator, payload, seed):
    try:
        sock = connect(coordinator)
        challenge = read_line(sock)
        if seed % 3 == 0 and challenge:  # a hello well formed, signed for this challenge with a wrong key
            text = json.loads(challenge)["challenge"]
            payload = json.dumps(signed_hello(text, me(1), key=b"guessed key guessed key guessed!")).encode() + b"\n"
        sock.sendall(payload)
        if seed % 4 == 0:
            sock.shutdown(socket.SHUT_WR)  # truncated: the line never ends
        answer = read_all(sock, timeout=1.0)
        sock.close()
        return answer
    except OSError:
        return b""


def test_fuzz_garbage_at_node0_during_a_live_rendezvous_the_job_forms_with_the_right_members():
    started = time.monotonic()
    node0 = Node0(nnodes=3)
    node0.start()
    answers = []
    silent = [connect(node0.coordinator) for _ in range(40)]  # slow connections that never say a word
    rng = random.Random(0)
    payloads = GARBAGE * 6 + [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000))) for _ in range(40)]
    rng.shuffle(payloads)
    attackers = [threading.Thread(target=lambda i=i, p=p: answers.append(throw(node0.coordinator, p, i)), daemon=True)
                 for i, p in enumerate(payloads)]
    for thread in attackers[:-20]:
        thread.start()
    for thread in attackers[:-20]:  # all thrown and answered (or dropped) before the real hosts come
        thread.join(20)
    assert node0.is_alive() and len(answers) == len(attackers) - 20
    real = [joiner(node0.coordinator, 1, 3, address="127.0.0.2")]
    for thread in attackers[-20:]:  # and some while they join
        thread.start()
    real.append(joiner(node0.coordinator, 2, 3, address="127.0.0.3"))
    plan0, plans = finish_job(node0, *real)
    assert plan0 == {"addresses": ["127.0.0.1", "127.0.0.2", "127.0.0.3"]} and plans == [plan0, plan0]
    for thread in attackers:
        thread.join(10)
    assert not any(b"addresses" in answer for answer in answers)
    for sock in silent:
        sock.close()
    assert time.monotonic() - started < 60


FAKE_ANSWERS = {
    "a number": [b"5\n"],
    "no challenge, a plan": [b'{"plan": 5}\n'],
    "an empty plan": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": false, "protocol": 2}\n', b'{"m": {"plan": {}}, "s": 0}\n'],
    "a plan of the wrong size": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": false, "protocol": 2}\n',
                                 b'{"m": {"plan": {"addresses": ["1.2.3.4"]}}, "s": 0}\n'],
    "an unsigned plan to a keyed host": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": true, "protocol": 2}\n',
                                         b'{"m": {"plan": {"addresses": ["1.2.3.4", "5.6.7.8"]}}, "s": 0}\n'],
    "deep nesting": [b"[" * 100000 + b"\n"],
    "an endless line": [b"x" * (1024 * 1024)],
    "an old protocol": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": true, "protocol": 1}\n'],
    "a non-ASCII signature on the plan": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": true, "protocol": 2}\n',
                                          json.dumps({"m": {"plan": {"addresses": ["1.2.3.4", "5.6.7.8"]}}, "s": 0,
                                                      "mac": "\u00e9" * 64}).encode() + b"\n"],
    "a signature that is a number": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": true, "protocol": 2}\n',
                                     b'{"m": {"beat": 1}, "s": 0, "mac": 5}\n'],
    "a non-ASCII challenge": [json.dumps({"challenge": "\u00e9" * 32, "auth": True, "protocol": 2}).encode() + b"\n"],
    "a protocol as text, auth as text": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": "yes", "protocol": "2"}\n'],
    "a plan of non-ASCII addresses": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": false, "protocol": 2}\n',
                                      json.dumps({"m": {"plan": {"addresses": ["h\u00f4te", "1.2.3.4"]}},
                                                  "s": 0}).encode() + b"\n"],
    "an error with escape sequences": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": false, "protocol": 2}\n',
                                       json.dumps({"m": {"error": "\u001b[2J gone"}, "s": 0}).encode() + b"\n"],
    "a number that is a float": [b'{"challenge": "' + b"ab" * 16 + b'", "auth": false, "protocol": 2}\n',
                                 b'{"m": {"beat": 1}, "s": 0.0}\n', b'{"m": {"plan": {}}, "s": 1}\n'],
}


@pytest.mark.parametrize("name", sorted(FAKE_ANSWERS))
def test_a_fake_coordinator_gets_a_clear_error_never_a_crash(name):
    server = listener()
    coordinator = "127.0.0.1:{}".format(server.getsockname()[1])

    def serve():
        sock, _ = server.accept()
        for chunk in FAKE_ANSWERS[name]:
            sock.sendall(chunk)
            time.sleep(0.2)
        time.sleep(3)
        sock.close()
    threading.Thread(target=serve, daemon=True).start()
    key = None if b'"auth": false' in b"".join(FAKE_ANSWERS[name]) else KEY
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        rendezvous.join(coordinator, me(1), 8.0, 15.0, key=key)
    assert time.monotonic() - started < 8.5
    assert coordinator in str(caught.value)
    server.close()


MANY_DESCRIPTORS = textwrap.dedent("""
    import os, resource, socket, sys, threading
    sys.path.insert(0, {src!r})
    from distkeras.launch import rendezvous
    limit = int(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(int(sys.argv[2]))]
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(256)
    print(sock.getsockname()[1], flush=True)
    hello = lambda n: rendezvous.hello(n, 2, 1, "torch", None, "127.0.0.1")
    supervisor = rendezvous.gather(sock, hello(0), 30.0, 15.0, key=b"k" * 32)
    print("plan", supervisor.plan, "fd", padding[-1] if padding else None, flush=True)
""")


@pytest.mark.parametrize("limit, padding, flood", [(4096, 1100, 0), (64, 40, 200)],
                         ids=["descriptors beyond 1024", "out of descriptors"])
def test_node0_survives_high_descriptors_and_running_out_of_them(limit, padding, flood):
    node0 = subprocess.Popen([sys.executable, "-c", MANY_DESCRIPTORS.format(src=SRC), str(limit), str(padding)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        coordinator = "127.0.0.1:{}".format(node0.stdout.readline().strip())
        held = []
        for _ in range(flood):
            try:
                held.append(socket.create_connection(("127.0.0.1", int(coordinator.split(":")[1])), timeout=2))
            except OSError:
                break
        real = joiner(coordinator, 1, key=b"k" * 32, timeout=25)
        real[0].join(30)
        for sock in held:
            sock.close()
        out, err = node0.communicate(timeout=30)
    finally:
        node0.kill()
    assert isinstance(real[1]["result"], rendezvous.Supervisor), (real[1]["result"], err)
    assert "plan {'addresses': ['127.0.0.1', '127.0.0.1']}" in out, err
    if padding > 1024:
        assert int(out.split("fd ")[1]) > 1024
    else:
        assert "accept() failed (Too many open files)" in err
    real[1]["result"].close()


def test_launchers_with_one_token_file_run_the_job_and_the_workers_never_see_it(tmp_path):
    token = tmp_path / "job.token"
    token.write_text(os.urandom(32).hex())
    probe = WORKER.replace('print("rank"', 'print("token seen", "DISTKERAS_TOKEN" in str(os.environ)); print("rank"')
    port = launch.free_port()
    common = ["--nproc-per-node", "1", "--nnodes", "2", "--coordinator", "127.0.0.1:{}".format(port),
              "--backend", "torch", "--token-file", str(token)]
    node0 = distkeras_launch(tmp_path, probe, *common, "--node-rank", "0")
    node1 = distkeras_launch(tmp_path, probe, *common, "--node-rank", "1")
    # Two PyTorch workers start here (torch imported in each): on a loaded 2-core host more than a minute.
    (code0, out0, err0), (code1, out1, err1) = finish(node0, timeout=180), finish(node1, timeout=180)
    assert code0 == code1 == 0, err0 + err1
    assert "token seen False" in out0 and "token seen False" in out1 and "token seen True" not in out0 + out1
    # A host with another token is refused, told why, and node 0 waits on for the real one, then gives up cleanly.
    other = tmp_path / "other.token"
    other.write_text(os.urandom(32).hex())
    port = launch.free_port()
    common[5] = "127.0.0.1:{}".format(port)
    node0 = distkeras_launch(tmp_path, WORKER, *common, "--node-rank", "0", "--join-timeout", "6")
    time.sleep(1)
    node1 = distkeras_launch(tmp_path, WORKER, *common[:-1], str(other), "--node-rank", "1", "--join-timeout", "4")
    (code0, out0, err0), (code1, _, err1) = finish(node0), finish(node1)
    assert code1 == 2 and "is not this job's node rank 0" in err1 and "--token-file" in err1
    assert code0 == 2 and "did not prove it knows the job's secret" in err0 and "[rank" not in out0


def test_a_one_host_job_keeps_the_secret_from_its_workers_too(tmp_path):
    token = tmp_path / "job.token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    probe = WORKER.replace('print("rank"', 'print("token seen", "DISTKERAS_TOKEN" in str(os.environ)); print("rank"')
    node = distkeras_launch(tmp_path, probe, "--nproc-per-node", "2", "--backend", "torch",
                            env_extra={"DISTKERAS_TOKEN": "a secret of the job's, 32 bytes",
                                       "DISTKERAS_TOKEN_FILE": str(token)})
    code, out, err = finish(node, timeout=120)
    assert code == 0, err
    assert out.count("token seen False") == 2 and "token seen True" not in out


def test_a_token_file_others_can_read_is_warned_about_once_naming_chmod_600(tmp_path, capsys):
    token = tmp_path / "job.token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o644)
    assert rendezvous.secret(str(token), {}) == token.read_bytes().strip()
    rendezvous.secret(None, {"DISTKERAS_TOKEN_FILE": str(token)})
    err = capsys.readouterr().err
    assert err.count("can be read by other users of this host (mode 644)") == 1
    assert "chmod 600 {}".format(token) in err
    private = tmp_path / "private.token"
    private.write_text(os.urandom(32).hex())
    private.chmod(0o600)
    rendezvous.secret(str(private), {})
    assert "can be read" not in capsys.readouterr().err


def test_a_short_or_missing_token_file_is_a_clear_error(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(LaunchError, match="at least 16 bytes"):
        rendezvous.secret(str(short), {})
    with pytest.raises(LaunchError, match="Can't read the job's secret from --token-file"):
        rendezvous.secret(str(tmp_path / "nope"), {})
    assert rendezvous.secret(None, {"DISTKERAS_TOKEN": "x" * 20}) == b"x" * 20
    assert rendezvous.secret(None, {}) is None


def test_an_unauthenticated_job_across_real_addresses_is_warned_once_and_loopback_is_not():
    said = []
    rendezvous._warned.clear()
    rendezvous.warn_unauthenticated("127.0.0.1:5000", "127.0.0.1", said.append)
    assert said == []
    rendezvous.warn_unauthenticated("10.9.8.7:5000", "10.9.8.7", said.append)
    rendezvous.warn_unauthenticated("10.9.8.7:5000", "10.9.8.7", said.append)
    assert len(said) == 1 and "without a secret" in said[0] and "--token-file" in said[0]
    rendezvous._warned.clear()


def test_two_launchers_without_a_token_on_loopback_still_work(tmp_path):
    node0, node1, _ = two_hosts(tmp_path, "--backend", "torch")
    (code0, _, err0), (code1, _, err1) = finish(node0), finish(node1)
    assert code0 == code1 == 0 and "without a secret" not in err0 + err1
