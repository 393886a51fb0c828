"""What the control-plane benchmark measures, and how: CPU of processes from ``/proc``, etcd's
own request and byte counters from its ``/metrics``, and when keys changed (a watch).

What must stay true:

- etcd traffic is measured **server side**: the deltas over a window of etcd's counters
  ``grpc_server_msg_received_total`` (every request message the server took: a unary call is
  one, each message on a stream is one), ``grpc_server_msg_sent_total``,
  ``etcd_network_client_grpc_received_bytes_total`` and ``..._sent_bytes_total``. The agents
  speak etcd's HTTP/JSON gateway, which etcd serves by calling its own gRPC server, so these
  count every agent request once, in protobuf bytes (the JSON on the loopback socket is larger);
- CPU is ``utime + stime`` of whole processes (every thread), in core-seconds;
- a watch records the time an event *arrived* in this process (``time.monotonic``), so two
  events are compared on one clock.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_METHOD = re.compile(r'grpc_method="([^"]+)"')


def cpu_s(pid: int) -> float | None:
    """Core-seconds ``pid`` has used (every thread), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class EtcdCounters:
    """One scrape of etcd's ``/metrics``: the counters this benchmark takes deltas of."""

    at: float  #: monotonic time of the scrape
    received_msgs: dict[str, float] = field(default_factory=dict)  #: gRPC method -> messages taken
    sent_msgs: dict[str, float] = field(default_factory=dict)  #: gRPC method -> messages sent
    rx_bytes: float = 0.0
    tx_bytes: float = 0.0
    cpu_s: float = 0.0  #: etcd's process_cpu_seconds_total


def scrape(endpoint: str, timeout_s: float = 10.0) -> EtcdCounters:
    """The counters at ``endpoint``/metrics (etcd serves them on its client URL)."""
    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    counters = EtcdCounters(at=time.monotonic())
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in ("grpc_server_msg_received_total", "grpc_server_msg_sent_total"):
            method = _METHOD.search(labels)
            into = counters.received_msgs if name.endswith("received_total") else counters.sent_msgs
            key = method.group(1) if method else "?"
            into[key] = into.get(key, 0.0) + value
        elif name == "etcd_network_client_grpc_received_bytes_total":
            counters.rx_bytes = value
        elif name == "etcd_network_client_grpc_sent_bytes_total":
            counters.tx_bytes = value
        elif name == "process_cpu_seconds_total":
            counters.cpu_s = value
    return counters


def etcd_rates(before: EtcdCounters, after: EtcdCounters) -> dict:
    """Per-second rates between two scrapes (requests by gRPC method too)."""
    window_s = after.at - before.at
    by_method = {
        m: round((after.received_msgs.get(m, 0.0) - before.received_msgs.get(m, 0.0)) / window_s, 2)
        for m in sorted(after.received_msgs)
    }
    sent = sum(after.sent_msgs.values()) - sum(before.sent_msgs.values())
    return {
        "window_s": round(window_s, 3),
        "requests_per_s": round(sum(by_method.values()), 2),
        "requests_per_s_by_method": {m: r for m, r in by_method.items() if r},
        "messages_sent_per_s": round(sent / window_s, 2),
        "rx_bytes_per_s": round((after.rx_bytes - before.rx_bytes) / window_s, 1),
        "tx_bytes_per_s": round((after.tx_bytes - before.tx_bytes) / window_s, 1),
        "cpu_core_per_s": round((after.cpu_s - before.cpu_s) / window_s, 4),
    }


def cpu_snapshot(pids: Iterable[int]) -> dict[int, float]:
    return {pid: s for pid in pids if (s := cpu_s(pid)) is not None}


def cpu_rates(before: dict[int, float], after: dict[int, float], window_s: float) -> dict[int, float]:
    """pid -> cores used over the window (processes alive at both ends)."""
    return {pid: (after[pid] - before[pid]) / window_s for pid in before if pid in after}


class KeyTimes:
    """When each put of some keys arrived here (a single-key watch per key), on this process's
    monotonic clock: ``puts[key]`` is a list of ``(arrived_at, value)``."""

    def __init__(self, client, keys: Iterable[str], *, progress_timeout_s: float = 5.0):
        from ftrain.agents.etcd_watch import Watcher  # the bench's own tree (today's)

        self.puts: dict[str, list[tuple[float, bytes]]] = {k: [] for k in keys}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watchers = [
            Watcher(
                client,
                key,
                single_key=True,
                on_event=self._on_event,
                on_error=lambda _e: None,
                progress_timeout_s=progress_timeout_s,
            )
            for key in self.puts
        ]
        for w in self._watchers:  # from now on no put is missed
            w.wait_connected(progress_timeout_s)

    def _on_event(self, event) -> None:
        arrived_at = time.monotonic()
        if event.type != "put":
            return
        with self._changed:
            self.puts.setdefault(event.key, []).append((arrived_at, event.value))
            self._changed.notify_all()

    def first_put_after(self, key: str, after: float, timeout_s: float) -> tuple[float, bytes] | None:
        """The first put of ``key`` that arrived after ``after`` (monotonic), waiting up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for arrived_at, value in self.puts.get(key, []):
                    if arrived_at > after:
                        return arrived_at, value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def close(self) -> None:
        for w in self._watchers:
            w.close()


__all__ = ["EtcdCounters", "KeyTimes", "cpu_rates", "cpu_s", "cpu_snapshot", "etcd_rates", "rss_bytes", "scrape"]
