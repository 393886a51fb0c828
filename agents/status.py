"""``ftrain status``: one read of a job's keys, shown as a table or as JSON.

It always prints: unreadable records are listed as warnings (``problems``) and skipped, as the
agents skip them; nodes whose workers keep failing to commit checkpoints are called out on a
line of their own (``CHECKPOINTS FAILING``); ranks that make no progress (each agent's
``stalled``) are judged together on a ``STALLED`` line: who is frozen, where the others wait,
and a desync when they wait in different collectives (:func:`ftrain.agents.flight_verdict.from_stalls`).

What must stay true: building the output is O(N) at N nodes (a 4,096-node job's keys read,
parsed and shown in well under 2 s: ``bench/lib/control_plane_micro.py`` times it without the
read); :func:`status_of` is what the command shows, whatever read the state.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from typing import Any

from ftrain.agents.etcd import EtcdClient, KeyValue
from ftrain.agents.flight_verdict import Stall, from_stalls
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.records import DumpRequest, JobState
from ftrain.agents.supervision import MAX_STALLS
from ftrain.contract.accounting import describe, summary

MAX_SHOWN_CHARS = 1000  #: of one text an agent put in its status (agents write at most 500; etcd allows MBs)
MAX_SHOWN_LINES = 100
MAX_DEVICES = 1 << 16  #: of one node's status (it is read from etcd)


def job_status(client: EtcdClient, job: str) -> dict[str, Any]:
    """The status of ``job`` from one read of its keys (what ``ftrain status`` shows)."""
    keys = JobKeys(job)
    listing = client.list_prefix(keys.prefix)
    return status_from_kvs(keys, listing.kvs, listing.revision, now=time.time())


def status_from_kvs(keys: JobKeys, kvs: list[KeyValue], revision: int, *, now: float) -> dict[str, Any]:
    """:func:`status_of` the job whose keys are ``kvs`` (one read at ``revision``)."""
    return status_of(JobState.parse(keys, kvs, revision), keys.job, now=now)


def status_of(state: JobState, job: str, *, now: float) -> dict[str, Any]:
    """The status dict of ``job`` in ``state`` at wall time ``now``: the job, then one entry per
    node that is live, a member of the current round or has a status record."""
    cur = state.current
    members = [m.node_id for m in cur.members] if cur else []
    node_rank = {node_id: k for k, node_id in enumerate(members)}  # one lookup per node: O(N), not O(N²)
    leading = state.status.get(state.leader) if state.leader else None  # what the leader decided
    waiting = leading.waiting if leading else {}
    nodes = []
    for node_id in sorted(set(state.nodes) | set(members) | set(state.status)):
        record, status = state.nodes.get(node_id), state.status.get(node_id)
        nodes.append(
            {
                "node": node_id,
                "live": record is not None,
                "member": node_id in node_rank,
                "node_rank": node_rank.get(node_id),
                "leader": node_id == state.leader,
                "host": record.host if record else (status.host if status else ""),
                "agent_pid": record.pid if record else None,
                "state": status.state if status else "",
                "worker_round": status.round if status else None,
                "step": status.step if status else None,
                "heartbeat_age_s": status.heartbeat_age_s if status else None,
                "status_age_s": round(now - status.updated_at, 1) if status else None,
                "restarts_seen": status.restarts if status else 0,
                "ckpt_failures": status.ckpt_failures if status else 0,
                "ckpt_failures_total": status.ckpt_failures_total if status else 0,
                "ckpt_error": status.ckpt_error[:MAX_SHOWN_CHARS] if status else "",
                "recovery": status.recovery if status else "",
                "workers_kept": status.workers_kept if status else 0,
                "workers_new": status.workers_new if status else 0,
                "hang_verdict": status.hang_verdict[:MAX_SHOWN_CHARS] if status else "",
                "busy_s": status.busy_s if status else 0.0,
                "productive_s": status.productive_s if status else 0.0,
                "lost_s": status.lost_s if status else 0.0,
                "device_hours": status.device_hours if status else {},
                "devices": status.devices if status else 0,
                "device_hour_price": status.device_hour_price if status else 0.0,
                "stragglers": [line[:MAX_SHOWN_CHARS] for line in status.stragglers[:MAX_SHOWN_LINES]]
                if status
                else [],
                "dump_nonce": status.dump_nonce if status else "",
                "dump_verdict": status.dump_verdict[:MAX_SHOWN_CHARS] if status else "",
                "stalled": [dataclasses.asdict(x) for x in status.stalled[:MAX_STALLS]] if status else [],
                "hang_dumped_round": status.hang_dumped_round if status else -1,
                "waiting_for": waiting.get(node_id, "")[:MAX_SHOWN_CHARS]
                if record is not None and node_id not in node_rank
                else "",
                "workers_error": status.workers_error[:MAX_SHOWN_CHARS] if status else "",
            }
        )
    committed = max(
        (s.committed_step for s in state.status.values()), default=state.final.committed_step if state.final else -1
    )
    return {
        "job": job,
        "revision": state.revision,
        "leader": state.leader,
        "round": state.round,
        "round_reason": cur.reason if cur else None,
        "world_size": cur.world_size if cur else 0,
        "members": members,
        "restarts_by_cause": cur.restarts_by_cause if cur else {},
        "restarts": sum(cur.restarts_by_cause.values()) if cur else 0,
        "last_committed_step": committed if committed >= 0 else None,
        "round_pending": leading.round_pending[:MAX_SHOWN_CHARS] if leading and state.final is None else "",
        "final": None
        if state.final is None
        else {
            "status": state.final.status,
            "reason": state.final.reason,
            "round": state.final.round,
            "time": state.final.time,
            "committed_step": state.final.committed_step,
        },
        "nodes": nodes,
        "accounting": device_time(nodes),
        "problems": [str(p) for p in state.problems],
    }


def device_time(nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's device time by cause: each node's (its agent's, published in its status) added
    up, in :func:`ftrain.contract.accounting.summary`'s shape, as ``ftrain report`` shows the
    same agents' ``device_time`` events; None before any node launched workers."""
    counted = [n for n in nodes if isinstance(n.get("devices"), int) and n["devices"] > 0 and n.get("device_hours")]
    if not counted:
        return None
    seconds: dict[str, float] = {}
    wall = 0.0
    for n in counted:
        hours = {c: h for c, h in n["device_hours"].items() if isinstance(h, (int, float)) and math.isfinite(h)}
        for cause, h in hours.items():
            seconds[cause] = seconds.get(cause, 0.0) + h * 3600
        wall = max(wall, sum(hours.values()) * 3600 / n["devices"])
    devices = sum(min(n["devices"], MAX_DEVICES) for n in counted)
    price = max(n.get("device_hour_price", 0.0) for n in counted)
    price = price if isinstance(price, (int, float)) and math.isfinite(price) and price > 0 else 0.0
    return summary(seconds, devices=devices, wall_s=wall, device_hour_price=price)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _recovery_text(node: dict[str, Any]) -> str:
    """How the node's workers entered their round: ``live: 2 kept, 1 new`` or ``restart``."""
    mode = node.get("recovery") or ""
    if mode == "live":
        return f"live: {node.get('workers_kept', 0)} kept, {node.get('workers_new', 0)} new"
    return mode


def format_status(s: dict[str, Any]) -> str:
    if s["final"]:
        head = f"job {s['job']}: {s['final']['status'].upper()} ({s['final']['reason']}) at round {s['final']['round']}"
    elif s["round"] and s.get("round_pending"):
        head = (
            f"job {s['job']}: round {s['round']} ({s['round_reason']}), world size {s['world_size']}, is to be "
            "replaced; the leader has not formed the next"
        )
    elif s["round"]:
        head = f"job {s['job']}: running round {s['round']} ({s['round_reason']}), world size {s['world_size']}"
    else:
        head = f"job {s['job']}: no round yet"
    restarts = ", ".join(f"{k} {v}" for k, v in sorted(s["restarts_by_cause"].items())) or "none"
    lines = [
        head,
        f"leader {s['leader'] or '-'}; members {', '.join(s['members']) or '-'}; "
        f"last committed step {_cell(s['last_committed_step'])}; restarts {s['restarts']} ({restarts})",
        "",
    ]
    cols = [
        ("node", "node"),
        ("live", "live"),
        ("rank", "node_rank"),
        ("leader", "leader"),
        ("host", "host"),
        ("state", "state"),
        ("round", "worker_round"),
        ("step", "step"),
        ("recovery", "recovery_text"),
        ("hb age s", "heartbeat_age_s"),
        ("status age s", "status_age_s"),
    ]
    nodes = [{**n, "recovery_text": _recovery_text(n)} for n in s["nodes"]]
    rows = [[name for name, _ in cols]] + [[_cell(n[key]) for _, key in cols] for n in nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if s.get("round_pending"):
        lines += ["", f"ROUND PENDING (leader {s['leader']}): {s['round_pending']}"]
    waits = [f"WAITING {n['node']}: {n['waiting_for']}" for n in s["nodes"] if n.get("waiting_for")]
    broken = [f"WORKERS FAILING on {n['node']}: {n['workers_error']}" for n in s["nodes"] if n.get("workers_error")]
    if waits or broken:
        lines += ["", *broken, *waits]
    failing = [n for n in s["nodes"] if n.get("ckpt_failures")]
    if failing:
        lines.append("")
        lines += [
            f"CHECKPOINTS FAILING on {n['node']}: {n['ckpt_failures']} commit(s) in a row failed "
            f"({n.get('ckpt_failures_total', 0)} in all); last error: {n.get('ckpt_error') or '-'}"
            for n in failing
        ]
    if s.get("accounting"):
        lines += ["", describe(s["accounting"])]
    stragglers = [line for n in s["nodes"] if n.get("leader") for line in n.get("stragglers", [])]
    if stragglers:
        lines.append("")
        lines += [f"STRAGGLER {line}" for line in stragglers]
    stalled = stalled_line(s)
    if stalled:
        lines.append("")
        lines.append(stalled)
    hangs = [n for n in s["nodes"] if n.get("hang_verdict")]
    if hangs:
        lines.append("")
        lines += [f"last hang seen by {n['node']}, {n['hang_verdict']}" for n in hangs]
    if s.get("dump"):
        lines.append("")
        for n in s["nodes"]:
            if n.get("dump_nonce") == s["dump"]:
                lines.append(f"dump by {n['node']}, {n['dump_verdict']}")
            elif n["live"]:
                lines.append(f"dump by {n['node']}: no answer within {s['dump_timeout_s']:.0f} s")
    if s.get("problems"):
        lines.append("")
        lines += [f"warning: {p} (skipped)" for p in s["problems"]]
    return "\n".join(lines)


def stalled_line(s: dict[str, Any]) -> str:
    """``STALLED ...``: the ranks of the current round that make no progress, judged together
    (empty while every rank moves). Each node's list is its agent's (bounded, untrusted)."""
    stalls, where = [], {}
    for n in s["nodes"]:
        if not n.get("live") or n.get("worker_round") != s.get("round"):
            continue
        for raw in n.get("stalled", [])[:MAX_STALLS]:
            try:
                stall = Stall(**{f.name: raw[f.name] for f in dataclasses.fields(Stall) if f.name in raw})
            except TypeError:
                continue
            stalls.append(stall)
            where[stall.rank] = f"node {n['node']}, host {n['host']}" if n.get("host") else f"node {n['node']}"
    if not stalls:
        return ""
    return f"STALLED in round {s['round']}: {from_stalls(stalls, now=time.time(), where=where).line}"


def request_dump(client: EtcdClient, job: str, *, timeout_s: float) -> dict[str, Any]:
    """``ftrain status --dump``: ask every agent of ``job`` to dump its workers' flight records
    and stacks into its event log (a ``dumped`` event), wait up to ``timeout_s`` for every live
    node to say it did, and return the job's status with their verdicts."""
    nonce = secrets.token_hex(8)
    client.put(JobKeys(job).dump, DumpRequest(nonce=nonce, time=time.time()).to_json())
    deadline = time.monotonic() + timeout_s
    while True:
        s = job_status(client, job)
        pending = [n for n in s["nodes"] if n["live"] and n["dump_nonce"] != nonce]
        if not pending or time.monotonic() > deadline:
            return {**s, "dump": nonce, "dump_timeout_s": timeout_s}
        time.sleep(0.2)  # polling etcd at 5 Hz, bounded by the deadline


def status_main(
    endpoints: list[str],
    job: str,
    *,
    as_json: bool,
    client_options: dict[str, Any] | None = None,
    dump_timeout_s: float | None = None,
) -> int:
    """``dump_timeout_s``: ask for a dump first (``--dump``) and wait this long for the answers."""
    JobKeys(job)  # a bad job id: ValueError naming --job before any request
    options = {k: v for k, v in (client_options or {}).items() if v is not None}
    with EtcdClient(endpoints, timeout_s=2.0, retry_timeout_s=3.0, **options) as client:
        s = job_status(client, job) if dump_timeout_s is None else request_dump(client, job, timeout_s=dump_timeout_s)
    if not s["nodes"] and not s["round"] and s["final"] is None and not s["problems"]:
        print(f"job {job!r}: nothing in etcd at {', '.join(endpoints)} (no agent has joined it)")
        return 1
    print(json.dumps(s, indent=2) if as_json else format_status(s))
    return 0
