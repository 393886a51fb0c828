"""The checkpoint fence of a worker started by an agent: commit only while our round is current.

The agent passes ``FTRAIN_ETCD`` (client URLs), ``FTRAIN_FENCE_KEY`` (the job's ``round`` key)
and ``FTRAIN_ROUND``. Before the manifest is written, :meth:`EtcdRoundFence.check` runs an etcd
transaction that succeeds only if the key still holds our round; otherwise, or when no etcd
member answers, it raises :class:`~checkpoint.errors.StaleRoundError` and nothing is committed
(training goes on; the save is reported as failed). The leader moves the key forward before any
agent starts the next round's workers, so a worker of an old round — a zombie on a partitioned
host — cannot publish a checkpoint the new round might load.

This speaks the etcd v3 JSON gateway with the standard library alone: one request per commit,
and the worker stays free of the agent's packages.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request

from checkpoint.errors import StaleRoundError

TIMEOUT_S = 3.0


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdRoundFence:
    def __init__(self, endpoints: list[str], key: str, *, timeout_s: float = TIMEOUT_S):
        if not endpoints:
            raise ValueError("EtcdRoundFence needs at least one etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.key = key
        self.timeout_s = timeout_s

    def check(self, round_: int) -> None:
        body = json.dumps({"compare": [{"key": _b64(self.key), "target": "VALUE", "result": "EQUAL",
                                        "value": _b64(str(round_))}],
                           "success": [], "failure": []}).encode()
        errors = []
        for endpoint in self.endpoints:
            request = urllib.request.Request(f"{endpoint}/v3/kv/txn", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    answer = json.load(reply)
            except (urllib.error.URLError, OSError, ValueError) as e:
                errors.append(f"{endpoint}: {e}")
                continue
            if answer.get("succeeded"):
                return
            raise StaleRoundError(f"round {round_} is no longer current ({self.key} moved on): "
                                  "this worker belongs to an old round and may not commit")
        raise StaleRoundError(f"cannot confirm round {round_} is current, etcd unreachable "
                              f"({'; '.join(errors)}): commit refused")


def from_env() -> EtcdRoundFence | None:
    endpoints = [e for e in os.environ.get("FTRAIN_ETCD", "").split(",") if e]
    key = os.environ.get("FTRAIN_FENCE_KEY", "")
    if not endpoints or not key:
        return None
    return EtcdRoundFence(endpoints, key)
