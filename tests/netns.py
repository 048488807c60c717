"""Hosts made of Linux network namespaces, for tests and benchmarks that need more than one machine.

    with Hosts(2) as hosts:                       # two "machines", 10.47.0.1 and 10.47.0.2
        hosts.limit(1, "100mbit")                 # host 1's link: 100 Mbit/s (tc tbf)
        worker = hosts.popen(1, ["python", "train.py"], stdout=subprocess.PIPE)
        hosts.lose(1)                             # host 1 drops off the network, its processes die

Every host is a namespace with its own loopback and one interface, ``eth0``, a veth pair whose other end
sits on a bridge in a separate "switch" namespace: the hosts reach each other through the switch and
nothing else (not the machine's own network, which stays untouched). Inside a namespace the machine's
host name still resolves to a loopback address (/etc/hosts is shared), as on a stock Debian or Ubuntu host:
exactly what trips engines that trust the host name. Processes started with :meth:`Hosts.popen` run in
their host's namespace and share the file system, so the same Python environment works everywhere.

Needs root and iproute2 (``ip``; ``tc`` for :meth:`Hosts.limit`); :func:`unavailable` says why not where
they are missing, for a skip reason. Namespaces are named ``dk<pid>s`` and ``dk<pid>h<i>`` after the
creating process: :meth:`Hosts.close` (also on an exception, and at exit) kills every process in them and
deletes them; namespaces left by a process that no longer exists (one killed with SIGKILL) are deleted
by the next :class:`Hosts`.
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
import time

SUBNET = "10.47.0"
_NAME = re.compile(r"^dk(\d+)(s|h\d+)$")
_open = []


def unavailable():
    """Why namespace hosts can't be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add); this runs as uid {}".format(
            os.geteuid() if hasattr(os, "geteuid") else "?")
    if shutil.which("ip") is None:
        return "network-namespace hosts need iproute2's `ip` (apt-get install iproute2)"
    probe = "dk{}probe".format(os.getpid())
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return "`ip netns add` fails here: {}".format(done.stderr.strip())
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args, namespace=None, check=True):
    command = ["ip"] + (["-n", namespace] if namespace else []) + [str(a) for a in args]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError("{} failed: {}".format(" ".join(command), done.stderr.strip()))
    return done.stdout


def _pids(namespace):
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_all(namespace, signum=signal.SIGKILL):
    for pid in _pids(namespace):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _delete(namespace):
    for _ in range(50):  # a process being killed can hold the namespace for a moment
        _kill_all(namespace)
        if not _pids(namespace):
            break
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def remove_stale():
    """Delete the namespaces of creators that are gone (a test process killed before it could clean up)."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not os.path.exists("/proc/{}".format(match.group(1))):
            _delete(name)


class Hosts(object):
    """``count`` hosts on one switch; see the module docstring.

    Attributes:
        names: the hosts' namespace names.
        addresses: their addresses, ``10.47.0.1`` .. (a /24 that exists only inside these namespaces).
    """

    def __init__(self, count):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        remove_stale()
        tag = "dk{}".format(os.getpid())
        index = sum(1 for h in _open if h.switch.startswith(tag))  # several at once in one process
        self.switch = "{}s{}".format(tag, index) if index else tag + "s"
        self.names = ["{}h{}".format(tag, i + 10 * index) for i in range(count)]
        self.addresses = ["{}.{}".format(SUBNET, i + 1) for i in range(count)]
        self._closed = False
        _open.append(self)
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
            _ip("link", "set", "br0", "up", namespace=self.switch)
            for i, (name, address) in enumerate(zip(self.names, self.addresses)):
                _ip("netns", "add", name)
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", "port{}".format(i),
                    "netns", self.switch)
                _ip("link", "set", "port{}".format(i), "master", "br0", namespace=self.switch)
                _ip("link", "set", "port{}".format(i), "up", namespace=self.switch)
                _ip("addr", "add", address + "/24", "dev", "eth0", namespace=name)
                _ip("link", "set", "eth0", "up", namespace=name)
                _ip("link", "set", "lo", "up", namespace=name)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def command(self, host, args):
        """``args`` as a command line that runs in host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.names[host]] + list(args)

    def popen(self, host, args, **kwargs):
        """Start ``args`` on host ``host`` (a :class:`subprocess.Popen`; keyword arguments go to it)."""
        return subprocess.Popen(self.command(host, args), **kwargs)

    def run(self, host, args, **kwargs):
        """Run ``args`` on host ``host`` to completion (:func:`subprocess.run`)."""
        return subprocess.run(self.command(host, args), **kwargs)

    def limit(self, host, rate, burst="64kb", latency="50ms"):
        """Give host ``host``'s link a bandwidth (``tc qdisc ... tbf``), e.g. ``rate="100mbit"``, both ways."""
        if shutil.which("tc") is None:
            raise RuntimeError("limiting a link needs iproute2's `tc`")
        for namespace, device in ((self.names[host], "eth0"), (self.switch, "port{}".format(host))):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root",
                            "tbf", "rate", rate, "burst", burst, "latency", latency], check=True,
                           capture_output=True, text=True)

    def lose(self, host):
        """Host ``host`` is lost as a machine is: its link goes down first (the other hosts get no
        connection reset, no FIN: its peers learn of it only by silence), then its processes die."""
        _ip("link", "set", "port{}".format(host), "down", namespace=self.switch)
        _kill_all(self.names[host])

    def reconnect(self, host):
        """Bring a lost host's link back up (its processes stay dead)."""
        _ip("link", "set", "port{}".format(host), "up", namespace=self.switch)

    def pids(self, host):
        """The processes running on host ``host``."""
        return _pids(self.names[host])

    def close(self):
        """Kill every process on every host and delete the namespaces. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for name in self.names:
            _delete(name)
        _delete(self.switch)
        if self in _open:
            _open.remove(self)


@atexit.register
def _close_all():
    for hosts in list(_open):
        hosts.close()
