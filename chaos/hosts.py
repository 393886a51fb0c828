"""Where a chaos run's servers and nodes live: all on loopback, or each on a host of its own.

- ``loopback`` (the default): one etcd and one SeaweedFS on 127.0.0.1 (:class:`ftrain.testbed.stack.LocalStack`)
  with the S3 fault proxy in front of it, every agent on loopback.
- ``netns``: every host a network namespace of :class:`ftrain.chaos.netns.NetnsCluster`: a 3-member
  etcd cluster (``etcd0``..``etcd2``), SeaweedFS (``s3``) and one per node, each on its own
  address; agents are started there with ``--host`` their own address (their workers then use it
  for the master address and gloo's interface). The nodes reach S3 directly, so the S3 fault
  proxy is not on the path: the partition faults act on the network instead.

Both are context managers that remove everything they started, namespaces included.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ftrain.chaos.netns import NetnsCluster
from ftrain.chaos.s3proxy import S3FaultProxy
from ftrain.testbed.etcd import EtcdCluster
from ftrain.testbed.seaweed import SeaweedS3
from ftrain.testbed.stack import LocalStack

#: The network layouts a scenario's ``job.network`` may name.
NETWORKS = ("loopback", "netns")
#: The hosts of the ``netns`` layout that are not nodes.
ETCD_HOSTS = ("etcd0", "etcd1", "etcd2")
S3_HOST = "s3"


class Hosts:
    """The servers of a run and where each node's agent runs."""

    etcd: Any  #: what etcd faults act on (an EtcdServer or an EtcdCluster)
    s3: SeaweedS3
    proxy: S3FaultProxy | None  #: the S3 fault proxy in front of S3 (None: not on the path)
    net: NetnsCluster | None  #: the namespaces (None on loopback)
    etcd_endpoints: str  #: comma-separated, as ``--etcd`` takes them

    def __init__(self) -> None:
        self._stack = ExitStack()

    def env(self) -> dict[str, str]:
        """What points a worker at S3 (through the proxy where there is one)."""
        env = self.s3.env()
        if self.proxy is not None:
            env["AWS_ENDPOINT_URL"] = self.proxy.endpoint_url
        return env

    def placement(self, node: str) -> dict[str, Any]:
        """``host`` and ``launcher`` for :meth:`ftrain.chaos.cluster.Cluster.start` (empty on loopback)."""
        if self.net is None:
            return {}
        return {"host": self.net.address(node), "launcher": tuple(self.net.command(node, []))}

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


class LoopbackHosts(Hosts):
    def __init__(self, base_dir: Path, seed: int):
        super().__init__()
        try:
            stack = self._stack.enter_context(LocalStack(base_dir))
            self.s3 = stack.s3_server()
            self.proxy = self._stack.enter_context(S3FaultProxy(self.s3.endpoint_url, seed=seed))
        except BaseException:
            self._stack.close()
            raise
        self.etcd, self.net, self.etcd_endpoints = stack.etcd, None, stack.etcd_url


class NetnsHosts(Hosts):
    def __init__(self, base_dir: Path, nodes: Sequence[str]):
        super().__init__()
        try:
            net = self._stack.enter_context(NetnsCluster([*ETCD_HOSTS, S3_HOST, *nodes]))
            etcd = EtcdCluster(hosts=[(net.address(h), tuple(net.command(h, []))) for h in ETCD_HOSTS])
            self._stack.callback(etcd.close)
            etcd.start().wait_ready(30)
            s3 = SeaweedS3(base_dir / "s3", host=net.address(S3_HOST), launcher=tuple(net.command(S3_HOST, [])))
            self._stack.callback(s3.close)
            s3.start().wait_ready(60)
        except BaseException:
            self._stack.close()
            raise
        self.net, self.etcd, self.s3, self.proxy = net, etcd, s3, None
        self.etcd_endpoints = ",".join(etcd.endpoints)


def open_hosts(network: str, base_dir: Path, nodes: Sequence[str], seed: int) -> Hosts:
    """The run's hosts for ``network`` (one of :data:`NETWORKS`), started."""
    if network == "netns":
        return NetnsHosts(base_dir, nodes)
    if network == "loopback":
        return LoopbackHosts(base_dir, seed)
    raise ValueError(f"network {network!r}: one of {', '.join(NETWORKS)}")
