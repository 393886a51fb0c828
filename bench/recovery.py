"""Recovery time after a fault: ftrain's agents against plain torchrun (c10d), phase by phase.

    python bench/recovery.py [--repeats N] [--quick] [--smoke] [--faults worker_kill,node_loss,hang]
                             [--systems ftrain_live,ftrain_restart,session_live,torchrun_default,torchrun_tuned]

One job everywhere: ``ftrain.testbed.jobs.TINY_CONFIG`` with more steps, DDP over gloo, two "nodes" on
this host with one worker each, a checkpoint every ``--ckpt-interval`` steps to a local
directory; every (re)start resumes from the newest committed checkpoint. Each step sleeps
``FTRAIN_FAULT_STEP_SLEEP_S`` longer, so the job is still running when the fault comes. The
fault is injected once training passed ``--fault-step`` at world size 2 with a checkpoint
committed:

- ``worker_kill``: SIGKILL the rank-1 worker.
- ``node_loss``: SIGKILL a whole node at once. ftrain: the agent, its torchrun and its worker
  (the node of the rank-1 worker). torchrun: the torchrun that does not host the c10d store
  (``is_host=0``; losing the host's store is fatal to every torchrun) and its worker.
- ``hang``: SIGSTOP the rank-1 worker. ftrain's agents detect missing heartbeats
  (``--hang-timeout-s``); torchrun has no hang detection, so it waits for the gloo collective
  timeout (``--parallel.timeout_s``, the same value for every system).

Systems: ``ftrain_live`` and ``ftrain_restart`` (an etcd and two ``ftrain agent`` with
``--recovery live`` or ``restart``; the live rows' phases are explained in ``bench/lib/live_marks.py``),
``torchrun_default`` (two
``torchrun --rdzv-backend=c10d --nnodes=1:2 --max-restarts=3``) and ``torchrun_tuned`` (the same
with ``--rdzv-conf`` short timeouts). The floor is the bare cost of a start from a checkpoint:
two static-rendezvous torchruns (the command the ftrain agent launches) started fresh, from a
copy of a checkpoint, no fault.

``session_live`` is a user's loop recovering in-process: two ``ftrain agent --script
bench/lib/session_loop.py --recovery live`` with the same options, nodes and faults as
``ftrain_live`` (``--nnodes 1:2``: after a node loss the survivor goes on alone), serving
examples/own_loop/train.py's own ``train`` (``ftrain.Session.run``) with ``--parallel ddp``, a save
every ``--ckpt-interval`` steps to a local directory, and the fault after ``--fault-step``. Where
it differs: the model is the example's tiny Hugging Face Llama (``bench/lib/session_loop.py``), not
``TINY_CONFIG``'s GPT; the loop sleeps ``--step-sleep-s`` after each step itself (the example
does not read ``FTRAIN_FAULT_STEP_SLEEP_S``); a collective timeout is the session's (600 s), not
``--collective-timeout-s``; and its steps are the loop's own marks, not metrics lines (its
``live_restored`` events are the session's, read as ``ftrain worker``'s:
``bench/lib/session_marks.py``; worker start is up to ``session.load``, which includes the loop
rebuilding its model for the round).

A recovery ends at the first step completed after the resume; its phases, each mark taken when
the last participant reached it:

- detect: fault -> first reaction (ftrain: an agent's workers_exited/hang/round_formed/
  workers_stopped event; torchrun: its "... will restart worker group" log line).
- rendezvous: -> the new round is launched (ftrain: the agents' workers_started event, which
  starts a new torchrun; torchrun: its "Starting worker group" line, its launcher lives on).
- launcher: ftrain and the floor only: torchrun's own start (interpreter, torch import, static
  rendezvous) -> its "Starting worker group" line.
- worker start: -> every worker began its checkpoint load (``resume_started``; interpreter,
  imports, process group, model). Workers that predate that event: ``worker_started``, which
  they emit right before the load (``load_start_by`` in the JSON says which).
- checkpoint load: -> every worker emitted ``resumed`` (agree on the step, verify, DCP read).
- first step: -> rank 0's first metrics line with a step past the resumed one.

Events and metrics carry their own wall-clock times; torchrun's log lines (``LOGLEVEL=INFO``) carry
glog timestamps (lines without one are stamped here on arrival). Prints a table and one final
JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import steady_state
from bench.lib.recovery_systems import (
    AGENT_OPTIONS,
    FAULTS,
    HANG_TIMEOUT_S,
    LEASE_TTL_S,
    SYSTEMS,
    TUNED_RDZV_CONF,
    Outcome,
    Settings,
    run_floor,
    run_scenario,
)
from bench.lib.restart_marks import PHASES

TARGET_NODE_LOSS_SPEEDUP = 3.0
TARGET_WORKER_CRASH_OVER_FLOOR = 1.5
TARGET_LIVE_WORKER_KILL_S = 1.0
#: a user's loop (Session.run) heals a worker kill within this much of ftrain train's (issue 41)
TARGET_SESSION_OVER_LIVE_S = 0.1


# -- reporting ----------------------------------------------------------------------------------
def aggregate(outcomes: list[Outcome]) -> dict[str, Any]:
    """Medians over the repeats that recovered (each phase and the total on its own, so the phase
    medians need not add up to the total's)."""
    good = [o.marks for o in outcomes if o.marks is not None]
    result: dict[str, Any] = {
        "runs": len(outcomes),
        "recovered": len(good),
        "errors": [o.error for o in outcomes if o.error],
        "notes": [n for o in outcomes for n in o.notes],
    }
    if not good:
        result["total_s"] = None
        return result
    result["total_s"] = round(statistics.median(m.total_s for m in good), 3)
    steady = [o.steady_step_s for o in outcomes if o.steady_step_s is not None]
    result["steady_step_s"] = round(statistics.median(steady), 5) if steady else None
    for name in PHASES:
        values = [m.phases()[name] for m in good if m.phases()[name] is not None]
        result[f"{name}_s"] = round(statistics.median(values), 3) if values else None
    result["detected_by"] = sorted({m.detected_by for m in good if m.detected_by})
    result["world_size_after"] = sorted({m.world_size for m in good})
    result["load_start_by"] = sorted({m.load_start_by for m in good})
    result["samples"] = [{"fault_time": round(m.fault, 3), "total_s": m.total_s, **m.phases()} for m in good]
    return result


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: dict[str, dict[str, dict[str, Any]]], floor: dict[str, Any], cap_s: float) -> str:
    header = [
        "fault",
        "system",
        "detect",
        "rendezvous",
        "launcher",
        "worker start",
        "ckpt load",
        "first step",
        "total",
        "vs floor",
        "world",
        "first reaction",
    ]
    rows = [header]
    floor_total = floor.get("total_s")
    for fault, by_system in results.items():
        for i, (system, r) in enumerate(by_system.items()):
            name = fault if i == 0 else ""
            if r["total_s"] is None:
                why = (r["errors"] or ["?"])[0]
                text = f"not recovered within {cap_s:.0f} s" if "first step after" in why else f"FAILED: {why}"
                rows.append([name, system, *[""] * len(PHASES), "-", "", "", text[:70]])
                continue
            ratio = f"{r['total_s'] / floor_total:.2f}x" if floor_total else "-"
            rows.append(
                [
                    name,
                    system,
                    *(_cell(r[f"{p}_s"]) for p in PHASES),
                    _cell(r["total_s"]),
                    ratio,
                    ",".join(map(str, r["world_size_after"])),
                    "; ".join(r["detected_by"])[:60],
                ]
            )
    if floor_total is not None:
        rows.append(
            [
                "floor",
                "static torchrun x2",
                "-",
                "-",
                *(_cell(floor[f"{p}_s"]) for p in PHASES[2:]),
                _cell(floor_total),
                "1.00x",
                "2",
                "fresh start from a checkpoint",
            ]
        )
    elif floor.get("runs"):
        rows.append(
            [
                "floor",
                "static torchrun x2",
                *[""] * len(PHASES),
                "-",
                "",
                "",
                f"FAILED: {(floor['errors'] or ['?'])[0]}"[:70],
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for j, row in enumerate(rows):
        cells = (
            c.ljust(w) if i in (0, 1, len(header) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den else None


def soak_goodputs(specs: list[str]) -> dict[str, float]:
    """``MODE=PATH`` -> {mode: the goodput in that soak's report.json}."""
    out = {}
    for spec in specs:
        mode, sep, path = spec.partition("=")
        if not sep or mode not in ("live", "restart"):
            raise ValueError(f"{spec!r}: expected live=PATH or restart=PATH")
        out[mode] = float(json.loads(Path(path).read_text())["goodput"]["goodput"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1, help="runs per scenario; medians when > 1 (default 1)")
    p.add_argument("--quick", action="store_true", help="skip torchrun with default rendezvous settings (slow)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--ckpt-interval", type=int, default=20, help="steps between checkpoints (default 20)")
    p.add_argument("--fault-step", type=int, default=50, help="inject once training passed this step (default 50)")
    p.add_argument("--step-sleep-s", type=float, default=0.03, help="FTRAIN_FAULT_STEP_SLEEP_S (default 0.03)")
    p.add_argument(
        "--collective-timeout-s",
        type=float,
        default=30.0,
        help="parallel.timeout_s for every system: torchrun's only hang detection (default 30)",
    )
    p.add_argument("--cap-s", type=float, default=150.0, help="give up on a recovery after this long (default 150)")
    p.add_argument("--startup-timeout-s", type=float, default=120.0, help="limit to reach --fault-step (default 120)")
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="every system's strategy: ddp (a lost rank healed from a live peer) or fsdp (from the memory tier)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, events, metrics)")
    p.add_argument(
        "--steady-repeats",
        type=int,
        default=3,
        help="pairs of fault-free runs for steady_state_vs_torchrun (bench/steady_state.py; 0: skip; default 3)",
    )
    p.add_argument(
        "--soak-report",
        action="append",
        default=[],
        metavar="MODE=PATH",
        help="report.json of a soak (ftrain chaos run chaos/scenarios/soak.toml --recovery MODE) whose goodput "
        "goes into the JSON line as soak_goodput_MODE (live or restart); repeatable",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: a worker kill, ftrain_live, ftrain_restart and session_live, early, no floor "
        "or steady state",
    )
    args = p.parse_args(argv)
    try:
        soaks = soak_goodputs(args.soak_report)
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--soak-report: {e}")
    if args.smoke:
        args.faults, args.systems, args.repeats = "worker_kill", "ftrain_live,ftrain_restart,session_live", 1
        args.ckpt_interval, args.fault_step, args.steady_repeats = 10, 40, 0
    faults = [f for f in args.faults.split(",") if f]
    systems = [s for s in args.systems.split(",") if s and not (args.quick and s == "torchrun_default")]
    bad = [x for x in faults if x not in FAULTS] + [x for x in systems if x not in SYSTEMS]
    if bad or not faults or not systems:
        p.error(f"unknown or empty faults/systems: {bad}")
    if args.repeats < 1 or args.fault_step <= args.ckpt_interval:
        p.error("need --repeats >= 1 and --fault-step > --ckpt-interval (a checkpoint must exist)")
    settings = Settings(
        steps=100_000,
        ckpt_interval=args.ckpt_interval,
        fault_step=args.fault_step,
        step_sleep_s=args.step_sleep_s,
        collective_timeout_s=args.collective_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        cap_s=args.cap_s,
        parallel=args.parallel,
    )

    cores = os.cpu_count() or 1
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    outcomes: dict[tuple[str, str], list[Outcome]] = {}
    floors: list[Outcome] = []
    workdir = Path(tempfile.mkdtemp(prefix="ftrain-recovery-"))
    print(
        f"work dir {workdir}; faults {faults}; systems {systems}; {args.repeats} repeat(s); {cores} cores; "
        f"checkpoint every {args.ckpt_interval} steps, fault after step {args.fault_step}, step sleep "
        f"{args.step_sleep_s}s, parallel.timeout_s={args.collective_timeout_s:g}",
        flush=True,
    )
    try:
        for rep in range(args.repeats):
            for fault in faults:
                for system in systems:
                    out = run_scenario(system, fault, workdir / f"r{rep}-{fault}-{system}", settings)
                    outcomes.setdefault((fault, system), []).append(out)
                    state = (
                        (f"{out.marks.total_s:.2f}s " + json.dumps(out.marks.phases()))
                        if out.marks
                        else f"FAILED: {out.error}"
                    )
                    print(f"  [{rep}] {fault:11s} {system:16s} {state}  ({out.wall_s:.0f}s wall)", flush=True)
                    ckpt = workdir / f"r{rep}-{fault}-{system}" / "ckpt"
                    ours = system.startswith("ftrain")  # its manifests are of job JOB_ID
                    if not args.smoke and ours and len(floors) == rep and (ckpt / "latest").exists():
                        floor = run_floor(ckpt, workdir / f"r{rep}-floor", settings)
                        floors.append(floor)
                        state = f"{floor.marks.total_s:.2f}s" if floor.marks else f"FAILED: {floor.error}"
                        print(f"  [{rep}] floor (static torchrun x2 from a checkpoint): {state}", flush=True)
        steady_summary = (
            steady_state.measure(
                steady_state.DEFAULT_CONFIG, repeats=args.steady_repeats, steps=300, warmup=30, recovery="live"
            )
            if args.steady_repeats > 0
            else None
        )
    except steady_state.RunFailed as e:
        print(f"steady state not measured: {e}", flush=True)
        steady_summary = None
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    results = {f: {s: aggregate(outcomes[(f, s)]) for s in systems} for f in faults}
    floor = aggregate(floors)
    print()
    print(
        f"Recovery: seconds from the fault to the first step completed after the resume "
        f"({'median of ' + str(args.repeats) if args.repeats > 1 else 'one run each'})."
    )
    print(format_table(results, floor, args.cap_s))
    for fault in faults:
        for system in systems:
            notes = results[fault][system]["notes"]
            if notes:
                more = f" (+{len(notes) - 1} more in the JSON)" if len(notes) > 1 else ""
                print(f"  {fault}/{system}: {notes[0]}{more}")
    load_end = os.getloadavg()[0]
    print(f"load average (1 min): {load_start:.1f} at the start, {load_end:.1f} at the end, on {cores} cores")
    print(
        f"hang: torchrun has no hang detection; its detect column is the gloo collective timeout "
        f"(parallel.timeout_s={args.collective_timeout_s:g} here, ftrain's default is 120) and its rendezvous column "
        "includes the 30 s torchrun waits after SIGTERM before it SIGKILLs the stopped worker; ftrain detects "
        "by heartbeat (--hang-timeout-s 4)."
    )

    def total(fault: str, system: str) -> float | None:
        return results.get(fault, {}).get(system, {}).get("total_s")

    summary = {
        "bench": "recovery",
        "live_worker_kill_s": total("worker_kill", "ftrain_live"),
        "live_node_loss_s": total("node_loss", "ftrain_live"),
        "live_hang_s": total("hang", "ftrain_live"),
        "live_speedup_vs_torchrun_tuned": _ratio(
            total("worker_kill", "torchrun_tuned"), total("worker_kill", "ftrain_live")
        ),
        "live_speedup_vs_restart": _ratio(total("worker_kill", "ftrain_restart"), total("worker_kill", "ftrain_live")),
        # a user's loop (ftrain.Session.run) under the same live agents
        "session_live_worker_kill_s": total("worker_kill", "session_live"),
        "session_live_node_loss_s": total("node_loss", "session_live"),
        "session_live_hang_s": total("hang", "session_live"),
        "session_live_over_live_worker_kill": _ratio(
            total("worker_kill", "session_live"), total("worker_kill", "ftrain_live")
        ),
        # the target: a user's loop heals a worker kill within 0.1 s of ftrain train's
        "session_live_minus_live_worker_kill_s": _difference(
            total("worker_kill", "session_live"), total("worker_kill", "ftrain_live")
        ),
        "session_live_over_live_node_loss": _ratio(
            total("node_loss", "session_live"), total("node_loss", "ftrain_live")
        ),
        # fault-free runs side by side with torchrun --standalone (bench/steady_state.py)
        "steady_state_vs_torchrun": steady_summary["steady_state_vs_torchrun"] if steady_summary else None,
        # a soak, not this bench (ftrain chaos run chaos/scenarios/soak.toml): given by --soak-report
        "soak_goodput_live": soaks.get("live"),
        "soak_goodput_restart": soaks.get("restart"),
        "node_loss_speedup_vs_torchrun_default": _ratio(
            total("node_loss", "torchrun_default"), total("node_loss", "ftrain_restart")
        ),
        "worker_crash_over_floor": _ratio(total("worker_kill", "ftrain_restart"), floor.get("total_s")),
        "node_loss_speedup_vs_torchrun_tuned": _ratio(
            total("node_loss", "torchrun_tuned"), total("node_loss", "ftrain_restart")
        ),
        "worker_crash_speedup_vs_torchrun_default": _ratio(
            total("worker_kill", "torchrun_default"), total("worker_kill", "ftrain_restart")
        ),
        "worker_crash_speedup_vs_torchrun_tuned": _ratio(
            total("worker_kill", "torchrun_tuned"), total("worker_kill", "ftrain_restart")
        ),
        "hang_speedup_vs_torchrun_default": _ratio(total("hang", "torchrun_default"), total("hang", "ftrain_restart")),
        "hang_speedup_vs_torchrun_tuned": _ratio(total("hang", "torchrun_tuned"), total("hang", "ftrain_restart")),
        "floor_s": floor.get("total_s"),
        "targets": {
            "live_worker_kill_s": f"<= {TARGET_LIVE_WORKER_KILL_S}",
            "live_node_loss_s": f"<= lease TTL + 1 = {LEASE_TTL_S + 1}",
            "live_hang_s": f"<= hang_timeout_s + 1 = {HANG_TIMEOUT_S + 1:g}",
            "steady_state_vs_torchrun": f"<= {steady_state.TARGET_RATIO}",
            "node_loss_speedup_vs_torchrun_default": f">= {TARGET_NODE_LOSS_SPEEDUP}",
            "worker_crash_over_floor": f"<= {TARGET_WORKER_CRASH_OVER_FLOOR}",
            "session_live_minus_live_worker_kill_s": f"<= {TARGET_SESSION_OVER_LIVE_S}",
        },
        "results": results,
        "floor": floor,
        "steady_state": steady_summary,
        "settings": {
            **asdict(settings),
            "repeats": args.repeats,
            "tuned_rdzv_conf": TUNED_RDZV_CONF,
            "agent_options": " ".join(AGENT_OPTIONS),
            "systems": systems,
            "faults": faults,
        },
        "cores": cores,
        "load_avg_1min": [load_start, load_end],
        "wall_s": round(time.monotonic() - started, 1),
    }
    speedup, over_floor = summary["node_loss_speedup_vs_torchrun_default"], summary["worker_crash_over_floor"]
    limits = {
        "live_worker_kill_s": TARGET_LIVE_WORKER_KILL_S,
        "live_node_loss_s": LEASE_TTL_S + 1,
        "live_hang_s": HANG_TIMEOUT_S + 1,
        "steady_state_vs_torchrun": steady_state.TARGET_RATIO,
    }
    summary["targets_met"] = {
        **{k: None if summary[k] is None else summary[k] <= limit for k, limit in limits.items()},
        "node_loss_speedup_vs_torchrun_default": None if speedup is None else speedup >= TARGET_NODE_LOSS_SPEEDUP,
        "worker_crash_over_floor": None if over_floor is None else over_floor <= TARGET_WORKER_CRASH_OVER_FLOOR,
        "session_live_minus_live_worker_kill_s": None
        if summary["session_live_minus_live_worker_kill_s"] is None
        else summary["session_live_minus_live_worker_kill_s"] <= TARGET_SESSION_OVER_LIVE_S,
    }
    print(json.dumps(summary))
    all_ok = all(o.marks is not None for runs in outcomes.values() for o in runs) and all(f.marks for f in floors)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
