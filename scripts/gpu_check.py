"""``make gpu-check``: ftrain on one CUDA device, within 8 minutes, summed up in one JSON line.

    python scripts/gpu_check.py [--dry] [--only NAME_PART ...] [--budget-s SECONDS]

The checks (docs/gpu.md says what each figure means):

- ``train/<gpt|llama>/<strategy>/x1``: ``torchrun --standalone --nproc-per-node=1 -m ftrain train``
  in bf16 on ``cuda`` over NCCL, for every strategy ``ftrain plan`` accepts at one rank, for the
  reference GPT and the built-in Llama;
- ``train/<gpt|llama>/<ddp|fsdp>/x2-gloo``: two ranks sharing the one device, gloo carrying CUDA
  tensors (``ftrain.distributed.select_device`` maps local ranks beyond the GPUs round-robin);
- ``live/gpt/ddp/x2-gloo/worker_kill``: ``ftrain agent --recovery live``, a worker SIGKILLed,
  healed from its live peer by a spare;
- ``flight_recorder``: a one-rank NCCL group's all_reduces in the recorder's snapshot;
- ``checkpoint_bench``: ``bench/checkpoint.py``'s blocked ratio, save and load against raw I/O;
- ``plan_vs_measured``: ``ftrain plan``'s estimate against ``torch.cuda.max_memory_allocated``.

Each check is ok, failed or skipped (with the reason), with its wall seconds, its figures and, on
failure, the last lines of what failed; one failure never stops the others. Checks run side by
side, each with a timeout of its own, all inside ``--budget-s`` (default 450 s on the device).

Dry mode (``--dry``, or whenever ``torch.cuda.is_available()`` is false): the same checks and the
same summary, run on the CPU at the smallest sizes (fp32 for bf16, gloo for NCCL, 4 MB of state),
one job of each kind and every other command line validated (its config loaded with its
overrides, its strategy's layout computed) but not run. It proves the plumbing (imports, config
keys, command lines, the bench's options and its JSON) and nothing about a GPU: its summary says
``"mode": "dry"`` and ``"cuda": false``. Exit code 0 if no check failed, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_lib import ckpt, flight, live, training
from gpu_check_lib.core import FAILED, OK, SKIPPED, Check, Mode, Result, lanes_for, run_checks

#: the whole run must end within 8 minutes of its start on the device; checks get this much of it
GPU_BUDGET_S = 450.0
#: a cap for the dry run (it takes well under a minute on 2 cores)
DRY_BUDGET_S = 150.0
#: per-check timeouts, seconds: (on the device, dry)
TIMEOUTS_S = {
    "train_x1": (120.0, 60.0),
    "train_x2": (150.0, 75.0),
    "live": (200.0, 100.0),
    "flight": (90.0, 45.0),
    "checkpoint": (420.0, 100.0),
    "plan": (240.0, 60.0),
}
MODELS = ("gpt", "llama")


def build_checks(mode: Mode, root: Path) -> tuple[list[Check], dict[str, Any], list[Result]]:
    """Every check of this mode; what ``ftrain plan`` says of each strategy at one rank; and a
    failed result if that could not be worked out (the training checks then use ddp and fsdp)."""
    t = {k: v[1] if mode.dry else v[0] for k, v in TIMEOUTS_S.items()}
    checks: list[Check] = []
    plan_info: dict[str, Any] = {}
    broken: list[Result] = []
    for model in MODELS:
        began = time.monotonic()
        try:
            names, not_at_one = training.one_rank_strategies(mode, model)
        except Exception as e:  # noqa: BLE001 - reported as a failed check; the others still run
            names, not_at_one = list(training.TWO_RANK_STRATEGIES), {}
            error = f"{type(e).__name__}: {e}"
            broken.append(
                Result(f"train/{model}/strategies_at_one_rank", FAILED, time.monotonic() - began, error=error)
            )
        plan_info[model] = {"at_one_rank": names, "not_at_one_rank": not_at_one}
        checks += [training.train_check(mode, model, s, 1, root, t["train_x1"]) for s in names]
    for model in MODELS:
        checks += [training.train_check(mode, model, s, 2, root, t["train_x2"]) for s in training.TWO_RANK_STRATEGIES]
    checks += [
        live.check(mode, root, t["live"]),
        flight.check(mode, t["flight"]),
        ckpt.check(mode, t["checkpoint"]),
        training.plan_check(mode, root, t["plan"]),
    ]
    return checks, plan_info, broken


def device_name(mode: Mode) -> str:
    import torch

    return torch.cuda.get_device_name(0) if mode.cuda else "cpu"


def progress(result: Result) -> None:
    """One line per finished check, as it finishes (the summary is the last line)."""
    if result.status != OK:
        detail = result.reason or (result.error.splitlines() or [""])[0]
    elif "rows" in result.figures:
        rows = result.figures["rows"]
        detail = ", ".join(
            f"{r['model']}/{r['strategy']} estimate vs measured {r['relative_error']:+.1%}" for r in rows
        )
    else:
        detail = ", ".join(f"{k}={v}" for k, v in result.figures.items() if not isinstance(v, (dict, list)))
    print(f"{result.status:7s} {result.name} ({result.wall_s:.1f}s) {detail[:240]}", flush=True)


def kill_leftovers() -> None:
    """SIGKILL every process still under this one (each check kills its own; this is the backstop)."""
    from ftrain.agents.workers import descendants, signal_pids

    signal_pids(descendants(os.getpid()), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="the CPU stand-in run (also the default without CUDA)")
    p.add_argument("--only", nargs="+", default=[], metavar="NAME_PART", help="run only checks whose name has one")
    p.add_argument("--budget-s", type=float, default=None, help=f"all checks within (default {GPU_BUDGET_S:g} s)")
    args = p.parse_args(argv)

    began = time.monotonic()
    import torch

    mode = Mode(dry=args.dry or not torch.cuda.is_available())
    budget_s = args.budget_s or (DRY_BUDGET_S if mode.dry else GPU_BUDGET_S)
    lanes = lanes_for(mode)
    print(f"gpu-check: {'dry (CPU stand-ins)' if mode.dry else 'on ' + device_name(mode)}, {lanes} lanes", flush=True)
    with tempfile.TemporaryDirectory(prefix="ftrain-gpu-check-") as tmp:
        try:
            checks, plan_info, broken = build_checks(mode, Path(tmp))
            if args.only:
                checks = [c for c in checks if any(part in c.name for part in args.only)]
            for result in broken:
                progress(result)
            results = broken + run_checks(checks, budget_s=budget_s, lanes=lanes, report=progress)
        finally:
            kill_leftovers()  # before the directory they may write in goes
    counts = {s: sum(r.status == s for r in results) for s in (OK, FAILED, SKIPPED)}
    summary = {
        "gpu_check": "summary",
        "mode": "dry" if mode.dry else "gpu",
        "cuda": mode.cuda,
        "device": device_name(mode),
        "torch": torch.__version__,
        "ok": counts[FAILED] == 0,
        "counts": counts,
        "wall_s": round(time.monotonic() - began, 1),
        "budget_s": budget_s,
        "lanes": lanes,
        "strategies": plan_info,
        "checks": [r.to_dict() for r in results],
    }
    print(json.dumps(summary), flush=True)
    return 0 if counts[FAILED] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
