"""``ftrain analyze EVENTS_OR_RUN_DIR``: who is at fault in each hang, from the flight records
the agents collected (and the ones failing workers wrote) in the event log, and what the
control plane decided that stopped or stalled the job (:func:`decisions`: a round the leader
needed and could not form, worker processes that could not start, the job's end and why).

A run directory is searched for ``events*.jsonl`` files (every node's, when each keeps its own);
their events are merged by round, so the verdict of a round sees every rank that any node
recorded. Prints one block per round: the verdict (the ranks at fault with their node and host,
the collective by number and op, the ranks waiting in it), then where each rank was, on which
node. Node hosts come from the agents' ``node_host`` events, ranks' nodes from the ``hang``
events that carry their records and from the workers' ``worker_started``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ftrain.agents.flight_verdict import RoundEvidence, from_events
from ftrain.contract import exits
from ftrain.contract.events import read_jsonl
from ftrain.observability.decisions import decisions, event_time


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="name the culprit of each hang from the flight records in an event log")
    p.add_argument("path", help="an events JSON-lines file, or a run directory holding events*.jsonl files")
    p.add_argument("--json", action="store_true", help="one JSON object per round instead of text")
    p.set_defaults(func=_analyze)


def event_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("events*.jsonl") if p.is_file())


def _analyze(args: argparse.Namespace, overrides: list[str]) -> int:
    path = Path(args.path)
    if not path.exists():
        print(f"ftrain analyze: {path} does not exist (give an events file or a run directory)", file=sys.stderr)
        return exits.USAGE
    files = event_files(path)
    if not files:
        print(f"ftrain analyze: no events*.jsonl under {path}", file=sys.stderr)
        return exits.USAGE
    events = sorted((e for f in files for e in read_jsonl(f)), key=lambda e: event_time(e.get("time")))
    rounds = from_events(events)
    decided = decisions(events)
    if args.json:
        for evidence in rounds:
            print(json.dumps(as_dict(evidence)))
        for decision in decided:
            print(json.dumps(decision))
        return exits.OK
    blocks = [describe(evidence) for evidence in rounds]
    if decided:
        blocks.append("\n".join(["decisions:", *(f"  {_clock(d['time'])} {d['text']}" for d in decided)]))
    if not rounds:
        blocks.insert(0, f"no hang or failing worker recorded in {', '.join(map(str, files))}")
    print("\n\n".join(blocks))
    return exits.OK


def _clock(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def as_dict(evidence: RoundEvidence) -> dict[str, Any]:
    v = evidence.verdict()
    return {
        "round": evidence.round,
        "kind": v.kind,
        "verdict": v.line,
        "ranks": v.ranks,
        "seq": v.seq,
        "group": v.group,
        "waiting": v.waiting,
        "waited_s": round(v.waited_s, 3),
        "frozen": sorted(evidence.frozen),
        "missing": {str(r): why for r, why in sorted(evidence.missing.items())},
        "nodes": evidence.nodes,
        "where": {str(r): place for r, place in sorted(evidence.where().items())},
        "problems": evidence.problems,
    }


def describe(evidence: RoundEvidence) -> str:
    """The verdict, then each rank's newest collective per group (and why a rank has none)."""
    v = evidence.verdict()
    where = evidence.where()
    lines = [f"round {evidence.round}: {v.line}"]
    lines += [f"  reported by {why}" for why in evidence.whys]
    for rank in sorted(set(evidence.records) | set(evidence.missing)):
        record = evidence.records.get(rank)
        at = f" ({where[rank]})" if rank in where else ""
        if record is None:
            lines.append(f"  rank {rank}{at}: no record ({evidence.missing[rank]})")
            continue
        newest = {}
        for entry in record.entries:
            newest[entry.group] = entry
        state = " (frozen)" if rank in evidence.frozen else ""
        shown = (
            "; ".join(f"{e.describe()} {'done' if e.done else 'IN FLIGHT'}" for _, e in sorted(newest.items()))
            or "no collective recorded"
        )
        lines.append(f"  rank {rank}{at}{state}: {shown}")
    lines += [f"  warning: {p} (skipped)" for p in evidence.problems]
    return "\n".join(lines)
