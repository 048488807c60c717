"""Which network interface a worker's engine uses: the one that reaches the coordinator.

Engines left to themselves advertise the address the host name resolves to, and stock Debian and Ubuntu
hosts resolve their own name to a loopback address (``127.0.1.1 <hostname>`` in /etc/hosts): Gloo then
tells the other hosts to connect to 127.0.x.x and the job never forms. distkeras instead asks the kernel
which local address a socket to the coordinator would use (a UDP ``connect`` picks the route and sends
nothing) and gives every engine the interface that holds that address:

- torch.distributed: ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``;
- JAX: the ``interface`` of jaxlib's Gloo TCP collectives;
- TensorFlow: the worker's own address in TF_CONFIG (``distkeras launch`` gathers every host's).

The servers of rank 0 (JAX's coordination service, torch's TCPStore) listen on :func:`listen_address`, the
address the others connect to, rather than on every interface (their default). TensorFlow's gRPC servers can't be
told an address: they listen on every interface (issue 35).

A user's choice wins: ``--interface`` of ``distkeras launch`` or the :data:`INTERFACE_ENV` variable (an
interface name, ``eth0``, or one of this host's addresses), and an engine variable the user set
(``GLOO_SOCKET_IFNAME``...) is left alone. When no interface reaches the coordinator, :func:`choose`
raises :class:`~distkeras.NetworkError` saying so before anything starts.

Standard library only (Linux for interface names); part of the Python 3.6-compatible core.
"""

import ipaddress
import os
import socket
import struct
import typing
from typing import Dict, List, Mapping, Optional, Tuple

from ..errors import LaunchError, NetworkError

#: Names the interface (or an address of it) every engine of this worker uses; overrides the choice.
INTERFACE_ENV = "DISTKERAS_INTERFACE"
#: The engine variables distkeras fills in with the chosen interface (unless the user set them).
ENGINE_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915


class Route(
    typing.NamedTuple("Route", [("interface", Optional[str]), ("address", str), ("coordinator", str), ("chosen_by", str)])
):
    """The interface a worker uses to reach the coordinator.

    Attributes:
        interface: the interface's name (``"eth0"``, ``"lo"``), None where the address belongs to none
            that this host lists.
        address: this host's address on it, the one the other hosts connect to.
        coordinator: the coordinator's host, as given.
        chosen_by: ``"route"`` (the kernel's route to the coordinator) or the option/variable that named it.
    """

    __slots__ = ()


def interfaces() -> Dict[str, List[str]]:
    """This host's interfaces and their addresses (IPv4 first, then IPv6), e.g. ``{"lo": ["127.0.0.1", "::1"]}``."""
    found: Dict[str, List[str]] = {}
    if not hasattr(socket, "if_nameindex"):
        return found
    try:
        import fcntl
    except ImportError:  # not Linux/Unix: names without addresses
        fcntl = None
    for _, name in socket.if_nameindex():
        found[name] = []
        if fcntl is None:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found[name].append(socket.inet_ntoa(packed[20:24]))
            except OSError:  # no IPv4 address on it
                pass
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and fields[5] in found:
                    raw = bytes.fromhex(fields[0])
                    found[fields[5]].append(socket.inet_ntop(socket.AF_INET6, raw))
    except (IOError, OSError, ValueError):
        pass
    return found


def listing(known: Mapping[str, List[str]]) -> str:
    return ", ".join("{} ({})".format(name, ", ".join(addresses) or "no address") for name, addresses in sorted(known.items()))


def interface_of(address: str, known: Optional[Mapping[str, List[str]]] = None) -> Optional[str]:
    """The name of the interface that holds ``address``, or None."""
    known = interfaces() if known is None else known
    for name, addresses in sorted(known.items()):
        if address in addresses:
            return name
    return None


def local_address_to(host: str, port: int = 9) -> str:
    """The address of this host that a connection to ``host`` leaves from (nothing is sent).

    Raises:
        NetworkError: ``host`` doesn't resolve, or no route leads there.
    """
    try:
        candidates = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise NetworkError(
            "Can't resolve the coordinator's host {!r} ({}). Expected an address or a host name this host "
            "resolves, e.g. 10.0.0.1.".format(host, exc.strerror or exc)
        )
    problem = None
    for family, kind, proto, _, target in candidates:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(target)
                return probe.getsockname()[0]
            except OSError as exc:
                problem = exc
    raise NetworkError(
        "No interface of this host reaches the coordinator {} ({}). This host has: {}. Check the coordinator "
        "address, or name the interface to use with --interface (distkeras launch) or {}.".format(
            host, os.strerror(problem.errno) if problem and problem.errno else problem, listing(interfaces()),
            INTERFACE_ENV,
        )
    )


def choose(coordinator: str,
           override: Optional[str] = None,
           environ: Optional[Mapping[str, str]] = None,
           known: Optional[Mapping[str, List[str]]] = None) -> Route:
    """The interface this worker's engines use to reach ``coordinator`` (``host`` or ``host:port``).

    Args:
        coordinator: the coordinator's address, as the job names it.
        override: an interface name or one of this host's addresses (``--interface``); wins over the
            environment.
        environ: the environment (``os.environ`` when None); :data:`INTERFACE_ENV` overrides the route.
        known: this host's interfaces, as :func:`interfaces` returns them (for tests).

    Raises:
        NetworkError: the override names nothing of this host, or no interface reaches the coordinator.
    """
    env = os.environ if environ is None else environ
    host = coordinator.rpartition(":")[0] if coordinator.count(":") == 1 or coordinator.startswith("[") else coordinator
    host = host.strip("[]") or coordinator
    known = interfaces() if known is None else known
    named, source = override, "--interface"
    if not named and env.get(INTERFACE_ENV, "").strip():
        named, source = env[INTERFACE_ENV].strip(), INTERFACE_ENV
    if named:
        if named in known:
            addresses = known[named]
            if not addresses:
                raise NetworkError("{}={!r} names an interface without an address. This host has: {}.".format(
                    source, named, listing(known)))
            return Route(named, addresses[0], host, source)
        name = interface_of(named, known)
        if name is None:
            raise NetworkError(
                "Expected {} to name an interface of this host or one of its addresses. Received: {}={!r}. "
                "This host has: {}.".format(source, source, named, listing(known))
            )
        return Route(name, named, host, source)
    address = local_address_to(host)
    return Route(interface_of(address, known), address, host, "route")


def listen_address(host: str, known: Optional[Mapping[str, List[str]]] = None) -> Optional[str]:
    """The one address a server of this host listens on for the clients that connect to ``host`` (the
    coordinator as the job names it), or None where no single address is sure to be theirs: then the engine
    keeps its default, every interface.

    - an address (``127.0.0.1``, ``10.0.0.1``, ``::1``): itself, when it is loopback or one of this host's;
    - a name: the one address of this host, not loopback, that it resolves to here. A name that resolves
      only to loopback addresses gives None: stock Debian/Ubuntu hosts resolve their own name to 127.0.1.1,
      which the other hosts can't reach (they reach the name at another address), and ``localhost`` is both
      127.0.0.1 and ::1 (a client may try either).

    Args:
        host: the coordinator's host, without port (brackets allowed).
        known: this host's interfaces, as :func:`interfaces` returns them (for tests).
    """
    known = interfaces() if known is None else known
    mine = set()
    for addresses in known.values():
        for address in addresses:
            try:
                mine.add(ipaddress.ip_address(address))
            except ValueError:
                pass
    host = host.strip("[]")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return str(literal) if literal.is_loopback or literal in mine else None
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
        resolved = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    local = [a for a in resolved if a in mine and not a.is_loopback]
    return str(local[0]) if len(local) == 1 else None


def engine_variables(route: Route, environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The engine variables to set for ``route``: those the user hasn't set already."""
    env = os.environ if environ is None else environ
    if not route.interface:
        return {}
    return {name: route.interface for name in ENGINE_INTERFACE_VARIABLES if not env.get(name)}


def describe_route(route: Route) -> str:
    """``"eth0 (10.0.0.2)"``, for messages."""
    return "{} ({})".format(route.interface or "an unnamed interface", route.address)


def parse_address(text: str, option: str = "--coordinator") -> Tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, with a clear error for anything else."""
    host, sep, port = (text or "").strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(
            "Expected {} HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:29500. Received: {}={!r}".format(
                option, option, text
            )
        )
    return host, int(port)


def free_port(host: str = "127.0.0.1", count: int = 4) -> int:
    """A TCP port nobody listens on right now, on ``host``, with the ``count - 1`` ports after it free too (a job
    given ``--coordinator HOST:PORT`` runs its engines on the ports after PORT).

    Drawn from 20000 up to the kernel's ephemeral range (``ip_local_port_range``) where that is known: a port ``bind(0)``
    hands out is one the kernel also gives to outgoing connections, so between this call and the server's own
    bind another process' connection may take it, or the port after it. Elsewhere, and when no block is free
    there after a few tries, the kernel's choice.
    """
    import random

    low = _ephemeral_low()
    chooser = random.SystemRandom()
    for _ in range(64 if low is not None and low - count > _LOWEST + 1000 else 0):
        first = chooser.randrange(_LOWEST, low - count)
        if all(_bindable(host, port) for port in range(first, first + count)):
            return first
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


#: The lowest port :func:`free_port` draws: above the ports services take by default (Ray's workers: 10002-19999).
_LOWEST = 20000


def _ephemeral_low() -> Optional[int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


def bracket(host: str) -> str:
    """``host`` as it goes before ``:port``: an IPv6 address in brackets."""
    return "[{}]".format(host) if ":" in host else host
