"""Who is at fault, from the ranks' flight records: a pure function of the records, the ranks
known to be frozen and the time (the agent puts its answer in the ``hang`` event, ``ftrain
status`` shows it, ``ftrain analyze`` recomputes it over every node's records).

:func:`analyze` looks for, in this order:

1. **a desync**: two ranks of one group that recorded different collectives (op, sizes or
   dtypes) under the same sequence number: the program diverged there, and whatever hangs
   after it is a consequence; or ranks that wait in *different* collectives, each for ranks
   that wait in another one (none frozen): a cross wait no rank can leave (one rank's
   background thread in one group's collective while its main thread waits for that thread,
   its peers in another group's);
2. **a culprit**: the collective that ranks have waited in longest; the members of its group
   that never entered it (or gave no record, or are frozen: a stopped process cannot answer)
   are at fault, the others are shown waiting in it; when every member entered it, a frozen
   member is at fault, and with none frozen the verdict says the collective itself is stuck;
3. with nothing in flight, **the slowest rank**: the one that arrived last at most of the
   group's recent collectives (by how much, on average).

Ranks at fault are named with where they run (``where``: rank -> "node b, host 10.0.0.2"), when
it is known. :func:`from_stalls` judges what the agents publish in their status instead (each
stalled rank's oldest collective in flight, or that it is frozen): the round-wide view of
``ftrain status``, and of an agent's own verdict while only its own workers' records are at hand.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftrain.contract.bounded_json import printable
from ftrain.contract.events import Dumped, FlightRecorded, Hang, NodeHost, WorkerStarted, parse
from ftrain.contract.flight import Collective, FlightRecord

DESYNC = "desync"
CULPRIT = "culprit"
STUCK = "stuck"  #: every member is inside the collective, none frozen: the backend or network
SLOWEST = "slowest"
NONE = "none"
SLOWEST_WINDOW = 20  #: recent collectives of a group compared for the slowest rank
#: in records taken on request, a collective entered this recently is a running job's, not a hang
REQUESTED_MIN_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str  #: desync | culprit | stuck | slowest | none
    line: str  #: the verdict in one line
    ranks: list[int] = field(default_factory=list)  #: the ranks at fault
    seq: int = -1  #: the collective's sequence number in its group
    group: str = ""
    waiting: list[int] = field(default_factory=list)  #: ranks inside that collective, waiting
    waited_s: float = 0.0  #: how long the longest waiter has been in it


def analyze(
    records: dict[int, FlightRecord],
    *,
    frozen: Iterable[int] = (),
    missing: Iterable[int] = (),
    now: float | None = None,
    min_wait_s: float = 0.0,
    where: Mapping[int, str] | None = None,
) -> Verdict:
    """``records``: global rank -> its record; ``frozen``: ranks known to be stopped;
    ``missing``: ranks asked that gave no record; ``now``: when waits are measured up to (by
    default, when the newest record was taken); ``min_wait_s``: shorter waits are a running
    job's normal collectives, not a hang (records taken on request); ``where``: rank -> where it
    runs (named beside the ranks at fault)."""
    if now is None:
        now = max((r.taken_at for r in records.values()), default=0.0)
    who = _Who(where or {})
    frozen_set, missing_set = set(frozen), set(missing) - set(records)
    usable = {r: rec for r, rec in records.items() if rec.available}
    if not usable:
        if frozen_set:
            line = f"{who(frozen_set)} {'is' if len(frozen_set) == 1 else 'are'} frozen (no flight record here)"
            return Verdict(CULPRIT, line, sorted(frozen_set))
        why = "no rank kept a flight record (logging.flight_recorder_entries = 0, or the backend keeps none)"
        return Verdict(NONE, why)
    by_group = _by_group(usable)
    return (
        _desync(by_group, who)
        or _hang(by_group, set(usable), _members(usable), frozen_set, missing_set, now, now - min_wait_s, who)
        or _slowest(by_group, who)
        or Verdict(NONE, "no collective in flight and too few completed ones to compare", sorted(frozen_set))
    )


class _Who:
    """Ranks as a verdict names them: ``rank 1 (node b, host 10.0.0.2)`` where that is known."""

    def __init__(self, where: Mapping[int, str]):
        self.where = where

    def __call__(self, ranks: Iterable[int]) -> str:
        ranks = sorted(ranks)
        places = [f"rank {r}: {self.where[r]}" if len(ranks) > 1 else self.where[r] for r in ranks if r in self.where]
        return _ranks(ranks) + (f" ({'; '.join(places)})" if places else "")


def _by_group(records: dict[int, FlightRecord]) -> dict[str, dict[int, dict[int, Collective]]]:
    """group -> rank -> seq -> collective."""
    out: dict[str, dict[int, dict[int, Collective]]] = {}
    for rank, record in records.items():
        for entry in record.entries:
            out.setdefault(entry.group, {}).setdefault(rank, {})[entry.seq] = entry
    return out


def _members(records: dict[int, FlightRecord]) -> dict[str, set[int]]:
    members: dict[str, set[int]] = {}
    for rank, record in records.items():
        for name, ranks in record.groups.items():
            members.setdefault(name, set()).update(ranks)
        for entry in record.entries:
            members.setdefault(entry.group, set()).add(rank)
    return members


def _desync(by_group: dict[str, dict[int, dict[int, Collective]]], who: _Who) -> Verdict | None:
    found: list[tuple[float, Verdict]] = []
    for group, ranks in by_group.items():
        for seq in sorted({s for entries in ranks.values() for s in entries}):
            seen = {rank: entries[seq] for rank, entries in ranks.items() if seq in entries}
            kinds: dict[tuple[str, ...], list[int]] = {}
            for rank, entry in sorted(seen.items()):
                kinds.setdefault(entry.signature(), []).append(rank)
            if len(kinds) < 2:
                continue
            parts = sorted(kinds.values(), key=lambda rs: (-len(rs), rs))
            shown = "; ".join(f"{who(rs)} ran {seen[rs[0]].what()}" for rs in parts)
            if len(parts[0]) > len(parts[1]):  # the minority diverged
                odd, note = sorted(r for rs in parts[1:] for r in rs), ""
            else:  # no majority to tell the diverged ones from the others
                odd, note = sorted(seen), " (no majority: any of them may have diverged)"
            shown += note
            when = min(e.enqueued_s for e in seen.values())
            found.append(
                (when, Verdict(DESYNC, f"desync at collective #{seq} on group {group}: {shown}", odd, seq, group))
            )
            break
    return min(found, key=lambda f: f[0])[1] if found else None


def _hang(
    by_group: dict[str, dict[int, dict[int, Collective]]],
    recorded_ranks: set[int],
    members: dict[str, set[int]],
    frozen: set[int],
    missing: set[int],
    now: float,
    waiting_since: float,
    who: _Who,
) -> Verdict | None:
    """The collective waited in longest (entered before ``waiting_since``), and who keeps its
    group waiting."""
    oldest: tuple[float, str, int] | None = None
    for group, ranks in by_group.items():
        for entries in ranks.values():
            for entry in entries.values():
                if entry.done or entry.enqueued_s > waiting_since:
                    continue
                if oldest is None or entry.enqueued_s < oldest[0]:
                    oldest = (entry.enqueued_s, group, entry.seq)
    if oldest is None:
        return None
    since, group, seq = oldest
    ranks = by_group[group]
    waiting = sorted(r for r, entries in ranks.items() if seq in entries and not entries[seq].done)
    entered = {r for r, entries in ranks.items() if seq in entries}
    example = ranks[waiting[0]][seq]
    waited_s = max(0.0, now - since)
    inside = f"collective {example.describe()}, in which {_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''}"
    inside += f" for {waited_s:.1f} s"
    recorded = set(ranks) | {r for r in members.get(group, set()) if r in recorded_ranks}
    absent = sorted(r for r in recorded if r not in entered)
    unseen = sorted((members.get(group, set()) | missing) - recorded - entered)
    if absent:  # their own records say they never got there
        crossed = _cross_wait(by_group, members, (group, seq), waiting, absent, frozen | missing, now, who)
        if crossed is not None:
            return crossed
        notes = "; ".join(n for n in (_state(r, frozen, missing) for r in absent + unseen) if n)
        line = f"{who(absent)} never entered {inside}" + (f" ({notes})" if notes else "")
        return Verdict(CULPRIT, line, absent, seq, group, waiting, waited_s)
    stopped = sorted(r for r in entered | set(unseen) if r in frozen)
    if stopped:
        place = "inside" if set(stopped) <= entered else "(no record of it here) and not seen in"
        line = f"{who(stopped)} {'is' if len(stopped) == 1 else 'are'} frozen {place} {inside}"
        return Verdict(CULPRIT, line, stopped, seq, group, [r for r in waiting if r not in frozen], waited_s)
    if unseen:  # no record of theirs here: the only members not seen in it
        notes = "; ".join(n for n in (_state(r, frozen, missing) for r in unseen) if n) or "no record of theirs here"
        line = f"{who(unseen)} not seen in {inside} ({notes})"
        return Verdict(CULPRIT, line, unseen, seq, group, waiting, waited_s)
    line = f"every member of group {group} entered {inside}: the collective itself is stuck (backend or network)"
    return Verdict(STUCK, line, [], seq, group, waiting, waited_s)


def _cross_wait(
    by_group: dict[str, dict[int, dict[int, Collective]]],
    members: dict[str, set[int]],
    oldest: tuple[str, int],
    waiting: list[int],
    absent: list[int],
    unknown: set[int],
    now: float,
    who: _Who,
) -> Verdict | None:
    """A desync of another kind: the ranks that never entered the oldest collective wait in
    collectives of their own, and each of those waits only for ranks that wait somewhere too
    (none frozen, none without a record): nobody can move. None when it is not that."""
    involved = set(waiting) | set(absent)
    if involved & unknown:
        return None
    inside: dict[tuple[str, int], list[int]] = {oldest: list(waiting)}
    for rank in absent:
        own = [(e.enqueued_s, g, e.seq) for g, ranks in by_group.items() for e in ranks.get(rank, {}).values()]
        pending = sorted(t for t in own if not by_group[t[1]][rank][t[2]].done)
        if not pending:
            return None  # it waits in no collective: it is elsewhere (the culprit)
        _, g, seq = pending[0]
        entered = {r for r, entries in by_group[g].items() if seq in entries}
        if not members.get(g, entered) - entered <= involved:
            return None  # that collective waits for a rank that is not stuck in one
        inside.setdefault((g, seq), []).append(rank)
    if len(inside) < 2:
        return None
    parts = []
    for (g, seq), ranks in sorted(inside.items(), key=lambda kv: min(kv[1])):
        example = by_group[g][ranks[0]][seq]
        parts.append(f"{who(ranks)} in {example.describe()} for {max(0.0, now - example.enqueued_s):.1f} s")
    group, seq = oldest
    line = f"desync: the ranks wait in different collectives, each for ranks waiting in another: {'; '.join(parts)}"
    since = by_group[group][waiting[0]][seq].enqueued_s
    return Verdict(DESYNC, line, sorted(absent), seq, group, list(waiting), max(0.0, now - since))


def _slowest(by_group: dict[str, dict[int, dict[int, Collective]]], who: _Who) -> Verdict | None:
    """The rank that arrived last at most of the newest collectives every recorded rank completed."""
    found: list[tuple[float, Verdict]] = []
    for group, ranks in sorted(by_group.items()):
        if len(ranks) < 2:
            continue
        common = sorted(set.intersection(*(set(entries) for entries in ranks.values())))[-SLOWEST_WINDOW:]
        if not common:
            continue
        last: Counter[int] = Counter()
        late_s: dict[int, float] = {}
        for seq in common:
            arrivals = {r: entries[seq].enqueued_s for r, entries in ranks.items()}
            rank = max(arrivals, key=lambda r: (arrivals[r], -r))
            last[rank] += 1
            late_s[rank] = late_s.get(rank, 0.0) + arrivals[rank] - min(arrivals.values())
        rank, count = last.most_common(1)[0]
        line = (
            f"no collective in flight; slowest: {who([rank])}, last to arrive at {count} of the {len(common)} newest "
            f"collectives on group {group}, by {late_s[rank] / count:.3f} s on average"
        )
        found.append((count / len(common), Verdict(SLOWEST, line, [rank], common[-1], group)))
    return max(found, key=lambda f: f[0])[1] if found else None


def _state(rank: int, frozen: set[int], missing: set[int]) -> str:
    if rank in frozen:
        return f"rank {rank} is frozen" + (": it gave no record" if rank in missing else "")
    if rank in missing:
        return f"rank {rank} gave no record"
    return ""


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


@dataclass(slots=True)
class RoundEvidence:
    """Every node's flight records of one round, merged from the event log."""

    round: int
    records: dict[int, FlightRecord] = field(default_factory=dict)
    missing: dict[int, str] = field(default_factory=dict)
    frozen: set[int] = field(default_factory=set)
    nodes: list[str] = field(default_factory=list)  #: the agents that reported a hang in it
    whys: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  #: records refused (untrusted input)
    hung: bool = False  #: False: only dumps on request, taken while the job ran
    node_of: dict[int, str] = field(default_factory=dict)  #: global rank -> the node it ran on in this round
    hosts: dict[str, str] = field(default_factory=dict)  #: node -> its host (as its agent said: node_host)

    def where(self) -> dict[int, str]:
        """rank -> ``node b, host 10.0.0.2`` (``node b`` alone when its host is not known)."""
        return {r: _place(node, self.hosts.get(node, "")) for r, node in self.node_of.items()}

    def verdict(self) -> Verdict:
        return analyze(
            self.records,
            frozen=self.frozen,
            missing=self.missing,
            min_wait_s=0.0 if self.hung else REQUESTED_MIN_WAIT_S,
            where=self.where(),
        )


def _place(node: str, host: str) -> str:
    return f"node {node}, host {host}" if host else f"node {node}"


def from_events(events: Iterable[dict[str, Any]]) -> list[RoundEvidence]:
    """The evidence of every round with a ``hang`` or ``flight_recorded`` event, by round: each
    rank's newest record wins (a node that dumped after another saw the later state)."""
    rounds: dict[int, RoundEvidence] = {}
    hosts: dict[str, str] = {}  #: node -> its address, the newest node_host event's (agents say it as they register)
    started: dict[int, dict[int, str]] = {}  #: round -> rank -> node, from the workers' worker_started

    def take(evidence: RoundEvidence, rank: int, raw: Any, where: str) -> None:
        try:
            record = FlightRecord.decode(raw)
        except ValueError as e:  # the only error it raises, whatever the record holds
            evidence.problems.append(_text(f"{where}: rank {rank}: {e}", 500))
            return
        old = evidence.records.get(rank)
        if old is None or record.taken_at >= old.taken_at:
            evidence.records[rank] = record
        evidence.missing.pop(rank, None)

    for e in events:
        parsed = parse(e)
        if isinstance(parsed, NodeHost):
            hosts[_text(parsed.node, 100)] = _text(parsed.host, 200)  # the address, as nodes/<id> and agents name it
        elif isinstance(parsed, WorkerStarted) and isinstance(e.get("round"), int) and isinstance(e.get("rank"), int):
            started.setdefault(e["round"], {})[e["rank"]] = _text(parsed.node, 100)
        if isinstance(parsed, Hang) and isinstance(parsed.worker_round, int):
            ev = rounds.setdefault(parsed.worker_round, RoundEvidence(parsed.worker_round))
            ev.nodes.append(_text(parsed.node, 100))
            for key in [
                *_dict(parsed.flight),
                *_dict(parsed.missing),
                *(parsed.frozen if isinstance(parsed.frozen, list) else []),
            ]:
                if (rank := _rank_of(key)) is not None:
                    ev.node_of[rank] = _text(parsed.node, 100)
            ev.hung = ev.hung or not isinstance(parsed, Dumped)
            ev.whys.append(f"{_text(parsed.node, 100)}: {_text(parsed.why, 300)}")
            frozen = parsed.frozen if isinstance(parsed.frozen, list) else []
            ev.frozen.update(r for r in frozen if isinstance(r, int) and not isinstance(r, bool))
            flight = parsed.flight if isinstance(parsed.flight, dict) else {}
            for key, raw in flight.items():
                if (rank := _rank_of(key)) is not None:
                    take(ev, rank, raw, f"hang event of {_text(parsed.node, 100)}")
            missing = parsed.missing if isinstance(parsed.missing, dict) else {}
            for key, why in missing.items():
                if (rank := _rank_of(key)) is not None and rank not in ev.records:
                    ev.missing[rank] = _text(why, 300)
        elif isinstance(parsed, FlightRecorded) and isinstance(e.get("round"), int):
            ev = rounds.setdefault(e["round"], RoundEvidence(e["round"]))
            rank = e.get("rank")
            if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
                take(ev, rank, parsed.record, f"flight_recorded event of rank {rank} ({_text(parsed.why, 200)})")
    for round_, ev in rounds.items():
        ev.node_of = {**started.get(round_, {}), **ev.node_of}
        ev.hosts = {node: hosts[node] for node in set(ev.node_of.values()) if node in hosts}
    return [rounds[r] for r in sorted(rounds)]


def _dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any, limit: int) -> str:
    """``value`` from an event as text to show: cut, and printable (a lone surrogate escaped)."""
    return printable(str(value)[:limit])


def _rank_of(key: Any) -> int | None:
    """A global rank written as an event's key or list item (``"3"`` or 3); None for anything else
    (``"²"`` passes ``str.isdigit`` but not ``int``; a 400-digit one is no rank)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if 0 <= key < 2**62 else None
    text = key if isinstance(key, str) else ""
    return int(text) if 0 < len(text) <= 18 and text.isascii() and text.isdigit() else None


@dataclass(frozen=True, slots=True)
class Stall:
    """A rank not making progress, as an agent's status says (``ftrain.agents.records.RankStall``)."""

    rank: int
    why: str  #: waiting | frozen | no_progress
    since: float  #: wall clock
    seq: int = -1
    group: str = ""
    what: str = ""  #: op, shapes, dtypes


def from_stalls(stalls: Iterable[Stall], *, now: float, where: Mapping[int, str] | None = None) -> Verdict:
    """The round-wide view from the agents' statuses: who is frozen or stuck outside a collective,
    and where the others wait. Two ranks waiting under one collective's number with different ops
    are a desync there; ranks that all wait, none frozen, in different collectives are one too
    (a cross wait). Only the oldest collective in flight of each rank is known here: the verdict
    of the records (:func:`analyze`) says more."""
    who = _Who(where or {})
    stalls = sorted(stalls, key=lambda s: s.rank)
    if not stalls:
        return Verdict(NONE, "every rank is making progress")
    waiting = [s for s in stalls if s.why == "waiting"]
    others = [s for s in stalls if s.why != "waiting"]
    by: dict[tuple[str, int], list[Stall]] = {}
    for s in waiting:
        by.setdefault((s.group, s.seq), []).append(s)

    def shown(group: list[Stall]) -> str:
        s = group[0]
        what = f" {s.what}" if s.what else ""
        return (
            f"{who([x.rank for x in group])} in #{s.seq}{what} on group {s.group} for {max(0.0, now - s.since):.1f} s"
        )

    parts = [shown(group) for group in sorted(by.values(), key=lambda g: g[0].rank)]
    for (group_name, seq), group in sorted(by.items()):
        ops = {s.what.split(" ")[0] for s in group if s.what}
        if len(ops) > 1:
            each = "; ".join(f"{who([s.rank])} waits in {s.what}" for s in group)
            line = f"desync at collective #{seq} on group {group_name}: {each}"
            return Verdict(DESYNC, line, [s.rank for s in group], seq, group_name, [s.rank for s in group])
    if others:
        frozen = [s.rank for s in others if s.why == "frozen"]
        idle = [s.rank for s in others if s.why != "frozen"]
        said = []
        if frozen:
            said.append(f"{who(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen")
        if idle:
            said.append(f"{who(idle)} made no progress, in no collective")
        line = "; ".join(said) + (f"; waiting: {'; '.join(parts)}" if parts else "")
        first = min(by.items(), key=lambda kv: min(s.since for s in kv[1]), default=None)
        seq, group_name = (first[0][1], first[0][0]) if first else (-1, "")
        return Verdict(CULPRIT, line, sorted(frozen + idle), seq, group_name, [s.rank for s in waiting])
    (group_name, seq), group = min(by.items(), key=lambda kv: min(s.since for s in kv[1]))
    waited_s = max(0.0, now - min(s.since for s in group))
    if len(by) > 1:
        line = f"desync: the ranks wait in different collectives: {'; '.join(parts)}"
        return Verdict(DESYNC, line, [], seq, group_name, [s.rank for s in waiting], waited_s)
    return Verdict(STUCK, f"waiting: {parts[0]}", [], seq, group_name, [s.rank for s in group], waited_s)
