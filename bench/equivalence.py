"""How far apart do the strategies land? Max |param| and |optimizer state| differences and the
max loss difference of every strategy against single-process training of the tiny test config
(the numbers behind the tolerances in tests/distributed/test_strategies.py).

    .venv/bin/python bench/equivalence.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.jobs import max_abs_diff, optimizer_tensors, train_job

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


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ftrain-equiv-") as tmp:
        results = {name: train_job(Path(tmp) / name.replace("+", "_"), n, *args) for name, n, args in RUNS}
    ref = results["single"]
    rows = []
    print(f"{'strategy':<18} {'ranks':>5} {'max|dparam|':>12} {'max|doptim|':>12} {'max|dloss|':>11}")
    for name, nproc, _ in RUNS[1:]:
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
    print(json.dumps({"vs_single_process": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
