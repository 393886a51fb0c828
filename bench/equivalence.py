"""How far apart do the strategies land? Max |param| and |optimizer state| differences and the
max loss difference of every strategy against single-process training of the tiny test config
(the numbers behind the tolerances in tests/distributed/test_strategies.py).

    .venv/bin/python bench/equivalence.py [--strategies ddp,fsdp,...] [--steps 10] [--smoke]

Every run is a real ``torchrun --standalone -m ftrain train`` job (``ftrain.testbed.jobs.train_job``).
``--smoke`` (the test suite's run): single process, ddp and fsdp, 4 steps. Prints a table and
one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftrain.testbed.jobs import max_abs_diff, optimizer_tensors, train_job

#: (name, ranks, overrides); the first is the reference every other run is compared with.
RUNS = [
    ("single", 1, []),
    ("ddp", 2, []),
    ("zero1", 2, ["--parallel.strategy=zero1"]),
    ("zero2", 2, ["--parallel.strategy=zero2"]),
    ("fsdp", 2, ["--parallel.strategy=fsdp"]),
    ("hsdp", 4, ["--parallel.strategy=hsdp"]),
    ("tp", 2, ["--parallel.strategy=tp"]),
    ("fsdp+tp", 4, ["--parallel.strategy=fsdp+tp"]),
    ("ddp-deterministic", 4, ["--parallel.deterministic=true"]),
]
DEFAULT_STEPS = 10  # ftrain.testbed.jobs.TINY_CONFIG's
SMOKE_STRATEGIES, SMOKE_STEPS = ("ddp", "fsdp"), 4


def main(argv: list[str] | None = None) -> int:
    names = [name for name, _, _ in RUNS[1:]]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", help=f"comma-separated among {','.join(names)} (default: all)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps per run (default {DEFAULT_STEPS})")
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"the test suite's run: {','.join(SMOKE_STRATEGIES)} against one process, {SMOKE_STEPS} steps",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.steps = SMOKE_STEPS
    default = SMOKE_STRATEGIES if args.smoke else names
    chosen = [s.strip() for s in (args.strategies or ",".join(default)).split(",") if s.strip()]
    unknown = [s for s in chosen if s not in names]
    if unknown or not chosen or args.steps < 1:
        p.error(f"unknown or no strategies {unknown} (choose from {', '.join(names)}), or --steps < 1")
    runs = [RUNS[0]] + [r for r in RUNS[1:] if r[0] in chosen]

    steps = f"--train.steps={args.steps}"
    with tempfile.TemporaryDirectory(prefix="ftrain-equiv-") as tmp:
        results = {name: train_job(Path(tmp) / name.replace("+", "_"), n, steps, *over) for name, n, over in runs}
    ref = results["single"]
    rows = []
    print(f"{'strategy':<18} {'ranks':>5} {'max|dparam|':>12} {'max|doptim|':>12} {'max|dloss|':>11}")
    for name, nproc, _ in runs[1:]:
        run = results[name]
        row = {
            "strategy": name,
            "ranks": nproc,
            "param": max_abs_diff(run.final["model"], ref.final["model"]),
            "optim": max_abs_diff(optimizer_tensors(run.final["optim"]), optimizer_tensors(ref.final["optim"])),
            "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(run.metrics, ref.metrics, strict=True)),
        }
        rows.append(row)
        print(f"{name:<18} {nproc:>5} {row['param']:>12.2e} {row['optim']:>12.2e} {row['loss']:>11.2e}")
    summary = {
        "bench": "equivalence",
        "smoke": args.smoke,
        "steps": args.steps,
        "steps_run": len(ref.metrics),
        "vs_single_process": rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
