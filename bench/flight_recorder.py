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

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.steady_state import (  # noqa: E402 - after the path setup
    pair_parser,
    pair_summary,
    parse_pair_args,
    report,
    run_agent,
    run_pairs,
)

TARGET_RATIO = 1.02


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
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=2000, help="collectives kept when on (default 2000)")
    args = parse_pair_args(p, argv)
    if args.entries < 1:
        p.error("need --entries >= 1")
    return report(
        lambda: measure(
            args.config,
            repeats=args.repeats,
            steps=args.steps,
            warmup=args.warmup,
            entries=args.entries,
            nproc=args.nproc,
            timeout_s=args.timeout_s,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
