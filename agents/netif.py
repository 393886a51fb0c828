"""Which network interface holds this node's address, so that workers' collectives use it.

gloo picks the address to listen on from the host name unless ``GLOO_SOCKET_IFNAME`` names an
interface, and a host name can resolve to an address the other nodes cannot reach (a loopback
alias, another network). The agent knows the address the other nodes reach this node at (its
``--host``), so it tells the workers the interface that holds it. Standard library only
(``SIOCGIFADDR``), Linux.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

#: the ioctl that reads an interface's IPv4 address (linux/sockios.h)
SIOCGIFADDR = 0x8915
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 ``address`` on this host (None: no interface does, or it
    is not an IPv4 address)."""
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(reply[20:24]) == address:
            return name
    return None


def collective_interface(host: str, *environments: Mapping[str, str]) -> dict[str, str]:
    """``{GLOO_SOCKET_IFNAME: interface}`` for workers of a node reached at ``host``, unless the
    address is a loopback one (one host: whatever gloo picks works), no interface holds it, or
    an environment already names one (the operator's choice wins)."""
    if any(GLOO_IFNAME in env for env in environments):
        return {}
    try:
        if ipaddress.ip_address(host).is_loopback:
            return {}
    except ValueError:  # a host name: gloo resolves it as it always did
        return {}
    name = interface_of(host)
    return {GLOO_IFNAME: name} if name else {}


__all__ = ["GLOO_IFNAME", "collective_interface", "interface_of"]
