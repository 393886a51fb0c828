"""What the control plane decided that a user must know, from a job's event log: a round the
leader needed and could not form (and why), a node's worker processes failing at start (with
their error), and how the job ended and why. ``ftrain analyze`` and ``ftrain report`` list them;
``ftrain status`` shows the same from etcd while the job runs.

Events are untrusted input: every field is turned into bounded text, never trusted as a type.
"""

from __future__ import annotations

from typing import Any

from ftrain.contract.bounded_json import is_finite_number, printable
from ftrain.contract.events import Event

MAX_DECISIONS_SHOWN = 50  #: the newest decisions listed (a long stall repeats few, but logs are untrusted)


def decisions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the control plane decided that a user must know, oldest first (the newest
    :data:`MAX_DECISIONS_SHOWN`): each ``round_pending`` (a new round needed and not formed, and
    why), ``workers_failing`` (a node's worker processes exit before they are ready, with their
    error) and ``job_final`` (how the job ended, and why), as ``{"decision", "time", "node", "text"}``."""
    out = []
    for e in events:
        name, node = e.get("event"), _text(e.get("node", ""))[:100]
        if name == Event.ROUND_PENDING:
            text = f"leader {node}: new round needed for {_text(e.get('need'))}; not formed: {_text(e.get('why'))}"
        elif name == Event.WORKERS_FAILING:
            text = (
                f"{node}: {_text(e.get('exits'))} worker process(es) in a row exited before they were ready "
                f"(exit code {_text(e.get('exit_code'))}): {_text(e.get('error'))}"
            )
        elif name == Event.JOB_FINAL:
            text = f"job {_text(e.get('status'))} (decided by {node}): {_text(e.get('reason'))}"
        else:
            continue
        out.append({"decision": name, "time": event_time(e.get("time")), "node": node, "text": text})
    return out[-MAX_DECISIONS_SHOWN:]


def event_time(value: Any) -> float:
    """An event's time, if it is a number a float holds (logs are untrusted), else 0."""
    return float(value) if is_finite_number(value) else 0.0


def _text(value: Any) -> str:
    """A field as bounded, printable text, whatever it holds (an int too long for ``str``: a
    placeholder; a lone surrogate: its escape, so that printing it never raises)."""
    try:
        return printable(str(value)[:1000])
    except ValueError:
        return "?"
