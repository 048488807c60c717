"""network.listen_address: the one address rank 0's servers listen on (issue 35), or None (every interface)."""

import socket

from distkeras.launch import network

KNOWN = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2", "fd00::2"], "eth1": ["192.168.1.5"]}


def test_an_address_of_this_host_or_loopback_is_itself():
    assert network.listen_address("127.0.0.1", KNOWN) == "127.0.0.1"
    assert network.listen_address("127.0.0.5", KNOWN) == "127.0.0.5"  # all of 127/8 is loopback
    assert network.listen_address("[::1]", KNOWN) == "::1"
    assert network.listen_address("10.0.0.2", KNOWN) == "10.0.0.2"
    assert network.listen_address("fd00:0::2", KNOWN) == "fd00::2"


def test_another_hosts_address_gives_none():
    assert network.listen_address("10.0.0.9", KNOWN) is None


def test_a_name_gives_the_one_address_of_this_host_it_resolves_to(monkeypatch):
    table = {"node0": ["10.0.0.2"], "debian": ["127.0.1.1"], "localhost": ["127.0.0.1", "::1"],
             "twice": ["10.0.0.2", "192.168.1.5"], "elsewhere": ["10.0.0.9"], "mixed": ["127.0.1.1", "10.0.0.2"]}

    def resolve(host, port, family=0, kind=0, *args):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, kind, 6, "", (a, 0)) for a in table[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert network.listen_address("node0", KNOWN) == "10.0.0.2"
    assert network.listen_address("mixed", KNOWN) == "10.0.0.2"
    # Only loopback here (stock Debian/Ubuntu's own name; localhost): the other hosts reach it elsewhere.
    assert network.listen_address("debian", KNOWN) is None
    assert network.listen_address("localhost", KNOWN) is None
    assert network.listen_address("twice", KNOWN) is None  # two of this host's: no single one is sure
    assert network.listen_address("elsewhere", KNOWN) is None
    assert network.listen_address("nowhere", KNOWN) is None
