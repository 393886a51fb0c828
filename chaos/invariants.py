"""What every chaos run must prove (DESIGN.md), checked from what the run left behind: the event
log, the metrics, the ledger, the checkpoints on storage and the final state.

Each check returns a :class:`Check` (name, ok, detail); :func:`fault_timings` measures each
fault's detection time, recovery time and lost steps; :func:`goodput` is productive / wall time,
and :func:`lost_time` splits the rest by the fault that cost it.
What a fault kind owes (a new round, a refusal), which commits it damaged and which events detect
it come from its :class:`~ftrain.chaos.faults.Fault` in the registry, never from its name.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftrain.agents.records import STRAGGLER
from ftrain.chaos.faults import FAULTS, Fault, Outcome
from ftrain.chaos.faults.registry import DETECT_GRACE_S
from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.storage import Storage
from ftrain.checkpoint.verify import verify_step
from ftrain.config import Config
from ftrain.contract import exits
from ftrain.contract.events import Event
from ftrain.data import build_source, data_digest, identity_of
from ftrain.data.ledger import check_exactly_once, read_ledger


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False  #: the check does not apply to this job (``detail`` says why): not a pass

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "skipped": self.skipped}


def _of(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def _fault(record: dict[str, Any]) -> Fault:
    """The registered kind of a ``chaos_fault`` event."""
    return FAULTS.get(record["kind"])


def job_finished(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]], steps: int, exit_codes: dict[str, int | None]
) -> Check:
    final = _of(events, Event.JOB_FINAL)
    last = max((m["step"] for m in metrics), default=0)
    # an agent ends with the job (0) or drained before it (75: a node suspected of silent corruption)
    bad = {n: c for n, c in exit_codes.items() if c not in (exits.OK, exits.DRAINED)}
    ok = bool(final) and final[0]["status"] == "succeeded" and last == steps and not bad
    status = final[0]["status"] if final else "none"
    return Check("job_finished", ok, f"final status {status}, step {last}/{steps}, agent exit codes {exit_codes}")


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_tensors(v, f"{prefix}.{i}"))
    return out


def final_state_matches(golden_path: Path, final_path: Path, tolerance: float) -> Check:
    if not final_path.exists():
        return Check("final_state_matches_golden", False, f"no final state at {final_path}")
    golden = torch.load(golden_path, map_location="cpu", weights_only=True)
    final = torch.load(final_path, map_location="cpu", weights_only=True)
    worst, where, compared = 0.0, "", 0
    for part in ("model", "optim"):
        a, b = _tensors(golden[part]), _tensors(final[part])
        if a.keys() != b.keys():
            missing = sorted(a.keys() ^ b.keys())[:5]
            return Check("final_state_matches_golden", False, f"{part} keys differ: {missing}")
        for key in a:
            if a[key].shape != b[key].shape:
                return Check(
                    "final_state_matches_golden", False, f"{part}.{key}: shape {a[key].shape} vs {b[key].shape}"
                )
            if torch.equal(a[key], b[key]):
                continue
            diff = (a[key].double() - b[key].double()).abs().max().item()
            if diff > worst or not where:
                worst, where = diff, f"{part}.{key}"
        compared += len(a)
    if tolerance == 0.0:
        ok = not where
        detail = f"{compared} tensors bitwise equal" if ok else f"not bitwise equal: max |diff| {worst:.3g} at {where}"
    else:
        ok = worst <= tolerance
        detail = f"max |diff| {worst:.3g} (tolerance {tolerance:g}) over {compared} tensors" + (
            f", at {where}" if where else ""
        )
    return Check("final_state_matches_golden", ok, detail)


#: One commit of one step: a step can be committed, damaged, refused and committed again, and
#: each commit has its own manifest (``created_time`` is written by the committing coordinator).
CommitId = tuple[int, float]


def corrupted_by_chaos(events: list[dict[str, Any]]) -> dict[int, float]:
    """Checkpoint steps the chaos run damaged on purpose -> when."""
    return {e["ckpt_step"]: e["time"] for e in _of(events, Event.CHAOS_FAULT) if _fault(e).damages_commit}


def damaged_commits(events: list[dict[str, Any]]) -> dict[CommitId, float]:
    """The commits chaos damaged on purpose -> when (each fault names the manifest it found)."""
    return {
        (e["ckpt_step"], e["ckpt_created_time"]): e["time"]
        for e in _of(events, Event.CHAOS_FAULT)
        if _fault(e).damages_commit and "ckpt_created_time" in e
    }


def committed_checkpoints_verify(storage: Storage, events: list[dict[str, Any]]) -> Check:
    damaged = corrupted_by_chaos(events)
    checked, bad = [], []
    for info in list_steps(storage):
        if info.state != "committed" or info.step in damaged:
            continue
        report = verify_step(storage, info.dirname)
        checked.append(info.step)
        if not report.ok:
            bad.append(f"step {info.step}: {'; '.join(str(p) for p in report.problems[:3])}")
    ok = not bad and bool(checked)
    detail = (
        f"{len(checked)} committed step(s) verified: {checked}"
        if ok
        else ("; ".join(bad) or "no committed checkpoint left to verify")
    )
    return Check("committed_checkpoints_verify", ok, detail)


def loads_were_committed(events: list[dict[str, Any]], observed_commits: dict[CommitId, float]) -> Check:
    """Every load read a commit that existed before it, and never a commit damaged before it.

    Each load is judged against the commit it actually read: the ``ckpt_loaded`` event names
    the manifest (step and ``created_time``), and ``observed_commits`` holds every manifest an
    observer of the storage saw appear (a worker killed right after its background upload
    committed never logs the commit). A step damaged by chaos, refused, and then saved and
    committed again is a new commit: loading it is correct.
    """
    damaged = damaged_commits(events)
    bad, loads = [], 0
    for e in _of(events, Event.CKPT_LOADED):
        if e.get("rank") != 0:
            continue
        loads += 1
        commit: CommitId = (e["step"], e.get("created_time", -1.0))
        at = e["time"]
        seen = observed_commits.get(commit)
        if commit[1] > at or (seen is None and not _committed_by_event(events, commit, at)):
            bad.append(
                f"round {e['round']} loaded step {commit[0]} (manifest of {commit[1]:.3f}), "
                "which was not committed before the load"
            )
        if commit in damaged and damaged[commit] < at:
            bad.append(
                f"round {e['round']} loaded step {commit[0]} (manifest of {commit[1]:.3f}) "
                "after chaos had corrupted that commit"
            )
    skipped = sorted({e["step"] for e in _of(events, Event.CKPT_CORRUPT)})
    detail = (
        "; ".join(bad)
        if bad
        else (
            f"{loads} load(s), each of a committed, intact step"
            + (f"; corrupt steps refused: {skipped}" if skipped else "")
        )
    )
    return Check("loads_were_committed_and_intact", not bad, detail)


def resumed_from_the_newest_commit(events: list[dict[str, Any]], observed_commits: dict[CommitId, float]) -> Check:
    """No round went back past a checkpoint: each round's state (rank 0's ``live_restored``, or its
    ``resumed`` under restart recovery) is at least the newest step committed before that round
    was formed — from storage or from a live peer alike. Excluded: commits chaos damaged, and steps
    a load refused. A job that quietly started over, or took an old replica over a newer
    checkpoint, fails this even though its final state may still match the golden run."""
    damaged = damaged_commits(events)
    refused = {e["step"] for e in _of(events, Event.CKPT_CORRUPT)}
    formed = {e["new_round"]: e["time"] for e in _of(events, Event.ROUND_FORMED)}
    restores: dict[int, dict[str, Any]] = {}
    for name in (Event.RESUMED, Event.LIVE_RESTORED):  # live_restored, where there is one, wins
        restores.update({e["round"]: e for e in _of(events, name) if e.get("rank") == 0})
    bad = []
    for round_, e in sorted(restores.items()):
        at = formed.get(round_, e["time"])
        newer = [
            commit[0]
            for commit, seen in observed_commits.items()
            if seen < at and commit[0] > e["step"] and commit not in damaged and commit[0] not in refused
        ]
        if newer:
            bad.append(f"round {round_} went on from step {e['step']} although step {max(newer)} was committed")
    detail = "; ".join(bad) if bad else f"{len(restores)} round(s), each from the newest commit or later"
    return Check("resumed_from_the_newest_commit", not bad, detail)


def _committed_by_event(events: list[dict[str, Any]], commit: CommitId, before: float) -> bool:
    """A worker logged the commit of that step between the manifest's creation and ``before``."""
    return any(e["step"] == commit[0] and commit[1] <= e["time"] <= before for e in _of(events, Event.CKPT_COMMITTED))


def exactly_once(ledger_dir: Path, cfg: Config, steps: int) -> Check:
    source = build_source(cfg.data, cfg.model)
    report = check_exactly_once(
        read_ledger(ledger_dir),
        num_samples=source.num_samples,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.data.seed,
        steps=steps,
        data=data_digest(identity_of(source, cfg.data.seed)) or None,  # every step drawn from this data
    )
    return Check("samples_consumed_exactly_once", report.ok, report.summary())


def _faults(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ``chaos_fault`` event, completed by the ``chaos_fault_done`` of its kind that follows
    it (a fault that lasts says at its end what it found: ``refused``, ``injected``)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e["event"] == Event.CHAOS_FAULT:
            out.append(dict(e))
        elif e["event"] == Event.CHAOS_FAULT_DONE:
            fault = next((f for f in reversed(out) if f["kind"] == e["kind"]), None)
            if fault is not None:
                fault.update({k: v for k, v in e.items() if k not in ("time", "event", "rank", "round", "pid")})
    return out


def _detection_owed(f: dict[str, Any], rounds: list[float]) -> bool:
    """Whether a fault that must be detected owes its detection: its record does not say it is
    not owed (``detection_owed``: a slowdown the agents' rule does not flag, or one without a
    judged peer), and no round was formed while it lasted (a new round starts the judging over)."""
    end = f["time"] + float(f.get("duration_s", 0.0))
    return bool(f.get("detection_owed", True)) and not any(f["time"] < t <= end for t in rounds)


def faults_handled(events: list[dict[str, Any]]) -> Check:
    """Refusals that must have happened (:attr:`Outcome.REFUSED` kinds: a duplicate node id, a
    zombie commit, a commit paused past its round's end), and a new round after every fault that
    restarts the workers."""
    faults = _faults(events)
    rounds = sorted(e["time"] for e in _of(events, Event.ROUND_FORMED))
    bad = []
    for i, f in enumerate(faults):
        fault = _fault(f)
        if fault.outcome is Outcome.REFUSED and not f.get("refused"):
            bad.append(f"{f['kind']} #{i} was not refused: {f}")
        if fault.restarts and not any(t > f["time"] for t in rounds):
            bad.append(f"{f['kind']} #{i} at step {f.get('step')} was never followed by a new round")
        if fault.must_be_detected and _detection_owed(f, rounds):
            until = f["time"] + float(f.get("duration_s", 0.0)) + DETECT_GRACE_S
            if not any(e["event"] in fault.detected_by and f["time"] <= e["time"] <= until for e in events):
                bad.append(
                    f"{f['kind']} #{i} at step {f.get('step')} was not detected ({' or '.join(fault.detected_by)}) "
                    f"within its {f.get('duration_s', 0)} s and {DETECT_GRACE_S:.0f} s more"
                )
    return Check("faults_handled", not bad, "; ".join(bad) if bad else f"{len(faults)} fault(s) handled")


def evicted_nodes_rejoined(events: list[dict[str, Any]]) -> Check:
    """Every node a ``straggler`` round left out (agent.on_straggler = evict) was a member of a
    round formed after it: eviction is for a while, not for good."""
    rounds = sorted(_of(events, Event.ROUND_FORMED), key=lambda r: r["new_round"])
    bad, evicted = [], 0
    for prev, r in zip(rounds, rounds[1:], strict=False):
        if r.get("reason") != STRAGGLER:
            continue
        for node in sorted(set(prev["members"]) - set(r["members"])):
            evicted += 1
            if not any(later["new_round"] > r["new_round"] and node in later["members"] for later in rounds):
                bad.append(f"{node}, evicted by round {r['new_round']}, never joined a later round")
    detail = "; ".join(bad) if bad else f"{evicted} evicted node(s), each back in a later round"
    return Check("evicted_nodes_rejoined", not bad, detail)


def _first_step_of_each_round(metrics: list[dict[str, Any]]) -> dict[int, float]:
    first: dict[int, float] = {}
    for m in metrics:
        if "round" in m:
            first[m["round"]] = min(first.get(m["round"], m["time"]), m["time"])
    return first


def one_round_at_a_time(metrics: list[dict[str, Any]]) -> Check:
    """No step of round g completed after a newer round completed one (each metrics line names
    the round that completed the step): two sides of a partition never both train."""
    first = _first_step_of_each_round(metrics)
    bad = []
    for m in metrics:
        newer = [(t, h) for h, t in first.items() if h > m.get("round", h) and t < m["time"]]
        if newer:
            t, h = min(newer)
            bad.append(f"round {m['round']} completed step {m['step']} {m['time'] - t:.2f}s after round {h} trained")
    detail = "; ".join(bad[:5]) if bad else f"{len(first)} round(s) trained, never two at once"
    return Check("one_round_trains_at_a_time", not bad, detail)


def no_commit_from_a_stale_round(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> Check:
    """No checkpoint committed by round g after a newer round trained (a fenced-out round, the
    minority side of a partition, a worker paused between its fence check and its commit)."""
    first = _first_step_of_each_round(metrics)
    bad = []
    for e in _of(events, Event.CKPT_COMMITTED):
        newer = [h for h, t in first.items() if h > e["round"] and t < e["time"]]
        if newer:
            bad.append(f"round {e['round']} committed step {e['step']} after round {min(newer)} trained")
    commits = len(_of(events, Event.CKPT_COMMITTED))
    detail = "; ".join(bad) if bad else f"{commits} commit(s), each by the round then training"
    return Check("no_commit_from_a_stale_round", not bad, detail)


def cut_off_nodes_rejoined(events: list[dict[str, Any]]) -> Check:
    """After every fault that cut a node off (:attr:`Fault.cuts_node`) healed, that node was a
    member of a round formed later (it came back without a human), unless no round formed since
    the fault left it out (the job rode the cut out with the node in it)."""
    bad, checked = [], 0
    faults = [f for f in _faults(events) if _fault(f).cuts_node]
    backs = _of(events, Event.CHAOS_NODE_BACK)
    rounds = _of(events, Event.ROUND_FORMED)
    for f in faults:
        node = f.get("node")
        healed = next((b["time"] for b in backs if b["node"] == node and b["time"] >= f["time"]), None)
        if healed is None:
            bad.append(f"{f['kind']} of {node}: never healed")
            continue
        checked += 1
        left = any(r["time"] >= f["time"] and node not in r["members"] for r in rounds)
        if left and not any(r["time"] >= healed and node in r["members"] for r in rounds):
            bad.append(f"{f['kind']} of {node}: not in any round formed after the heal")
    detail = "; ".join(bad) if bad else f"{checked} cut-off node(s), each back in a later round or never out"
    return Check("cut_off_nodes_rejoined", not bad, detail)


def fault_timings(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault: detection (the first of its kind's ``detected_by`` events after it), recovery
    (first step completed by a round formed after it, for a kind that restarts the workers) and
    lost steps (completed before that round, recomputed after it)."""
    faults = _of(events, Event.CHAOS_FAULT)
    out = []
    for i, f in enumerate(faults):
        fault = _fault(f)
        t0 = f["time"]
        until = faults[i + 1]["time"] if i + 1 < len(faults) else float("inf")
        reactions = [
            e
            for e in events
            if e["event"] in fault.detected_by and t0 <= e["time"] < until and e.get("outcome") != "succeeded"
        ]
        detect = min(reactions, key=lambda e: e["time"]) if reactions else None
        # only faults that stop training own the round that follows them; any other round in the
        # window belongs to an earlier fault still being recovered from
        new_round = (
            next(
                (
                    e
                    for e in sorted(_of(events, Event.ROUND_FORMED), key=lambda e: e["time"])
                    if t0 <= e["time"] < until
                ),
                None,
            )
            if fault.restarts
            else None
        )
        recovery_s = lost = resumed_step = None
        if new_round is not None:
            resumed = [  # a restart loads a checkpoint (resumed); a live recovery restores (live_restored)
                e
                for e in [*_of(events, Event.RESUMED), *_of(events, Event.LIVE_RESTORED)]
                if e["round"] >= new_round["new_round"] and e.get("rank") == 0
            ]
            if resumed:
                r = min(resumed, key=lambda e: e["time"])
                resumed_step = r["step"]
                after = [m for m in metrics if m["time"] > r["time"]]
                if after:
                    recovery_s = min(m["time"] for m in after) - t0
                before = [m["step"] for m in metrics if m["time"] <= new_round["time"]]
                lost = max(0, max(before, default=0) - r["step"])
        out.append(
            {
                "index": i,
                "kind": f["kind"],
                "time": t0,
                "step": f.get("step"),
                "node": f.get("node"),
                "detected_by": detect["event"] if detect else None,
                "detection_s": round(detect["time"] - t0, 3) if detect else None,
                "new_round": new_round["new_round"] if new_round else None,
                "recovery_s": round(recovery_s, 3) if recovery_s is not None else None,
                "resumed_step": resumed_step,
                "lost_steps": lost,
            }
        )
    return out


def _attempts(metrics: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, start, end) of each step attempt, in the metrics' order. A stretch of training is
    consecutive steps of one round: an attempt starts when the step before it in its stretch
    completed, and the first of a stretch its own step time before it completed (the stall
    before a round's first step, live recovery's included, is not the step's)."""
    out = []
    previous: dict[str, Any] | None = None
    for m in metrics:
        same_stretch = (
            previous is not None
            and previous["step"] == m["step"] - 1
            and m["time"] >= previous["time"]
            and previous.get("round") == m.get("round")
        )
        start = previous["time"] if same_stretch and previous is not None else m["time"] - m["step_time_s"]
        out.append((m["step"], start, m["time"]))
        previous = m
    return out


def _job_end(events: list[dict[str, Any]], metrics: list[dict[str, Any]], started_at: float) -> float:
    final = _of(events, Event.JOB_FINAL)
    return final[0]["time"] if final else max((m["time"] for m in metrics), default=started_at)


def goodput(events: list[dict[str, Any]], metrics: list[dict[str, Any]], started_at: float) -> dict[str, Any]:
    """Productive time over wall time (first agent start to the job's end). Productive: for the
    attempt of each step that the final model contains (its last), the time since the step
    before it completed in the same stretch of training (consecutive steps of one round; its
    step time on the first step of a stretch). ``lost_s`` is the rest, ``lost_by_cause`` splits
    it (:func:`lost_time`: by fault kind, ``startup`` and ``shutdown``)."""
    last = {step: end - start for step, start, end in _attempts(metrics)}
    wall = max(1e-9, _job_end(events, metrics, started_at) - started_at)
    productive = sum(last.values())
    split = lost_time(events, metrics, started_at)
    by_cause: dict[str, float] = {"startup": split["startup_s"], "shutdown": split["shutdown_s"]}
    for f, lost_s in zip(_of(events, Event.CHAOS_FAULT), split["by_fault"], strict=True):
        by_cause[f["kind"]] = by_cause.get(f["kind"], 0.0) + lost_s
    if split["unattributed_s"]:
        by_cause["unattributed"] = split["unattributed_s"]
    return {
        "productive_s": round(productive, 3),
        "wall_s": round(wall, 3),
        "goodput": round(productive / wall, 4),
        "lost_s": round(wall - productive, 3),
        "lost_by_cause": {k: round(v, 3) for k, v in by_cause.items()},
    }


def lost_time(events: list[dict[str, Any]], metrics: list[dict[str, Any]], started_at: float) -> dict[str, Any]:
    """The wall time that is not productive (:func:`goodput`), split by cause. Each moment of the
    run is productive (inside the last attempt of a step), wasted (inside an attempt a later one
    superseded: a rollback or a restart recomputed it) or idle (no step in flight: detection,
    rendezvous, restarts, loads). Wasted time is the fault's that made the step run again: the
    newest fault at or before the start of the attempt that superseded it. Idle time is the
    newest fault's at or before it, except that the idle time before a fault that struck while
    no step completed (the step in flight it stopped) is that fault's; before any fault it is
    ``startup``, after the last step ``shutdown``; a superseded attempt with no fault before its
    redo is ``unattributed``.

    Returns ``by_fault`` (seconds lost, one per ``chaos_fault`` event in order), ``startup_s``,
    ``shutdown_s`` and ``unattributed_s``; their sum is wall time less productive time."""
    faults = sorted((e["time"], i) for i, e in enumerate(_of(events, Event.CHAOS_FAULT)))
    fault_times = [t for t, _ in faults]
    end = _job_end(events, metrics, started_at)
    attempts = _attempts(metrics)
    last_of = {step: i for i, (step, _, _) in enumerate(attempts)}
    trained_from = min((a[1] for a in attempts), default=end)
    trained_until = max((a[2] for a in attempts), default=started_at)
    by_fault = [0.0] * len(faults)
    other = {"startup": 0.0, "shutdown": 0.0, "unattributed": 0.0}

    def newest_fault(t: float) -> int | None:
        k = bisect.bisect_right(fault_times, t)
        return faults[k - 1][1] if k else None

    # the cause of each superseded attempt: the newest fault before its step's next attempt began
    cause: dict[int, int | None] = {}
    following: dict[int, float] = {}
    for i in range(len(attempts) - 1, -1, -1):
        step, start, _ = attempts[i]
        if step in following:
            cause[i] = newest_fault(following[step])
        following[step] = start

    def idle(p: float, q: float) -> None:
        """No step in flight from p to q: each piece is the newest fault's at its start; the
        piece before a fault that struck in the gap is that fault's (the step it stopped)."""
        inside = [(t, i) for t, i in faults if p < t < q]
        first = newest_fault(p)
        if inside and (first is None or p >= trained_from):
            first = inside[0][1]
        cuts = [p, *(t for t, _ in inside), q]
        for k, fault in enumerate([first, *(i for _, i in inside)]):
            if fault is None:
                other["startup"] += cuts[k + 1] - cuts[k]
            else:
                by_fault[fault] += cuts[k + 1] - cuts[k]

    # sweep the run's time line: at each moment, what is in flight (an attempt of no length, a
    # script job's first step of a round, is never: its closing mark would sort before its opening)
    spans = [(i, s, e) for i, (_, s, e) in enumerate(attempts) if e > started_at and e > s]
    marks = sorted([(max(started_at, s), 1, i) for i, s, _ in spans] + [(min(end, e), 0, i) for i, _, e in spans])
    active: set[int] = set()
    now = started_at
    for at, opening, i in [*marks, (end, 0, -1)]:
        at = min(max(at, now), end)
        if at > now:
            span = at - now
            if any(last_of[attempts[a][0]] == a for a in active):
                pass  # productive
            elif active:
                fault = cause[max(active)]
                if fault is None:
                    other["unattributed"] += span
                else:
                    by_fault[fault] += span
            elif now >= trained_until:
                other["shutdown"] += span
            else:
                idle(now, at)
            now = at
        if i >= 0:
            (active.add if opening else active.discard)(i)
    return {
        "by_fault": [round(x, 3) for x in by_fault],
        "startup_s": round(other["startup"], 3),
        "shutdown_s": round(other["shutdown"], 3),
        "unattributed_s": round(other["unattributed"], 3),
    }


def lost_by_kind(faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Kind -> how many faults, and the time lost to them (``lost_s`` of each fault's timings):
    median and worst per fault, and in all."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({f["kind"] for f in faults}):
        lost = sorted(f["lost_s"] for f in faults if f["kind"] == kind and f.get("lost_s") is not None)
        out[kind] = {
            "faults": sum(1 for f in faults if f["kind"] == kind),
            "total_s": round(sum(lost), 3),
            "median_s": round(statistics.median(lost), 3) if lost else None,
            "worst_s": lost[-1] if lost else None,
        }
    return out


def corruption_outcomes(events: list[dict[str, Any]], timings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each fault detected by the replica check (silent data corruption, its kind's
    ``detected_by`` is ``replica_mismatch``): whether it was detected, in how many seconds and
    steps (the mismatch's step less the step training had reached when the fault acted), and the
    corrupted commits: commits of a step after the fault's, made after it and before the
    rollback that followed its detection (the run's end if none). The check runs before every
    save, so this is 0 unless the check missed the flip; it can overcount by a commit in the
    rare case that the flip landed a step after one that was saved."""
    commits = _of(events, Event.CKPT_COMMITTED)
    restores = sorted(e["time"] for e in [*_of(events, Event.ROLLED_BACK), *_of(events, Event.RESUMED)])
    end = max((e["time"] for e in events), default=0.0)
    out = []
    for f, timing in zip(_of(events, Event.CHAOS_FAULT), timings, strict=True):
        if Event.REPLICA_MISMATCH not in _fault(f).detected_by:
            continue
        t0, step = f["time"], f.get("step") or 0
        mismatch = next(
            (e for e in sorted(_of(events, Event.REPLICA_MISMATCH), key=lambda e: e["time"]) if e["time"] >= t0), None
        )
        detected = timing["detected_by"] == Event.REPLICA_MISMATCH and mismatch is not None
        until = next((t for t in restores if mismatch is not None and t >= mismatch["time"]), end) if detected else end
        corrupted = {(c["step"], c["time"]) for c in commits if c["step"] > step and t0 <= c["time"] <= until}
        out.append(
            {
                "index": timing["index"],
                "kind": f["kind"],
                "step": step,
                "detected": detected,
                "detection_s": timing["detection_s"] if detected else None,
                "detection_steps": mismatch["step"] - step if detected and mismatch is not None else None,
                "corrupted_commits": len({s for s, _ in corrupted}),
            }
        )
    return out
