"""What the flight recorder costs: steady-state step time with it on against off.

    python bench/flight_recorder.py [--repeats 5] [--steps 300] [--warmup 30] [--entries 2000]
                                    [--config configs/demo.toml] [--smoke]

The demo job (ddp on 2 ranks, no checkpoints) under one node agent (``--recovery restart``:
heartbeats, the stack-dump handler and the flight-record server all running), in pairs run
one right after the other, the order alternating from pair to pair:

- ``on``: ``logging.flight_recorder_entries = --entries`` (the default, 2000): torch records
  every collective of every group, and each worker serves its record to the agent;
- ``off``: ``logging.flight_recorder_entries = 0``.

Each run's figure is the median ``step_time_s`` of rank 0's metrics after ``--warmup`` steps;
the result is the median over pairs of on / off (target: <= 1.02). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.steady_state import DEFAULT_CONFIG, RunFailed, pair_summary, run_agent, run_pairs  # noqa: E402

TARGET_RATIO = 1.02
SMOKE_STEPS, SMOKE_WARMUP = 40, 10


def measure(
    config: Path, *, repeats: int, steps: int, warmup: int, entries: int, nproc: int = 2, timeout_s: float = 600.0
) -> dict[str, Any]:
    started, load_start = time.monotonic(), os.getloadavg()[0]
    print(
        f"flight recorder: {repeats} pair(s) of {steps}-step runs of {config.name} on {nproc} ranks under an agent, "
        f"recorder on ({entries} entries) vs off; first {warmup} steps left out",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ftrain-flight-") as tmp:
        workdir = Path(tmp)

        def run(side: str, name: str) -> Path:
            extra = [f"--logging.flight_recorder_entries={entries if side == 'on' else 0}"]
            return run_agent(config, workdir, name, steps, nproc, "restart", timeout_s, extra)

        pairs = run_pairs(("on", "off"), run, repeats=repeats, warmup=warmup)
    settings = {"config": str(config), "steps": steps, "warmup": warmup, "entries": entries, "nproc": nproc}
    return pair_summary(
        "flight_recorder",
        "recorder_on_vs_off",
        ("on", "off"),
        pairs,
        target=TARGET_RATIO,
        settings={**settings, "repeats": repeats},
        started=started,
        load_start=load_start,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="pairs of runs (default 5)")
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="first steps of each run left out (default 30)")
    p.add_argument("--entries", type=int, default=2000, help="collectives kept when on (default 2000)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit per run (default 600)")
    p.add_argument("--smoke", action="store_true", help=f"one pair of {SMOKE_STEPS}-step runs (the test suite's)")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.warmup = 1, SMOKE_STEPS, SMOKE_WARMUP
    if args.repeats < 1 or args.warmup >= args.steps or args.entries < 1:
        p.error("need --repeats >= 1, --warmup < --steps and --entries >= 1")
    try:
        summary = measure(
            args.config,
            repeats=args.repeats,
            steps=args.steps,
            warmup=args.warmup,
            entries=args.entries,
            nproc=args.nproc,
            timeout_s=args.timeout_s,
        )
    except RunFailed as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
