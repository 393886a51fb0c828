"""Hosts as Linux network namespaces on one machine, so that a test can cut the network between them.

:class:`NetnsCluster` creates, as root, one bridge in the root namespace and, for each host, a
network namespace joined to the bridge by a veth pair: inside, the interface is ``eth0`` with
the host's own address in the benchmarking range (198.18.0.0/15, RFC 2544), never routed out of
the bridge; the root namespace gets ``.254`` on the bridge so the test itself can reach every
host. Processes run in a host with :meth:`NetnsCluster.run` (``ip netns exec``); each is
tracked and ended when the cluster closes.

Faults (what ``chaos`` partitions are made of):

- :meth:`cut` adds ``blackhole`` routes. The cut is *silent*: only the path back to the sender
  is blackholed, in the receiver's namespace, so packets leave, arrive and are never answered
  (TCP hangs, as across a failed switch) rather than failing fast with EINVAL, which is what a
  blackhole for locally sent packets gives. ``both=True`` also cuts the other direction; the
  receiver of the first cut then blackholes the sender too, so connections *it* opens fail at
  once (a loud partition: routes alone cannot make both directions silent).
- :meth:`isolate` takes a host's link off the bridge: nothing it sends arrives anywhere and
  nothing reaches it (silent, in every direction, the test's own address included), as when
  its switch port dies. :meth:`rejoin` puts it back.
- :meth:`limit` puts a token bucket (``tc ... tbf``) on the host's link: a degraded link.
  (Delay and loss are not here: this kernel has no ``netem``.)
- :meth:`heal` undoes one cut, :meth:`heal_all` every cut, isolation and limit.

Everything is removed in :meth:`NetnsCluster.close` (processes, namespaces with their veth ends,
the bridge), also after a failure half-way through creating it; names carry a per-cluster tag
so that clusters of concurrent tests never collide, and :func:`leftovers` lists anything of
ours that is still there. Linux interface names are at most 15 characters; the tag keeps ours
at 12.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: the benchmarking range's first /24: hosts get .1, .2, ..., the root namespace .254
DEFAULT_SUBNET = "198.18.0.0/24"
#: what every namespace, bridge and veth of ours starts with (see :func:`leftovers`)
PREFIX = "ftn"
ROOT_HOST = 254


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no ``ip``): the message says which."""


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be created on this machine, or None if they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def leftovers(tag: str = "") -> list[str]:
    """Namespaces and links of ours (``PREFIX`` + ``tag``) that exist now."""
    start = PREFIX + tag
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines()]
    return sorted(n for n in names + links if n.startswith(start))


@dataclass(frozen=True, slots=True)
class Host:
    name: str  #: the test's name for it ("a", "etcd0", ...)
    netns: str  #: the namespace's name
    address: str  #: its address on the bridge
    link: str  #: the root-namespace end of its veth pair (where a link limit goes)


class NetnsCluster:
    """Hosts in network namespaces on one bridge (see the module doc); a context manager."""

    def __init__(self, names: Sequence[str], *, subnet: str = DEFAULT_SUBNET):
        why = unavailable_reason()
        if why is not None:
            raise NetnsUnavailable(why)
        net = ipaddress.IPv4Network(subnet)
        if not net.subnet_of(ipaddress.IPv4Network("198.18.0.0/15")) or net.prefixlen > 24:
            raise ValueError(f"subnet {subnet}: use a /24 or larger inside 198.18.0.0/15 (the benchmarking range)")
        if len(set(names)) != len(names) or not names or len(names) >= ROOT_HOST:
            raise ValueError(f"host names must be unique, between 1 and {ROOT_HOST - 1}: {list(names)}")
        self.tag = uuid.uuid4().hex[:6]
        self.prefixlen = net.prefixlen
        self.bridge = f"{PREFIX}{self.tag}br"
        self.root_address = str(net.network_address + ROOT_HOST)
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        self._routes: set[tuple[str, str]] = set()  #: (namespace, blackholed address)
        self._limited: set[str] = set()
        self._isolated: set[str] = set()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.root_address}/{self.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                self._add_host(name, str(net.network_address + i), i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, address: str, index: int) -> None:
        netns, outer, inner = (
            f"{PREFIX}{self.tag}n{index}",
            f"{PREFIX}{self.tag}v{index}",
            f"{PREFIX}{self.tag}i{index}",
        )
        _ip("netns", "add", netns)
        self.hosts[name] = Host(name, netns, address, outer)  # before the links: close() removes the namespace
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", netns)
        _ip("-n", netns, "link", "set", inner, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{address}/{self.prefixlen}", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address(self, name: str) -> str:
        return self.hosts[name].address

    # -- processes ------------------------------------------------------------------------
    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside host ``name``."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def run(self, name: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``name``; ended (its process group) when the cluster closes."""
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(name, argv), **popen)
        self._procs.append(proc)
        return proc

    # -- faults ---------------------------------------------------------------------------
    def cut(self, a: str, b: str, *, both: bool = False) -> None:
        """Packets from ``a`` reach ``b`` but are never answered (``b`` blackholes its route back
        to ``a``); ``both``: ``b``'s packets to ``a`` meet the same fate."""
        self._blackhole(self.hosts[b].netns, self.address(a))
        if both:
            self._blackhole(self.hosts[a].netns, self.address(b))

    def isolate(self, name: str) -> None:
        """``name``'s link off the bridge: silent in every direction (see the module doc)."""
        _ip("link", "set", self.hosts[name].link, "nomaster")
        self._isolated.add(name)

    def rejoin(self, name: str) -> None:
        """Undo :meth:`isolate`."""
        _ip("link", "set", self.hosts[name].link, "master", self.bridge)
        self._isolated.discard(name)

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`cut` of ``a`` and ``b`` (both directions)."""
        self._unblackhole(self.hosts[b].netns, self.address(a))
        self._unblackhole(self.hosts[a].netns, self.address(b))

    def limit(self, name: str, rate: str = "1mbit") -> None:
        """A token-bucket bandwidth limit on ``name``'s link, towards it (``tc ... tbf``)."""
        link = self.hosts[name].link
        _tc("qdisc", "replace", "dev", link, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")
        self._limited.add(link)

    def unlimit(self, name: str) -> None:
        link = self.hosts[name].link
        _tc("qdisc", "del", "dev", link, "root", check=False)
        self._limited.discard(link)

    def heal_all(self) -> None:
        for name in sorted(self._isolated):
            self.rejoin(name)
        for netns, address in sorted(self._routes):
            self._unblackhole(netns, address)
        for link in sorted(self._limited):
            _tc("qdisc", "del", "dev", link, "root", check=False)
        self._limited.clear()

    def blackholed(self) -> set[tuple[str, str]]:
        """(host, address) pairs whose route is blackholed now, as the kernel says."""
        out = set()
        for host in self.hosts.values():
            for line in _ip("-n", host.netns, "route", "show", "type", "blackhole").stdout.splitlines():
                out.add((host.name, line.split()[1].split("/")[0]))
        return out

    def _blackhole(self, netns: str, address: str) -> None:
        _ip("-n", netns, "route", "replace", "blackhole", f"{address}/32")
        self._routes.add((netns, address))

    def _unblackhole(self, netns: str, address: str) -> None:
        _ip("-n", netns, "route", "del", "blackhole", f"{address}/32", check=False)
        self._routes.discard((netns, address))

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """End every process started here, then remove the namespaces, veths and the bridge."""
        for proc in self._procs:
            _end(proc)
        self._procs.clear()
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)  # takes its veth end, and so the pair, with it
            _ip("link", "del", host.link, check=False)  # in case the pair was never moved in
        _ip("link", "del", self.bridge, check=False)
        left = leftovers(self.tag)
        if left:
            log.error("network namespace cluster %s left %s behind", self.tag, left)


def _end(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s process group (it was started in a session of its own) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("process %d did not end after SIGKILL", proc.pid)


__all__ = ["DEFAULT_SUBNET", "Host", "NetnsCluster", "NetnsUnavailable", "leftovers", "unavailable_reason"]
