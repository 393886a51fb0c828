"""What a scenario asks of a fault (:class:`FaultSpec`) and what faults act on (:class:`Context`)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrain.chaos.cluster import Cluster
from ftrain.chaos.faults.registry import FAULTS, Fault
from ftrain.chaos.netns import NetnsCluster
from ftrain.chaos.s3proxy import S3FaultProxy
from ftrain.checkpoint.storage import Storage
from ftrain.contract import events as ev
from ftrain.contract.events import EventLog

log = logging.getLogger(__name__)


class FaultError(RuntimeError):
    """A fault could not be applied (its target never appeared): the scenario is at fault."""


@dataclass(slots=True)
class FaultSpec:
    """A kind (registered: an unknown one is refused here, naming the choices), a trigger
    (``at_step`` and/or ``at_time_s`` since the run began) and the kind's parameters."""

    kind: str
    at_step: int | None = None
    at_time_s: float | None = None
    node: str = ""  #: target node (default: a seeded choice among live ones)
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        FAULTS.get(self.kind)

    @property
    def fault(self) -> Fault:
        return FAULTS.get(self.kind)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultSpec:
        d = dict(d)
        known = {k: d.pop(k) for k in ("kind", "at_step", "at_time_s", "node") if k in d}
        return cls(**known, params=d)


@dataclass(slots=True)
class Context:
    """What faults act on."""

    cluster: Cluster
    etcd: Any  #: ftrain.testbed.etcd.EtcdServer (an EtcdCluster on network namespaces)
    s3: Any  #: ftrain.testbed.seaweed.SeaweedS3
    proxy: S3FaultProxy | None  #: None where S3 is reached directly (network namespaces)
    storage: Storage  #: the job's checkpoint root
    rng: random.Random
    events: EventLog
    started_at: float
    stop: Callable[[], bool] = lambda: False  #: the run is over: stop waiting for triggers
    net: NetnsCluster | None = None  #: the hosts' namespaces (None: everything on loopback)
    #: the nodes' memory-tier directory (the scenario's ``job.memory_tier``); None: snapshots stay in processes
    memory_dir: Path | None = None

    def need_proxy(self, kind: str) -> S3FaultProxy:
        """The S3 fault proxy; FaultError where S3 is not behind it."""
        if self.proxy is None:
            raise FaultError(f'{kind} needs the S3 fault proxy, which only network = "loopback" has')
        return self.proxy

    def need_net(self, kind: str) -> NetnsCluster:
        """The hosts' namespaces; FaultError on loopback, where nothing can be cut."""
        if self.net is None:
            raise FaultError(f'{kind} cuts the network between hosts: the scenario needs network = "netns"')
        return self.net

    def emit(self, kind: str, **detail: Any) -> dict[str, Any]:
        """Record the fault as a ``chaos_fault`` event (the time it acted, the kind, details)."""
        record = {"kind": kind, **detail}
        self.events.emit(ev.ChaosFault(kind=kind, detail=detail))
        log.warning("chaos: injected %s %s", kind, detail)
        return record
