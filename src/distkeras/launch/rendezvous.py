"""How the launchers of a multi-host job find each other, agree, and watch each other.

``distkeras launch`` on node rank 0 listens at the coordinator address (``--coordinator HOST:PORT``); the
launcher of every other host connects there before it starts any worker and says what it was told
(``--nnodes``, ``--nproc-per-node``, the backend, ``--hosts``) and which of its addresses reaches the
coordinator. Node 0 checks that every host agrees and answers all of them at once with the job's plan
(every host's address, which TensorFlow's TF_CONFIG needs); a disagreement, a host that doesn't come or a
coordinator nobody listens on ends every launcher with a message saying which, before training starts. While
node 0 waits, the hosts that joined beat and are read, so a late host is waited for, a host whose launcher dies
frees its slot and a restarted one takes it again (:func:`gather`).
The engines (torch.distributed, jax.distributed, TensorFlow's collectives) then form the job themselves,
on the ports after PORT; nothing of the training goes through here.

The connections stay open for the whole job, carrying a heartbeat each second and the launchers' news:
when a worker dies its launcher tells node 0, which tells every host; when a host goes silent for
``peer_timeout`` seconds (a machine that lost power or network says nothing) or closes its connection
before its workers finished, the other hosts learn it within that bound. Either way every launcher stops
its workers and exits naming the lost rank, whatever the engines would have waited for: this is
torchrun's agent idea (a rendezvous plus keep-alives), not a communication engine.

**Trust.** The coordinator port is reachable by whoever reaches the host, so nothing that arrives there is
trusted (docs/guide/security.md has the threat model):

- *Authentication.* With a per-job secret (``--token-file``, :data:`TOKEN_FILE_ENV` or :data:`TOKEN_ENV`;
  :func:`secret`), every connection starts with a challenge: node 0 sends a fresh random nonce, the host
  answers with its hello, a nonce of its own and an HMAC-SHA256 over both nonces and the hello; from then
  on every message in either direction carries a sequence number and an HMAC over the session's two nonces,
  its direction, its number and its content. A peer that doesn't know the secret can't join (its hello
  fails), can't read the plan (it is only sent after a good hello), can't end the job (a forged
  ``failed``/``abort`` fails its HMAC) and can't take a real host's slot; a message replayed from another
  session or out of order fails too (new nonces, the next number only), so no clock is involved. Each side
  proves itself to the other: a host believes a plan only with node 0's HMAC. It is Horovod's idea
  (``horovodrun`` signs its driver/task messages with a per-run key), with challenge nonces instead of
  timestamps. It protects integrity and membership, not secrecy: the plan (the hosts' addresses) travels
  in the clear.
- *Without a secret* anyone who reaches the port can join in a free slot as in PyTorch's TCPStore; a job
  whose coordinator isn't a loopback address says so once (:func:`warn_unauthenticated`).
- *Shape and size.* Every line is bounded (:data:`MAX_LINE`), parsed once, and checked field by field
  against the one shape each message may have; anything else closes that connection with a log line and
  nothing more. Node 0 keeps at most :data:`MAX_PENDING` connections that haven't said a good hello, each
  for :data:`HELLO_TIMEOUT` seconds at most, drops the oldest beyond that, survives running out of file
  descriptors, and waits with :mod:`selectors` (no ``select()`` limit of 1024 descriptors).

Messages are JSON lines over TCP. Standard library only; part of the Python 3.6-compatible core.
"""

import os
import selectors
import socket
import sys
import time
from typing import Dict, List, Optional

from ..errors import LaunchError
from .wire import (MAX_LINE, MAX_TEXT, Link, check_hello, check_news, check_plan, hello,  # noqa: F401 - public here too
                   _PROTOCOL, _canonical, _hello_problem, _is_nonce, _mac, _nonce)

#: Seconds of silence after which a host counts as lost (heartbeats go out every second).
DEFAULT_PEER_TIMEOUT = 15.0
#: Seconds the launchers wait for each other at the start (hosts are seldom started at the same moment).
DEFAULT_JOIN_TIMEOUT = 120.0
PEER_TIMEOUT_ENV = "DISTKERAS_PEER_TIMEOUT"
JOIN_TIMEOUT_ENV = "DISTKERAS_JOIN_TIMEOUT"
#: A file holding the job's secret (what ``--token-file`` names), the same file content on every host.
TOKEN_FILE_ENV = "DISTKERAS_TOKEN_FILE"
#: The job's secret itself (a file is better: other users of a host can't read a file of mode 600).
TOKEN_ENV = "DISTKERAS_TOKEN"
#: Node 0's bound on connections that haven't said a good hello yet (beyond it, the oldest is dropped).
MAX_PENDING = 32
#: Seconds a new connection has to say a good hello.
HELLO_TIMEOUT = 10.0
#: Seconds a joined host may be silent (it beats every second) before a host saying it has that node rank takes its
#: slot: the old link is a dead launcher's (a machine that restarted says nothing on its old connection).
STALE = 3.0
_BEAT = 1.0
def peer_timeout(environ: Optional[Dict[str, str]] = None) -> float:
    """The bound on noticing a lost host or process: DISTKERAS_PEER_TIMEOUT seconds, else the default.
    Engines with a failure detector of their own (jax.distributed's heartbeats) get it too."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get(PEER_TIMEOUT_ENV, "") or DEFAULT_PEER_TIMEOUT)
    except ValueError:
        return DEFAULT_PEER_TIMEOUT
    return value if value > 0 else DEFAULT_PEER_TIMEOUT


def secret(token_file: Optional[str] = None, environ: Optional[Dict[str, str]] = None) -> Optional[bytes]:
    """The job's secret: the content of ``token_file`` (``--token-file``), else of the file
    :data:`TOKEN_FILE_ENV` names, else :data:`TOKEN_ENV`'s value; surrounding whitespace is dropped. None when
    none is given.

    Raises:
        LaunchError: the file can't be read, or the secret is empty or shorter than 16 bytes.
    """
    env = os.environ if environ is None else environ
    where = None
    if token_file is None and env.get(TOKEN_FILE_ENV):
        token_file, where = env[TOKEN_FILE_ENV], TOKEN_FILE_ENV
    if token_file is not None:
        where = where or "--token-file"
        try:
            with open(token_file, "rb") as f:
                value = f.read(65536).strip()
                mode = os.fstat(f.fileno()).st_mode
        except OSError as exc:
            raise LaunchError("Can't read the job's secret from {} {} ({}). Give every host the same file, e.g. made "
                              "once with `python -c \"import secrets; print(secrets.token_hex(32))\" > {}`.".format(
                                  where, token_file, exc.strerror or exc, token_file))
        source = "{} {}".format(where, token_file)
        if mode & 0o077 and token_file not in _readable_warned:
            _readable_warned.append(token_file)
            _log("warning: the job's secret in {} can be read by other users of this host (mode {:03o}); anyone who "
                 "reads it can join this job. `chmod 600 {}` on every host.".format(token_file, mode & 0o777,
                                                                                  token_file))
    elif env.get(TOKEN_ENV):
        value, source = env[TOKEN_ENV].strip().encode(), TOKEN_ENV
    else:
        return None
    if len(value) < 16:
        raise LaunchError("Expected the job's secret in {} to be at least 16 bytes (e.g. 64 hex digits from "
                          "`python -c \"import secrets; print(secrets.token_hex(32))\"`). Received: {} byte(s)".format(
                              source, len(value)))
    return value


_warned = []
_readable_warned = []  # the token files said to be readable by others, once each


def warn_unauthenticated(coordinator: str, host: str, say) -> None:
    """Say once that a job whose launchers meet on a non-loopback address has no secret, and what that
    means. ``say`` prints a line."""
    if _is_loopback(host) or _warned:
        return
    _warned.append(coordinator)
    say("warning: the launchers meet at {} without a secret, so anyone who can reach that port can join this "
        "job as a host and get its plan. Give every host the same --token-file (or {}) to authenticate them; "
        "docs: guide/security.".format(coordinator, TOKEN_FILE_ENV))


def _is_loopback(host):
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1" for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, UnicodeError):
        return False


def _log(message):
    sys.stderr.write("distkeras launch: {}\n".format(message))
    sys.stderr.flush()


class _Refusals(object):
    """Log lines about refused connections, bounded: the first ten, then every hundredth."""

    def __init__(self):
        self.count = 0

    def __call__(self, peer, why):
        self.count += 1
        if self.count <= 10 or self.count % 100 == 0:
            _log("closed the connection from {}: {}{}".format(
                peer, why, "" if self.count <= 10 else " ({} connections refused so far)".format(self.count)))


def _ranks(node, nproc):
    first = node * nproc
    return "rank {}".format(first) if nproc == 1 else "ranks {}-{}".format(first, first + nproc - 1)


def _disagreement(mine: Dict[str, object], theirs: Dict[str, object]) -> Optional[str]:
    for key, option in (("nnodes", "--nnodes"), ("nproc_per_node", "--nproc-per-node"), ("backend", "the backend"),
                        ("hosts", "--hosts"), ("protocol", "the distkeras version")):
        if mine.get(key) != theirs.get(key):
            return ("node rank {} ({}) was given {} {}, node rank 0 was given {}: every host must be started with "
                    "the same {}.".format(theirs.get("node_rank"), theirs.get("address"), option,
                                          _show(theirs.get(key)), _show(mine.get(key)), option))
    return None


def _show(value):
    if value is None:
        return "nothing"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


class Supervisor(object):
    """One launcher's side of the job: node 0 holds a link to every other host, the others one to node 0.

    Build it with :func:`gather` (node 0) or :func:`join` (the others). ``plan`` is the job as node 0
    announced it: ``{"addresses": [every node's address, by node rank]}``.
    """

    def __init__(self, me, links, plan, peer_timeout, coordinator):
        self.me: Dict[str, object] = me
        self.links: List[Link] = links
        self.plan: Dict[str, object] = plan
        self.peer_timeout = peer_timeout
        self.coordinator = coordinator
        self.verdict: Optional[str] = None
        self.ended = False

    @property
    def node_rank(self):
        return int(self.me["node_rank"])

    def _nproc(self):
        return int(self.me["nproc_per_node"])

    def _who(self, node):
        addresses = self.plan.get("addresses") or []
        where = addresses[node] if node < len(addresses) else "?"
        return "node rank {} ({}, {})".format(node, where, _ranks(node, self._nproc()))

    def _beat(self):
        now = time.monotonic()
        for link in self.links:
            if not link.closed and now - link.last_sent >= _BEAT:
                link.send({"beat": 1})

    def _broadcast(self, message, but=None):
        for link in self.links:
            if link is not but:
                link.send(message)

    def poll(self) -> Optional[str]:
        """Heartbeats out, news in. Returns why this host's workers must stop (a message), or None."""
        if self.verdict is not None:
            return self.verdict
        self._beat()
        now = time.monotonic()
        for link in self.links:
            for message in link.receive():
                if "failed" in message and self.node_rank == 0:
                    reason = str(message["failed"])
                    if self.node_rank == 0:
                        self._broadcast({"abort": reason}, but=link)
                    self.verdict = reason
                elif "abort" in message:
                    self.verdict = str(message["abort"])
                elif "done" in message:
                    link.done = True
                elif "end" in message:
                    self.ended = True
            if self.verdict is not None:
                return self.verdict
            if link.done or self.ended:
                continue
            node = 0 if link.node is None else link.node
            if link.closed and link.why:
                self._lose("{} broke the launchers' protocol ({}); the job can't go on without it".format(
                    self._who(node), link.why))
            elif link.closed:
                self._lose("{} closed its connection before its workers finished (its launcher died or was "
                           "stopped)".format(self._who(node)))
            elif now - link.last_heard > self.peer_timeout:
                self._lose("{} is lost: no word from its launcher for {:.0f} s (the host or the network between "
                           "is down)".format(self._who(node), now - link.last_heard))
            if self.verdict is not None:
                return self.verdict
        return None

    def _lose(self, reason):
        if self.node_rank == 0:
            self._broadcast({"abort": reason})
        self.verdict = reason

    def failed(self, who: object, how: str) -> None:
        """A process of this host's (``who``: a worker's rank, or a label such as ``"server 1"``) ended
        ``how`` (``"died (exit code 1)"``...): tell every host (through node 0)."""
        reason = "{} on node rank {} ({}) {}".format(
            "rank {}".format(who) if isinstance(who, int) else who, self.node_rank,
            (self.plan.get("addresses") or ["?"] * (self.node_rank + 1))[self.node_rank], how)
        if self.node_rank == 0:
            self._broadcast({"abort": reason})
        else:
            self._broadcast({"failed": reason})
        if self.verdict is None:
            self.verdict = reason

    def finish(self, interval: float = 0.05) -> Optional[str]:
        """This host's workers all succeeded: wait until every host's did. Returns a failure, or None."""
        if self.node_rank != 0:
            self._broadcast({"done": 1})
        while True:
            verdict = self.poll()
            if verdict is not None:
                return verdict
            if self.node_rank == 0 and all(link.done for link in self.links):
                self._broadcast({"end": 1})
                return None
            if self.node_rank != 0 and self.ended:
                return None
            time.sleep(interval)

    def close(self):
        for link in self.links:
            link.close()


def _deadline_message(coordinator, timeout, problem):
    return ("No launcher of node rank 0 answered at {} within {:.0f} s ({}). Start `distkeras launch --node-rank 0 "
            "...` on that host with the same --coordinator, and check the address, the port and that no firewall "
            "blocks it (--join-timeout / {} to wait longer).".format(coordinator, timeout, problem, JOIN_TIMEOUT_ENV))


def _not_node0(coordinator, why):
    return LaunchError(
        "The program answering at {} is not this job's node rank 0: {}. Check --coordinator, that node rank 0 runs "
        "the same distkeras version, and that every host has the same --token-file.".format(coordinator, why))


def _challenge(link, coordinator, key, deadline):
    """Node 0's first line, checked: its nonce."""
    lines: List[object] = []
    while not lines and not link.closed and time.monotonic() < deadline:
        lines = link.receive_raw(wait=min(1.0, max(0.0, deadline - time.monotonic())))
    if link.closed and link.why:
        raise _not_node0(coordinator, "it sent {}".format(link.why))
    if not lines:
        return None
    first = lines[0]
    if (not isinstance(first, dict) or set(first) != {"challenge", "auth", "protocol"}
            or not _is_nonce(first["challenge"]) or not isinstance(first["auth"], bool)):
        raise _not_node0(coordinator, "its first line is not a distkeras launcher's challenge")
    if first["protocol"] != _PROTOCOL:
        raise LaunchError("Node rank 0 at {} speaks launcher protocol {!r}, this host {}: install the same distkeras "
                          "version on every host.".format(coordinator, str(first["protocol"])[:20], _PROTOCOL))
    if first["auth"] and key is None:
        raise LaunchError("Node rank 0 at {} requires the job's secret, and this host was given none: give every host "
                          "the same --token-file (or {}).".format(coordinator, TOKEN_FILE_ENV))
    if not first["auth"] and key is not None:
        raise LaunchError("This host was given a secret (--token-file / {}), and node rank 0 at {} runs without one: "
                          "give every host the same --token-file, or none.".format(TOKEN_FILE_ENV, coordinator))
    return first["challenge"]


def join(coordinator: str,
         me: Dict[str, object],
         join_timeout: float = DEFAULT_JOIN_TIMEOUT,
         peer_timeout: float = DEFAULT_PEER_TIMEOUT,
         source_address: Optional[str] = None,
         key: Optional[bytes] = None) -> Supervisor:
    """Node rank > 0: reach node 0 at ``coordinator``, introduce this host, get the plan.

    With ``key`` (the job's :func:`secret`), this host proves it knows it and believes only a plan signed with
    it. A connection node 0 drops before its answer (it drops the oldest of too many new connections) is
    made again until ``join_timeout``.

    Raises:
        LaunchError: nobody answered within ``join_timeout``, node 0 refused this host (it says why), or what
            answered is not this job's node 0 (another program, another version, another secret).
    """
    from .network import parse_address

    host, port = parse_address(coordinator)
    deadline = time.monotonic() + join_timeout
    problem = "nothing answered"
    answered = False
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic())),
                                            source_address=(source_address, 0) if source_address else None)
        except OSError as exc:
            problem = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            time.sleep(0.5)
            continue
        link = Link(sock, coordinator)
        link.node = 0
        try:
            challenge = _challenge(link, coordinator, key, min(deadline, time.monotonic() + HELLO_TIMEOUT))
            if challenge is None:
                problem = "it accepted the connection but sent no challenge"
                link.close()
                continue
            answered = True
            nonce = _nonce()
            line = {"hello": me, "nonce": nonce}  # type: Dict[str, object]
            if key is not None:
                line["mac"] = _mac(key, b"hello", challenge.encode(), nonce.encode(), _canonical(me))
            link.start_session(key, challenge, nonce, node0=False)
            link.send_raw(line)
            while time.monotonic() < deadline and not link.closed:
                if time.monotonic() - link.last_sent >= _BEAT:  # node 0 hears this host while it waits for the rest
                    link.send({"beat": 1})
                if time.monotonic() - link.last_heard > peer_timeout:
                    link.fail("no word from node rank 0 for {:.0f} s".format(time.monotonic() - link.last_heard))
                    break
                for message in link.receive(wait=min(_BEAT, max(0.0, deadline - time.monotonic()))):
                    if "error" in message:
                        raise LaunchError(str(message["error"]))
                    if "plan" in message:
                        why = check_plan(message["plan"], int(me["nnodes"]))  # type: ignore
                        if why is not None:
                            raise _not_node0(coordinator, why)
                        return Supervisor(me, [link], dict(message["plan"]), peer_timeout, coordinator)  # type: ignore
            if link.why and link.why.startswith("no word from node rank 0"):
                _log("{} at {}; joining again".format(link.why, coordinator))
                link.close()
                continue
            if link.why:
                raise _not_node0(coordinator, "it sent {}".format(link.why))
        except BaseException:
            link.close()
            raise
        link.close()
        if time.monotonic() < deadline:
            _log("node rank 0 at {} closed this host's connection before the job started; joining again".format(
                coordinator))
            time.sleep(0.5)
    if not answered:
        raise LaunchError(_deadline_message(coordinator, join_timeout, problem))
    raise LaunchError(
        "Node rank 0 at {} took this host in but did not start the job within {:.0f} s: not every host of the "
        "job joined. Start every host's `distkeras launch` (node ranks 0..{}) with the same options.".format(
            coordinator, join_timeout, int(me["nnodes"]) - 1))  # type: ignore


def gather(listener: socket.socket,
           me: Dict[str, object],
           join_timeout: float = DEFAULT_JOIN_TIMEOUT,
           peer_timeout: float = DEFAULT_PEER_TIMEOUT,
           key: Optional[bytes] = None) -> Supervisor:
    """Node rank 0: wait on ``listener`` for every other host, check that they agree, send the plan.

    Hosts come as they really do: one at a time, minutes apart, some twice. While node 0 waits for the rest, every
    host that joined keeps its link read and beating, so a host that joined early is not taken for lost once the
    last one comes; a host that leaves (its launcher died: the link closed, or silent for ``peer_timeout``) frees
    its slot, and the same host started again takes it. A hello for a node rank a live host holds is refused on its
    own link, the job goes on (a restarted host whose old link has been silent for :data:`STALE` seconds takes the
    slot over). With ``key`` (the job's :func:`secret`) only hosts that prove they know it count; without one,
    anyone who reaches the port can take a free slot, or a stale one (docs/guide/security.md). A connection that
    breaks the protocol is closed with a log line and changes nothing else.

    Raises:
        LaunchError: a host disagrees (every host is told why), or not all came within ``join_timeout``.
    """
    nnodes = int(me["nnodes"])  # type: ignore
    coordinator = "{}:{}".format(*listener.getsockname()[:2])
    deadline = time.monotonic() + join_timeout
    pending: List[Link] = []
    joined: Dict[int, Link] = {}
    addresses = {0: str(me["address"])}
    refused = _Refusals()
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ, None)

    def unregister(link):
        try:
            selector.unregister(link.sock)
        except (KeyError, ValueError, OSError):
            pass

    def drop(link, why=None):
        if link in pending:
            pending.remove(link)
        unregister(link)
        if why is not None:
            link.fail(why)
        link.close()
        if link.why:
            refused(link.name, link.why)

    def leave(node, why):
        """A joined host is gone before the job formed: free its slot for the host to come again."""
        link = joined.pop(node)
        unregister(link)
        link.close()
        _log("node rank {} ({}) left before the job formed ({}); its slot is open again".format(
            node, addresses.pop(node), why))

    def refuse(message, also=()):
        for link in list(joined.values()) + list(also):
            link.send({"error": message})
            link.close()
        for link in list(pending):
            drop(link)
        selector.close()
        listener.close()
        raise LaunchError(message)

    def accept():
        for _ in range(16):  # a few at a time: the pending hellos are read in between
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE/ENFILE (out of descriptors), ECONNABORTED, ENOBUFS...
                refused("the coordinator port", "accept() failed ({}); dropping the oldest new connection".format(
                    exc.strerror or exc))
                if pending:
                    drop(pending[0], "too many connections at once")
                time.sleep(0.05)
                return
            link = Link(sock, "{}:{}".format(*peer[:2]))
            link.challenge = _nonce()
            if not link.send_raw({"challenge": link.challenge, "auth": key is not None, "protocol": _PROTOCOL}):
                continue
            try:
                selector.register(sock, selectors.EVENT_READ, link)
            except (ValueError, OSError):
                link.close()
                continue
            pending.append(link)
            if len(pending) > MAX_PENDING + nnodes:
                drop(pending[0], "too many connections at once")

    def greet(link):
        lines = link.receive_raw()
        if link.closed or not lines:
            if link.closed:
                drop(link)
            return
        problem = _hello_problem(lines[0], key, link.challenge)
        if problem == "secret":
            link.start_session(key, link.challenge, lines[0]["nonce"], node0=True)
            link.send({"error": "Node rank 0 at {} refused this host: its hello did not carry the job's secret. Give "
                                "every host the same --token-file.".format(coordinator)})
            drop(link, "it did not prove it knows the job's secret (a host with another --token-file, or a stranger)")
            return
        if problem is not None:
            drop(link, problem)
            return
        if len(lines) > 1:
            drop(link, "it said more than its hello before the job formed")
            return
        theirs = lines[0]["hello"]
        link.start_session(key, link.challenge, lines[0]["nonce"], node0=True)
        node = theirs["node_rank"]
        problem = _disagreement(me, theirs)
        if problem is None and not 0 < node < nnodes:
            problem = "a host ({}) says it is node rank {}, outside 1..{} (--nnodes {}).".format(
                theirs["address"], node, nnodes - 1, nnodes)
        if problem is not None:
            pending.remove(link)
            unregister(link)
            refuse(problem, also=[link])
        if node in joined:
            listen(joined[node])  # its news first: a restarted host's old link may have just closed
        holder = joined.get(node)
        if holder is not None:
            silent = time.monotonic() - holder.last_heard
            if silent <= STALE:
                message = ("Node rank 0 at {} refused this host: node rank {} is taken by a live host ({}). Give each "
                           "host its own --node-rank.".format(coordinator, node, addresses[node]))
                link.send({"error": message})
                drop(link, "it says it is node rank {}, which a live host ({}) holds".format(node, addresses[node]))
                return
            leave(node, "silent for {:.0f} s, and a host saying it is node rank {} came ({})".format(
                silent, node, theirs["address"]))
        pending.remove(link)
        link.node = node
        link.last_heard = time.monotonic()
        joined[node] = link
        addresses[node] = theirs["address"]

    def listen(link):
        """A joined host's link while the others come: beats (anything else before the plan breaks the protocol)."""
        for message in link.receive():
            if "beat" not in message:
                link.fail("a message of kind {!r} before the job formed".format(sorted(message)[0]))
        if link.closed:
            leave(link.node, "it broke the launchers' protocol: {}".format(link.why) if link.why
                  else "its connection closed: its launcher died or was stopped")

    try:
        while len(joined) < nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [n for n in range(1, nnodes) if n not in joined]
                refuse("{} of the {} hosts joined node rank 0 at {} within {:.0f} s; missing node rank(s) {}. Start "
                       "`distkeras launch --node-rank N` on every host with --coordinator {} (--join-timeout / {} to "
                       "wait longer), the same --token-file on every host, or give every host the real "
                       "--nnodes.".format(len(joined) + 1, nnodes, coordinator, join_timeout,
                                          ", ".join(map(str, missing)), coordinator, JOIN_TIMEOUT_ENV))
            events = selector.select(timeout=min(0.5, left))
            for ready, _ in events:  # the joined hosts and the hellos first, then new connections
                if ready.data is not None and ready.data.node is not None and joined.get(ready.data.node) is ready.data:
                    listen(ready.data)
                elif ready.data is not None and ready.data in pending:
                    greet(ready.data)
            if any(ready.data is None for ready, _ in events):
                accept()
            now = time.monotonic()
            for link in [link for link in pending if now - link.opened > HELLO_TIMEOUT]:
                drop(link, "no hello within {:.0f} s".format(HELLO_TIMEOUT))
            for node, link in sorted(joined.items()):
                if now - link.last_heard > peer_timeout:
                    leave(node, "no word from its launcher for {:.0f} s".format(now - link.last_heard))
                elif now - link.last_sent >= _BEAT:
                    link.send({"beat": 1})
    finally:
        for link in list(pending):
            drop(link)
        selector.close()
        listener.close()
    plan = {"addresses": [addresses[n] for n in range(nnodes)]}
    links = [joined[n] for n in sorted(joined)]
    for link in links:
        link.send({"plan": plan})
    return Supervisor(me, links, plan, peer_timeout, coordinator)
