"""The launchers' wire: what one launcher says to another, and how each line is read.

Every line is JSON, at most :data:`MAX_LINE` bytes, parsed once. Before the handshake a line is raw (node 0's
challenge, a host's hello: :func:`hello`, checked by :func:`check_hello` and, with the job's secret, its HMAC); after
it (:meth:`Link.start_session`) every line is ``{"m": message, "s": number, "mac": hex}``, numbered from 0 in each
direction and signed with the secret over the session's two nonces, its direction, its number and the message.
Every field of every message is checked by type and charset before anything reads it: counts are integers, addresses
ASCII host names or IP addresses, texts printable (no terminal escapes), a MAC 64 hex digits compared as bytes
(:func:`mac_matches`: ``hmac.compare_digest`` raises on a ``str`` with non-ASCII characters). A line that breaks a
rule closes that link and says why (:attr:`Link.why`); what the rendezvous does then is
:mod:`distkeras.launch.rendezvous`'s.

Standard library only; part of the Python 3.6-compatible core.
"""

import hashlib
import hmac
import json
import os
import re
import socket
import time
from typing import Dict, List, Optional

#: The longest line either side reads, in bytes: a hello with --hosts of a few thousand hosts fits.
MAX_LINE = 256 * 1024
#: The longest text of a ``failed`` / ``abort`` / ``error`` message.
MAX_TEXT = 4096
_PROTOCOL = 2
_NONCE_BYTES = 16
_HEX = re.compile(r"[0-9a-f]+")
_ADDRESS = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,255}")
_BACKEND = re.compile(r"[a-z0-9_]{1,64}")


def _canonical(message):
    return json.dumps(message, sort_keys=True, separators=(",", ":")).encode()


def _mac(key, *parts):
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).hexdigest()


def mac_matches(mac, expected):
    """Whether ``mac`` (what arrived: any JSON value) is the 64 hex digits ``expected``. Compared as bytes, and only
    once it is 64 hex digits: ``hmac.compare_digest`` raises on a ``str`` with non-ASCII characters."""
    if not isinstance(mac, str) or len(mac) != 64 or not _HEX.fullmatch(mac):
        return False
    return hmac.compare_digest(mac.encode("ascii"), expected.encode("ascii"))


def _nonce():
    return os.urandom(_NONCE_BYTES).hex()


def _is_int(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_text(value, longest=255):
    """A text a launcher may print: no control characters (a terminal's escape sequences among them)."""
    return isinstance(value, str) and 0 < len(value) <= longest and value.isprintable()


def _is_address(value):
    """A host name or an IPv4 / IPv6 address (a zone such as ``%eth0`` included): ASCII only."""
    return isinstance(value, str) and _ADDRESS.fullmatch(value) is not None


def _is_nonce(value):
    return isinstance(value, str) and len(value) == 2 * _NONCE_BYTES and _HEX.fullmatch(value) is not None


def check_hello(me: object) -> Optional[str]:
    """Why ``me`` isn't a launcher's hello (:func:`hello`'s shape), or None."""
    if not isinstance(me, dict):
        return "its hello is not an object"
    expected = {"node_rank", "nnodes", "nproc_per_node", "backend", "hosts", "address", "protocol"}
    if set(me) != expected:
        return "its hello has the fields {}, not {}".format(sorted(me)[:10], sorted(expected))
    if not _is_int(me["nnodes"], 1, 1000000) or not _is_int(me["node_rank"], 0, 1000000):
        return "its hello's nnodes / node_rank are not counts"
    if not _is_int(me["nproc_per_node"], 1, 100000) or not _is_int(me["protocol"], 0, 1000000):
        return "its hello's nproc_per_node / protocol are not counts"
    if not isinstance(me["backend"], str) or not _BACKEND.fullmatch(me["backend"]) or not _is_address(me["address"]):
        return "its hello's backend / address are not a backend's name and an address"
    hosts = me["hosts"]
    if hosts is not None and (not isinstance(hosts, list) or len(hosts) > me["nnodes"]
                              or not all(_is_address(h) for h in hosts)):
        return "its hello's hosts are not a list of addresses"
    return None


def check_plan(plan: object, nnodes: int) -> Optional[str]:
    """Why ``plan`` isn't a job's plan for ``nnodes`` hosts, or None."""
    if not isinstance(plan, dict) or set(plan) != {"addresses"}:
        return "its plan is not an object with exactly the field 'addresses'"
    addresses = plan["addresses"]
    if not isinstance(addresses, list) or len(addresses) != nnodes or not all(_is_address(a) for a in addresses):
        return "its plan's addresses are not a list of {} addresses".format(nnodes)
    return None


#: The messages of a running job: each a one-field object, the field's value of this shape.
_NEWS = {"beat": lambda v: v == 1, "done": lambda v: v == 1, "end": lambda v: v == 1,
         "failed": lambda v: _is_text(v, MAX_TEXT), "abort": lambda v: _is_text(v, MAX_TEXT),
         "error": lambda v: _is_text(v, MAX_TEXT)}


def check_news(message: object) -> Optional[str]:
    """Why ``message`` isn't one of a running job's messages (or node 0's answer to a hello), or None."""
    if not isinstance(message, dict) or len(message) != 1:
        return "a message is not a one-field object"
    (kind, value), = message.items()
    if kind == "plan":
        return None  # checked by the receiver, who knows nnodes
    check = _NEWS.get(kind)
    if check is None or not check(value):
        return "a message of an unknown kind or shape ({!r})".format(str(kind)[:20])
    return None


class Link(object):
    """One launcher-to-launcher connection: bounded JSON lines, non-blocking reads, time of the last word.

    After the handshake (:meth:`start_session`) every line is ``{"m": message, "s": number, "mac": hex}``:
    numbered from 0 in each direction, the HMAC (with a key) over the session, the direction, the number and
    the message. A line that breaks any rule closes the link (``why`` says what)."""

    def __init__(self, sock, name):
        self.sock = sock
        self.name = name
        self.buffer = b""
        self.closed = False
        self.why: Optional[str] = None
        self.opened = time.monotonic()
        self.last_heard = self.opened
        self.last_sent = 0.0
        self.node: Optional[int] = None
        self.done = False
        self.key: Optional[bytes] = None
        self.challenge: Optional[str] = None
        self.session: Optional[bytes] = None
        self.sent = self.heard = 0
        self.outgoing = self.incoming = b""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def start_session(self, key, challenge, nonce, node0):
        """From now on, number (and with ``key``, sign) every message; ``node0``: this end is node 0's."""
        self.key = key
        self.session = "{}:{}".format(challenge, nonce).encode()
        self.outgoing, self.incoming = (b"0>n", b"n>0") if node0 else (b"n>0", b"0>n")

    def send_raw(self, line: Dict[str, object]) -> bool:
        if self.closed:
            return False
        try:
            self.sock.settimeout(5.0)
            self.sock.sendall(json.dumps(line).encode() + b"\n")
            self.last_sent = time.monotonic()
            return True
        except OSError:
            self.close()
            return False

    def send(self, message: Dict[str, object]) -> bool:
        line = {"m": message, "s": self.sent}  # type: Dict[str, object]
        if self.key is not None:
            line["mac"] = _mac(self.key, self.session, self.outgoing, str(self.sent).encode(), _canonical(message))
        self.sent += 1
        return self.send_raw(line)

    def fail(self, why):
        if not self.closed:
            self.why = why
            self.close()

    def receive_raw(self, wait: float = 0.0) -> List[object]:
        """The parsed lines that arrived, waiting up to ``wait`` seconds for the first."""
        lines: List[object] = []
        deadline = time.monotonic() + wait
        while not self.closed and not lines:
            left = deadline - time.monotonic()
            try:
                self.sock.settimeout(left if left > 0 else 0.0)
                chunk = self.sock.recv(65536)
            except (socket.timeout, BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                break
            self.last_heard = time.monotonic()
            self.buffer += chunk
            if b"\n" not in chunk:
                if len(self.buffer) > MAX_LINE:
                    self.fail("a line longer than {} bytes".format(MAX_LINE))
                continue
            *complete, self.buffer = self.buffer.split(b"\n")
            for raw in complete:
                if len(raw) > MAX_LINE:
                    self.fail("a line longer than {} bytes".format(MAX_LINE))
                    return lines
                try:
                    lines.append(json.loads(raw.decode("utf-8")))
                except (ValueError, RecursionError, UnicodeDecodeError):
                    self.fail("a line that is not JSON")
                    return lines
            if len(self.buffer) > MAX_LINE:
                self.fail("a line longer than {} bytes".format(MAX_LINE))
        return lines

    def receive(self, wait: float = 0.0) -> List[Dict[str, object]]:
        """The session's messages that arrived, each checked, waiting up to ``wait`` seconds for the first."""
        messages: List[Dict[str, object]] = []
        for line in self.receive_raw(wait):
            problem = self._check(line)
            if problem is not None:
                self.fail(problem)
                break
            messages.append(line["m"])  # type: ignore
        return messages

    def _check(self, line):
        if not isinstance(line, dict) or not set(line) <= {"m", "s", "mac"} or "m" not in line or "s" not in line:
            return "a line that is not a numbered message"
        if not _is_int(line["s"], 0, 1 << 62) or line["s"] != self.heard:
            return "message number {!r} where {} was next (replayed, lost or forged)".format(
                str(line["s"])[:20], self.heard)
        problem = check_news(line["m"])
        if problem is not None:
            return problem
        if self.key is not None:
            mac = line.get("mac")
            expected = _mac(self.key, self.session, self.incoming, str(self.heard).encode(), _canonical(line["m"]))
            if not mac_matches(mac, expected):
                return "a message without the job's signature (forged, or sent without the secret)"
        self.heard += 1
        return None

    def close(self):
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


def hello(node_rank: int,
          nnodes: int,
          nproc_per_node: int,
          backend: str,
          hosts: Optional[List[str]],
          address: str) -> Dict[str, object]:
    """What a launcher tells the others about itself."""
    return {"node_rank": node_rank, "nnodes": nnodes, "nproc_per_node": nproc_per_node, "backend": backend,
            "hosts": list(hosts) if hosts else None, "address": address, "protocol": _PROTOCOL}


def _hello_problem(line, key, challenge):
    """Why a pending connection's first line is not a good hello (None: it is)."""
    if not isinstance(line, dict) or not {"hello", "nonce"} <= set(line) or not set(line) <= {"hello", "nonce", "mac"}:
        return "its first line is not a hello"
    if not _is_nonce(line["nonce"]):
        return "its hello has no nonce"
    problem = check_hello(line["hello"])
    if problem is not None:
        return problem
    if key is not None:
        mac = line.get("mac")
        expected = _mac(key, b"hello", challenge.encode(), line["nonce"].encode(), _canonical(line["hello"]))
        if not mac_matches(mac, expected):
            return "secret"
    return None
