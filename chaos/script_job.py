"""Chaos against a user's own training script (``[job] script = ...``): the job is ``ftrain agent
--script`` on every node instead of ``ftrain train``, and what the invariants read comes from what
such a job leaves behind.

A script writes no metrics file and its session logs no step, load or commit into the job's event
log; what it does leave: the agents' events (rounds, exits, the job's end), the checkpoints on
storage (each manifest names its step and round), and, where its loop draws its data from
:class:`ftrain.ResumableSampler`, the consumption ledger the sampler appends to when the worker env
names a ledger directory (:data:`ftrain.contract.worker_env.LEDGER_DIR`). So:

- progress (the steps a fault's ``at_step`` waits for, each round's first step) is the ledger's:
  a step counts once rank 0 drew its batch, seen by :class:`LedgerProgress`;
- the final state is compared with a fault-free run of the same script at the same world size
  (:func:`reference_run`): both runs' committed checkpoints of the same step, tensor by tensor;
- a check whose evidence such a job does not leave is *skipped*, with the reason, in the report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ftrain.chaos import invariants
from ftrain.chaos.cluster import JsonlTail
from ftrain.chaos.invariants import Check, CommitId
from ftrain.chaos.scenario import Scenario
from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.export import export_step
from ftrain.checkpoint.storage import Storage
from ftrain.contract.events import Event
from ftrain.data.ledger import check_exactly_once, read_ledger
from ftrain.sampler import SAMPLER_FILE
from ftrain.testbed.jobs import run_within
from ftrain.testbed.procs import quiet_env

#: how long the fault-free reference run of a script may take
REFERENCE_TIMEOUT_S = 1800.0

NO_LEDGER = "the script wrote no consumption ledger (its loop does not draw its data from ftrain.ResumableSampler)"


def skipped(name: str, why: str) -> Check:
    """A check that does not apply to a script job, said as such in the report (never a silent pass)."""
    return Check(name, True, f"skipped: {why}", skipped=True)


def world_size(scenario: Scenario) -> int:
    """The ranks of a round with every node in it: what the reference run runs at."""
    return scenario.job.nodes * scenario.job.nproc_per_node


def reference_run(scenario: Scenario, cache_dir: Path) -> Path:
    """The fault-free run of the script (``torchrun --standalone`` on one machine, the same world
    size, a local checkpoint directory): its checkpoint directory. Computed once per (script
    content, arguments, steps, world size) and reused, as the golden run of ``ftrain train`` is."""
    script = scenario.script_path
    assert script is not None
    key_text = json.dumps(
        [
            hashlib.sha256(script.read_bytes()).hexdigest(),
            scenario.job.script_args,
            scenario.job.steps,
            world_size(scenario),
        ]
    )
    where = cache_dir / f"reference-{hashlib.sha256(key_text.encode()).hexdigest()[:16]}"
    ckpt, done = where / "ckpt", where / "done"
    if done.exists():
        return ckpt
    shutil.rmtree(where, ignore_errors=True)  # a run cut short left steps its successor must not resume from
    where.mkdir(parents=True)
    print(f"chaos: fault-free reference run of {script.name} ({world_size(scenario)} ranks) -> {ckpt}", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size(scenario)}",
        str(script),
        *scenario.script_command_args(str(ckpt)),
    ]
    out = run_within(cmd, timeout_s=REFERENCE_TIMEOUT_S, cwd=where, env=quiet_env())  # the whole tree killed
    if out.returncode != 0:
        raise RuntimeError(
            f"the fault-free reference run of {script} failed (exit {out.returncode}): fix the script before "
            f"chaos can judge it\n{out.stdout[-4000:]}"
        )
    done.write_text(str(time.time()))
    return ckpt


class LedgerProgress:
    """The steps of a script job, from its sampler's ledger as it grows: one metrics-like record
    per step attempt of rank 0 (``step`` done once its batch was drawn, ``round``, ``time``: when
    this reader first saw it). Polled by the faults' triggers and the runner; thread-safe."""

    def __init__(self, ledger_dir: Path):
        self.ledger_dir = ledger_dir
        self._tails: dict[Path, JsonlTail] = {}
        self._read: dict[Path, int] = {}  #: entries of each file already turned into records
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            now, new = time.time(), []
            for path in sorted(self.ledger_dir.glob("ledger-*.jsonl")):
                entries = self._tails.setdefault(path, JsonlTail(path)).records()
                new += [_step_record(e, now) for e in entries[self._read.get(path, 0) :] if e.get("dp_rank") == 0]
                self._read[path] = len(entries)
            self._records += [m for m in new if isinstance(m["step"], int)]
            return list(self._records)


def _step_record(entry: dict[str, Any], seen: float) -> dict[str, Any]:
    """A metrics line for a ledger entry (what the invariants and the report read of one)."""
    step = entry.get("step")
    return {
        "step": step + 1 if isinstance(step, int) else None,
        "round": entry.get("round", 0),
        "time": seen,
        "step_time_s": 0.0,
        "loss": None,
        "world_size": None,
    }


def resumes(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ``resumed`` event for each round whose rank 0 logged none (a script that loads its state
    without a :class:`ftrain.Session`; a session logs ``resumed`` or ``live_restored``), from the
    ledger: the round went on from the step before the first batch its rank 0 drew (what
    :func:`invariants.resumed_from_the_newest_commit` judges)."""
    said = {e["round"] for e in events if e["event"] in (Event.RESUMED, Event.LIVE_RESTORED) and e.get("rank") == 0}
    first: dict[int, dict[str, Any]] = {}
    for m in metrics:
        if m["round"] not in said and (m["round"] not in first or m["time"] < first[m["round"]]["time"]):
            first[m["round"]] = m
    return [
        {"event": Event.RESUMED, "rank": 0, "round": r, "step": m["step"] - 1, "time": m["time"]}
        for r, m in first.items()
    ]


def commits(observed: dict[CommitId, float], rounds: dict[CommitId, int]) -> list[dict[str, Any]]:
    """A ``ckpt_committed`` event per commit seen on storage, at the time its manifest was written,
    by the round it names (what :func:`invariants.no_commit_from_a_stale_round` judges)."""
    return [
        {
            "event": Event.CKPT_COMMITTED,
            "rank": 0,
            "step": step,
            "round": rounds.get((step, created), 0),
            "time": created,
        }
        for step, created in observed
    ]


def state_matches_reference(reference: Path, storage: Storage, steps: int, out_dir: Path, tolerance: float) -> Check:
    """The chaos run's newest commit and the reference run's commit of the same step hold the same
    model and optimizer state (the state's ``model`` and ``optim`` entries, as ``ftrain ckpt
    export --optimizer`` writes them), compared as the golden run of ``ftrain train`` is."""
    name = "state_matches_fault_free_run"
    committed = [s.step for s in list_steps(storage) if s.state == "committed"]
    if not committed:
        return Check(name, False, "the chaos run committed no checkpoint")
    step = max(committed)
    if step != steps:
        return Check(name, False, f"the chaos run's newest commit is step {step}, not the last step {steps}")
    ours, theirs = out_dir / f"state-{step}.pt", out_dir / f"reference-state-{step}.pt"
    try:
        export_step(storage, step, ours, include_optimizer=True, replace=True)
        export_step(Storage(str(reference)), step, theirs, include_optimizer=True, replace=True)
    except Exception as e:  # noqa: BLE001 - a step that cannot be read is this check's failure, said
        return Check(name, False, f"step {step} cannot be read back: {type(e).__name__}: {e}")
    check = invariants.final_state_matches(theirs, ours, tolerance)
    if check.ok and check.detail.startswith("0 tensors"):
        return Check(name, False, "no tensors compared: the saved state has no 'model' or 'optim' entry")
    return dataclasses.replace(check, name=name, detail=f"step {step}: {check.detail}")


def exactly_once(ledger_dir: Path, steps: int) -> Check:
    """Each sample of each step consumed once, from the ledger the script's sampler wrote and the
    numbers it wrote beside it (``sampler.json``)."""
    name = "samples_consumed_exactly_once"
    numbers = ledger_dir / SAMPLER_FILE
    if not numbers.exists():
        return skipped(name, NO_LEDGER)
    sampler = json.loads(numbers.read_text())
    report = check_exactly_once(
        read_ledger(ledger_dir),
        num_samples=int(sampler["num_samples"]),
        global_batch_size=int(sampler["global_batch_size"]),
        seed=int(sampler["seed"]),
        steps=steps,
    )
    return Check(name, report.ok, report.summary())


def has_ledger(ledger_dir: Path) -> bool:
    return (ledger_dir / SAMPLER_FILE).exists()


def script_checks(
    scenario: Scenario,
    *,
    reference: Path,
    storage: Storage,
    out_dir: Path,
    ledger_dir: Path,
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    exit_codes: dict[str, int | None],
    observed: dict[CommitId, float],
    rounds: dict[CommitId, int],
) -> list[Check]:
    """The invariants of a script job: those its evidence supports, the others skipped with why.
    ``events``: the job's, with the resume of each round whose script logged none (:func:`resumes`)."""
    job = scenario.job
    ledger = has_ledger(ledger_dir)
    newest = max((step for step, _ in observed), default=0)
    tolerance = job.tolerance if not job.deterministic else 0.0
    checks = [
        invariants.job_finished(events, [{"step": newest}], job.steps, exit_codes),
        state_matches_reference(reference, storage, job.steps, out_dir, tolerance),
        invariants.committed_checkpoints_verify(storage, events),
        invariants.loads_were_committed(events, observed),
        invariants.resumed_from_the_newest_commit(events, observed)
        if ledger or any(e["event"] in (Event.RESUMED, Event.LIVE_RESTORED) for e in events)
        else skipped("resumed_from_the_newest_commit", f"{NO_LEDGER}, and no session logged a resume"),
        exactly_once(ledger_dir, job.steps),
        invariants.faults_handled(events),
        invariants.one_round_at_a_time(metrics)
        if ledger
        else skipped("one_round_trains_at_a_time", f"{NO_LEDGER}: which round trained when is unknown"),
        invariants.no_commit_from_a_stale_round(commits(observed, rounds), metrics)
        if ledger
        else skipped("no_commit_from_a_stale_round", f"{NO_LEDGER}: when each round began training is unknown"),
        invariants.cut_off_nodes_rejoined(events),
        invariants.evicted_nodes_rejoined(events),
    ]
    return checks
