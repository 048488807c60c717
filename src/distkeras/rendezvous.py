"""How the launchers of a multi-host job find each other, agree, and watch each other.

``distkeras launch`` on node rank 0 listens at the coordinator address (``--coordinator HOST:PORT``); the
launcher of every other host connects there before it starts any worker and says what it was told
(``--nnodes``, ``--nproc-per-node``, the backend, ``--hosts``) and which of its addresses reaches the
coordinator. Node 0 checks that every host agrees and answers all of them at once with the job's plan
(every host's address, which TensorFlow's TF_CONFIG needs); a disagreement, a host that doesn't come or a
coordinator nobody listens on ends every launcher with a message saying which, before training starts.
The engines (torch.distributed, jax.distributed, TensorFlow's collectives) then form the job themselves,
on the ports after PORT; nothing of the training goes through here.

The connections stay open for the whole job, carrying a heartbeat each second and the launchers' news:
when a worker dies its launcher tells node 0, which tells every host; when a host goes silent for
``peer_timeout`` seconds (a machine that lost power or network says nothing) or closes its connection
before its workers finished, the other hosts learn it within that bound. Either way every launcher stops
its workers and exits naming the lost rank, whatever the engines would have waited for: this is
torchrun's agent idea (a rendezvous plus keep-alives), not a communication engine.

Messages are JSON lines over TCP. Standard library only; part of the Python 3.6-compatible core.
"""

import json
import os
import select
import socket
import time
from typing import Dict, List, Optional

from .errors import LaunchError

#: Seconds of silence after which a host counts as lost (heartbeats go out every second).
DEFAULT_PEER_TIMEOUT = 15.0
#: Seconds the launchers wait for each other at the start (hosts are seldom started at the same moment).
DEFAULT_JOIN_TIMEOUT = 120.0
PEER_TIMEOUT_ENV = "DISTKERAS_PEER_TIMEOUT"
JOIN_TIMEOUT_ENV = "DISTKERAS_JOIN_TIMEOUT"
_BEAT = 1.0
_PROTOCOL = 1


def peer_timeout(environ: Optional[Dict[str, str]] = None) -> float:
    """The bound on noticing a lost host or process: DISTKERAS_PEER_TIMEOUT seconds, else the default.
    Engines with a failure detector of their own (jax.distributed's heartbeats) get it too."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get(PEER_TIMEOUT_ENV, "") or DEFAULT_PEER_TIMEOUT)
    except ValueError:
        return DEFAULT_PEER_TIMEOUT
    return value if value > 0 else DEFAULT_PEER_TIMEOUT


class Link(object):
    """One launcher-to-launcher connection: JSON lines, non-blocking reads, time of the last word."""

    def __init__(self, sock, name):
        self.sock = sock
        self.name = name
        self.buffer = b""
        self.closed = False
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        self.node: Optional[int] = None
        self.done = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: Dict[str, object]) -> bool:
        if self.closed:
            return False
        try:
            self.sock.settimeout(5.0)
            self.sock.sendall((json.dumps(message) + "\n").encode())
            self.last_sent = time.monotonic()
            return True
        except OSError:
            self.close()
            return False

    def receive(self, wait: float = 0.0) -> List[Dict[str, object]]:
        """The messages that arrived, waiting up to ``wait`` seconds for the first."""
        messages: List[Dict[str, object]] = []
        deadline = time.monotonic() + wait
        while not self.closed:
            left = max(0.0, deadline - time.monotonic())
            try:
                readable, _, _ = select.select([self.sock], [], [], left if not messages else 0.0)
            except (OSError, ValueError):
                self.close()
                break
            if not readable:
                break
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                break
            self.last_heard = time.monotonic()
            self.buffer += chunk
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                try:
                    messages.append(json.loads(line.decode()))
                except ValueError:
                    pass
            if messages:
                break
        return messages

    def close(self):
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


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


def hello(node_rank: int,
          nnodes: int,
          nproc_per_node: int,
          backend: str,
          hosts: Optional[List[str]],
          address: str) -> Dict[str, object]:
    """What a launcher tells the others about itself."""
    return {"node_rank": node_rank, "nnodes": nnodes, "nproc_per_node": nproc_per_node, "backend": backend,
            "hosts": list(hosts) if hosts else None, "address": address, "protocol": _PROTOCOL}


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
                if "failed" in message:
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
            if link.closed:
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


def join(coordinator: str,
         me: Dict[str, object],
         join_timeout: float = DEFAULT_JOIN_TIMEOUT,
         peer_timeout: float = DEFAULT_PEER_TIMEOUT,
         source_address: Optional[str] = None) -> Supervisor:
    """Node rank > 0: reach node 0 at ``coordinator``, introduce this host, get the plan.

    Raises:
        LaunchError: nobody answered within ``join_timeout``, or node 0 refused this host (it says why).
    """
    from .network import parse_address

    host, port = parse_address(coordinator)
    deadline = time.monotonic() + join_timeout
    problem = "nothing answered"
    sock = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic())),
                                            source_address=(source_address, 0) if source_address else None)
            break
        except OSError as exc:
            problem = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            time.sleep(0.5)
    if sock is None:
        raise LaunchError(_deadline_message(coordinator, join_timeout, problem))
    link = Link(sock, coordinator)
    link.node = 0
    link.send({"hello": me})
    while time.monotonic() < deadline and not link.closed:
        for message in link.receive(wait=min(1.0, max(0.0, deadline - time.monotonic()))):
            if "error" in message:
                link.close()
                raise LaunchError(str(message["error"]))
            if "plan" in message:
                return Supervisor(me, [link], dict(message["plan"]), peer_timeout, coordinator)
    link.close()
    raise LaunchError(
        "Node rank 0 at {} took this host in but did not start the job within {:.0f} s: not every host of the "
        "job joined. Start every host's `distkeras launch` (node ranks 0..{}) with the same options.".format(
            coordinator, join_timeout, int(me["nnodes"]) - 1))


def gather(listener: socket.socket,
           me: Dict[str, object],
           join_timeout: float = DEFAULT_JOIN_TIMEOUT,
           peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> Supervisor:
    """Node rank 0: wait on ``listener`` for every other host, check that they agree, send the plan.

    Raises:
        LaunchError: a host disagrees (every host is told why), or not all came within ``join_timeout``.
    """
    nnodes = int(me["nnodes"])
    coordinator = "{}:{}".format(*listener.getsockname()[:2])
    deadline = time.monotonic() + join_timeout
    pending: List[Link] = []
    joined: Dict[int, Link] = {}
    addresses = {0: str(me["address"])}

    def refuse(message):
        for link in pending + list(joined.values()):
            link.send({"error": message})
            link.close()
        listener.close()
        raise LaunchError(message)

    while len(joined) < nnodes - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [n for n in range(1, nnodes) if n not in joined]
            refuse("{} of the {} hosts joined node rank 0 at {} within {:.0f} s; missing node rank(s) {}. Start "
                   "`distkeras launch --node-rank N` on every host with --coordinator {} (--join-timeout / {} to wait "
                   "longer), or give every host the real --nnodes.".format(
                       len(joined) + 1, nnodes, coordinator, join_timeout, ", ".join(map(str, missing)), coordinator,
                       JOIN_TIMEOUT_ENV))
        readable, _, _ = select.select([listener] + [link.sock for link in pending], [], [], min(0.5, left))
        if listener in readable:
            sock, peer = listener.accept()
            pending.append(Link(sock, "{}:{}".format(*peer[:2])))
        for link in list(pending):
            if link.sock not in readable:
                continue
            for message in link.receive():
                if "hello" not in message:
                    continue
                theirs = dict(message["hello"])
                pending.remove(link)
                node = theirs.get("node_rank")
                problem = _disagreement(me, theirs)
                if problem is None and (not isinstance(node, int) or not 0 < node < nnodes):
                    problem = "a host ({}) says it is node rank {}, outside 1..{} (--nnodes {}).".format(
                        theirs.get("address"), node, nnodes - 1, nnodes)
                if problem is None and node in joined:
                    problem = "two hosts say they are node rank {}: {} and {}. Give each host its own --node-rank.".format(
                        node, addresses[node], theirs.get("address"))
                if problem is not None:
                    pending.append(link)
                    refuse(problem)
                link.node = node
                joined[node] = link
                addresses[node] = str(theirs.get("address"))
                break
            if link.closed and link in pending:
                pending.remove(link)
    listener.close()
    plan = {"addresses": [addresses[n] for n in range(nnodes)]}
    links = [joined[n] for n in sorted(joined)]
    for link in links:
        link.send({"plan": plan})
    return Supervisor(me, links, plan, peer_timeout, coordinator)
