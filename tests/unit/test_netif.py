"""Which interface the agent tells its workers to use for collectives (agents/netif.py)."""

from __future__ import annotations

from ftrain.agents.netif import GLOO_IFNAME, collective_interface, interface_of


def test_the_interface_holding_an_address_is_found():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: nobody here holds it
    assert interface_of("not-an-address") is None and interface_of("::1") is None


def test_workers_are_told_an_interface_only_for_a_non_loopback_address_that_one_holds():
    assert collective_interface("127.0.0.1") == {}  # one host: gloo's own choice works
    assert collective_interface("203.0.113.77") == {}
    assert collective_interface("node-a.example") == {}  # a name: resolved as before
    assert collective_interface("127.0.0.1", {GLOO_IFNAME: "eth1"}) == {}


def test_an_interface_the_operator_named_wins(monkeypatch):
    import ftrain.agents.netif as netif

    monkeypatch.setattr(netif, "interface_of", lambda address: "eth0")
    assert collective_interface("198.18.0.4") == {GLOO_IFNAME: "eth0"}
    assert collective_interface("198.18.0.4", {}, {GLOO_IFNAME: "ib0"}) == {}
