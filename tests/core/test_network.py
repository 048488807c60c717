"""network.choose(): the interface that reaches the coordinator, the user's override, clear errors."""

import pytest

from distkeras import NetworkError
from distkeras.launch import network

KNOWN = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.47.0.2", "fe80::1"], "ib0": []}


def test_the_route_to_the_coordinator_picks_the_interface():
    # The kernel's route to a loopback coordinator leaves from 127.0.0.1, which lo holds.
    route = network.choose("127.0.0.1:29500", environ={})
    assert (route.interface, route.address, route.coordinator, route.chosen_by) == ("lo", "127.0.0.1", "127.0.0.1", "route")
    assert network.choose("localhost", environ={}).interface == "lo"


def test_the_users_choice_wins_by_name_or_address():
    assert network.choose("127.0.0.1:1", override="eth0", environ={}, known=KNOWN) == network.Route(
        "eth0", "10.47.0.2", "127.0.0.1", "--interface")
    assert network.choose("127.0.0.1:1", environ={"DISTKERAS_INTERFACE": "10.47.0.2"}, known=KNOWN) == network.Route(
        "eth0", "10.47.0.2", "127.0.0.1", "DISTKERAS_INTERFACE")
    # --interface beats the variable.
    chosen = network.choose("127.0.0.1:1", override="lo", environ={"DISTKERAS_INTERFACE": "eth0"}, known=KNOWN)
    assert chosen.interface == "lo" and chosen.chosen_by == "--interface"


def test_a_choice_that_names_nothing_here_says_what_exists():
    with pytest.raises(NetworkError) as raised:
        network.choose("127.0.0.1:1", environ={"DISTKERAS_INTERFACE": "eth9"}, known=KNOWN)
    assert str(raised.value) == (
        "Expected DISTKERAS_INTERFACE to name an interface of this host or one of its addresses. Received: "
        "DISTKERAS_INTERFACE='eth9'. This host has: eth0 (10.47.0.2, fe80::1), ib0 (no address), lo (127.0.0.1, ::1).")
    with pytest.raises(NetworkError, match="names an interface without an address"):
        network.choose("127.0.0.1:1", override="ib0", environ={}, known=KNOWN)
    assert isinstance(raised.value, ConnectionError)


def test_a_coordinator_that_does_not_resolve_is_an_error_before_anything_starts():
    with pytest.raises(NetworkError, match=r"Can't resolve the coordinator's host 'no-such-host\.invalid'"):
        network.choose("no-such-host.invalid:29500", environ={})


def test_engine_variables_leave_the_users_own_alone():
    route = network.Route("eth0", "10.47.0.2", "10.47.0.1", "route")
    assert network.engine_variables(route, {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert network.engine_variables(route, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert network.engine_variables(route._replace(interface=None), {}) == {}


def test_this_hosts_interfaces_include_loopback():
    found = network.interfaces()
    assert "127.0.0.1" in found.get("lo", [])
    assert network.interface_of("127.0.0.1") == "lo" and network.interface_of("192.0.2.99", KNOWN) is None


def test_free_port_gives_a_block_of_free_ports_below_the_ephemeral_range():
    """A coordinator PORT from bind(0) is an ephemeral port: another process' outgoing connection took PORT+1 before
    the engine bound it (seen in CI: "Port 60790 ... PORT+1 after --coordinator's PORT 60789 ... in use")."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(20):
        port = network.free_port()
        assert 20000 <= port and port + 4 <= ephemeral
        for taken in range(port, port + 4):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", taken))
