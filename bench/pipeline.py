"""Pipeline parallelism: tokens/s, the measured bubble against the formula, and each stage's peak
memory against ``ftrain plan``'s estimate, for every schedule at pp=2 and pp=4.

    python bench/pipeline.py [--steps 8] [--warmup 3] [--micro-batches 8] [--pp 2,4]
                             [--schedules gpipe,1f1b,interleaved_1f1b] [--model-size small] [--smoke]

Each run is a real ``torchrun --standalone -m ftrain train`` job on CPU/gloo with
``parallel.pp_size`` = P ranks (dp = 1), m = ``--micro-batches`` micro-batches per step
(``train.global_batch_size`` = m x micro batch) and the environment of bench/strategies.py. A
one-process run of the same job (no pipeline) is the baseline of the tokens/s ratio.

- ``bubble``: each rank's share of the schedule's time not spent in a stage's forward or backward
  (``rank_pp_bubble`` of the metrics: waiting on its neighbours, the send/receive overhead
  included), the mean over ranks and measured steps. ``formula``: (P - 1) / (m + P - 1) for gpipe
  and 1f1b, (P - 1) / (V m + P - 1) for interleaved_1f1b with V chunks per rank (V = 2).
  ``sim``: a timeline of the same action orders with free messages and a backward twice a forward
  (ftrain.parallel.pipeline_schedule.simulate).
- ``peak``: each rank's peak RSS at the last step; ``plan``: ``ftrain plan``'s estimate for that
  stage (ftrain.planning.plan_pipeline.stage_estimates); ``err``: (plan - peak) / peak. Target: within 10%.
  The estimate includes a per-process baseline (``ftrain.planning.memory.CPU_BASELINE_BYTES``: torch, DCP,
  gloo), a constant, while the resident pages of torch's libraries move with what else maps them
  (341-428 MB measured); so the bench also measures the machine's own (a one-rank run of a
  0.1M-parameter model, less its estimate without the baseline) and gives ``err here``: the error
  with it, the model's part of the estimate alone.

On a machine with fewer cores than P ranks the stages time-slice the cores: their compute slows
and the bubble measured there is not the schedule's (the table says when). Ends with one JSON
line. ``--smoke`` (the test suite's run): the tiny model, pp=2 and 4 steps per schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from strategies import MODELS, aligned, config_toml, failure_reason, torchrun_train, worker_env

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SMOKE_STEPS, SMOKE_WARMUP, SMOKE_TIMEOUT_S = 4, 1, 120.0
#: the pipeline needs blocks to split: pp=4 x 2 chunks needs 8
N_LAYER = 8


def _layout_args(pp: int, schedule: str, split: str = "") -> list[str]:
    if pp == 1:
        return []
    args = [f"--parallel.pp_size={pp}", f"--parallel.pp_schedule={schedule}"]
    args += [f"--parallel.pp_split={split}"] if split else []
    return args + (["--parallel.pp_virtual_stages=2"] if schedule == "interleaved_1f1b" else [])


def measure(
    config_path: Path,
    workdir: Path,
    pp: int,
    schedule: str,
    *,
    warmup: int,
    env: dict[str, str],
    timeout_s: float,
    split: str = "",
) -> dict[str, Any]:
    """One job; its tokens/s, bubble and per-rank peaks, or why it failed."""
    overrides = tuple(_layout_args(pp, schedule, split))
    job = torchrun_train(config_path, pp, "ddp", workdir, env=env, timeout_s=timeout_s, overrides=overrides)
    measured = [m for m in job.metrics if m["step"] > warmup]
    row: dict[str, Any] = {"pp": pp, "schedule": schedule if pp > 1 else "none", "split": split, "ok": bool(measured)}
    if job.returncode != 0 or not measured:
        row.update(ok=False, error=failure_reason(job))
        return row
    row.update(
        tokens_per_s=statistics.median(m["tokens_per_s"] for m in measured),
        step_time_s=statistics.median(m["step_time_s"] for m in measured),
        peak_per_rank=job.metrics[-1]["peak_mem_bytes"],  # ru_maxrss is a lifetime peak
    )
    if pp > 1:
        row["bubble"] = statistics.mean(b for m in measured for b in m["rank_pp_bubble"])
        row["bubble_per_rank"] = [
            round(statistics.mean(m["rank_pp_bubble"][r] for m in measured), 4) for r in range(pp)
        ]
    return row


def install_baseline(workdir: Path, *, env: dict[str, str], timeout_s: float) -> int | None:
    """This install's per-process baseline: a one-rank run of the tiny model, its peak less what
    ``ftrain plan`` estimates without its constant baseline; None if that run fails."""
    from ftrain.config import load_config
    from ftrain.planning.memory import CPU_BASELINE_BYTES
    from ftrain.planning.plan_pipeline import stage_estimates

    tiny = workdir / "baseline"
    tiny.mkdir()
    config_path = tiny / "config.toml"
    config_path.write_text(config_toml({**MODELS["tiny"]["model"], "n_layer": 2}, MODELS["tiny"]["train"], steps=2))
    job = torchrun_train(config_path, 1, "ddp", tiny, env=env, timeout_s=timeout_s)
    if job.returncode != 0 or not job.metrics:
        return None
    [estimate] = stage_estimates(load_config(config_path), world_size=1, gpus_per_node=1)
    return max(job.metrics[-1]["peak_mem_bytes"]) - (estimate.total_bytes - CPU_BASELINE_BYTES)


def add_model(row: dict[str, Any], config_path: Path, micro_batches: int, baseline: int | None) -> None:
    """The formula, the simulation and ``ftrain plan``'s per-stage estimates beside a measured row."""
    from ftrain.config import load_config
    from ftrain.parallel.pipeline_schedule import bubble_fraction, simulate
    from ftrain.planning.memory import CPU_BASELINE_BYTES
    from ftrain.planning.plan_pipeline import stage_estimates

    pp, schedule = row["pp"], row["schedule"]
    v = 2 if schedule == "interleaved_1f1b" else 1
    if pp > 1:
        row["formula"] = bubble_fraction(schedule, pp, micro_batches, v)
        row["sim"] = simulate(schedule, pp, micro_batches, v)
    cfg = load_config(config_path, _layout_args(pp, schedule, row["split"]))
    estimates = stage_estimates(cfg, world_size=pp, gpus_per_node=pp)
    row["plan_per_rank"] = [e.total_bytes for e in estimates]
    if row["ok"]:
        row["plan_error_per_rank"] = [
            round((est - peak) / peak, 4) for est, peak in zip(row["plan_per_rank"], row["peak_per_rank"], strict=True)
        ]
        row["plan_error_max"] = max(abs(e) for e in row["plan_error_per_rank"])
        if baseline is not None:
            here = [est - CPU_BASELINE_BYTES + baseline for est in row["plan_per_rank"]]
            row["plan_error_here_per_rank"] = [
                round((est - peak) / peak, 4) for est, peak in zip(here, row["peak_per_rank"], strict=True)
            ]
            row["plan_error_here_max"] = max(abs(e) for e in row["plan_error_here_per_rank"])


def _mb(values: list[int]) -> str:
    return "/".join(f"{v / 1e6:.0f}" for v in values)


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["pp"] == 1 and r["ok"]), None)
    header = [
        "pp",
        "schedule",
        "tokens/s",
        "vs 1 rank",
        "bubble",
        "formula",
        "sim",
        "peak MB",
        "plan MB",
        "err",
        "err here",
    ]
    lines = [header]
    for r in rows:
        if not r["ok"]:
            lines.append([str(r["pp"]), r["schedule"], "FAILED", r["error"][:60], "", "", "", "", "", "", ""])
            continue
        lines.append(
            [
                str(r["pp"]),
                r["schedule"],
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
                f"{r['bubble']:.3f}" if "bubble" in r else "-",
                f"{r['formula']:.3f}" if "formula" in r else "-",
                f"{r['sim']:.3f}" if "sim" in r else "-",
                _mb(r["peak_per_rank"]),
                _mb(r["plan_per_rank"]),
                f"{r['plan_error_max']:.1%}",
                f"{r['plan_error_here_max']:.1%}" if "plan_error_here_max" in r else "-",
            ]
        )
    return aligned(lines, left=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="leading steps left out (default 3)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step, m (default 8)")
    p.add_argument("--pp", default="2,4", help="pipeline degrees (default 2,4)")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--pp-split", default="", help="parallel.pp_split for the pipeline runs (one --pp degree)")
    p.add_argument("--model-size", choices=sorted(MODELS), default="small", help="bench/strategies.py's, 8 blocks")
    p.add_argument("--timeout-s", type=float, default=600, help="per job (default 600)")
    p.add_argument("--smoke", action="store_true", help="the test suite's run: tiny model, pp=2, 4 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.model_size, args.steps, args.warmup, args.pp = "tiny", SMOKE_STEPS, SMOKE_WARMUP, "2"
        args.timeout_s = min(args.timeout_s, SMOKE_TIMEOUT_S)
    degrees = [int(x) for x in args.pp.split(",") if x.strip()]
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if any(s not in SCHEDULES for s in schedules) or any(d < 2 for d in degrees) or args.steps <= args.warmup:
        p.error(f"schedules among {', '.join(SCHEDULES)}, pp degrees >= 2, --steps > --warmup")
    spec = MODELS[args.model_size]
    model = {**spec["model"], "n_layer": N_LAYER}
    micro = spec["train"]["micro_batch_size"]
    train = {"global_batch_size": args.micro_batches * micro, "micro_batch_size": micro}
    env = worker_env()
    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ftrain-bench-pp-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "config.toml"
        config_path.write_text(config_toml(model, train, steps=args.steps))
        print(
            f"model {args.model_size} with {N_LAYER} blocks: {model}; m={args.micro_batches} micro-batches of {micro} "
            f"x seq {model['seq_len']} per step; cpu fp32 gloo, {args.steps} steps ({args.warmup} dropped); "
            f"{cores} cores",
            flush=True,
        )
        baseline = install_baseline(workdir, env=env, timeout_s=args.timeout_s)
        print(f"  this install's per-process baseline: {baseline / 1e6:.0f} MB" if baseline else "  baseline: FAILED")
        runs = [(1, "none")] + [(pp, s) for pp in degrees for s in schedules]
        for pp, schedule in runs:
            split = args.pp_split if pp > 1 else ""
            row = measure(
                config_path, workdir, pp, schedule, warmup=args.warmup, env=env, timeout_s=args.timeout_s, split=split
            )
            add_model(row, config_path, args.micro_batches, baseline)
            rows.append(row)
            state = f"{row['tokens_per_s']:,.0f} tokens/s" if row["ok"] else f"FAILED: {row['error']}"
            print(f"  pp={pp} {schedule}: {state}", flush=True)
    print()
    print(table(rows))
    if any(pp > cores for pp in degrees):
        print(
            f"\ncaveat: {cores} cores; runs with more ranks than cores time-slice them, so their tokens/s and "
            "bubble measure the sharing as much as the schedule."
        )
    ok = all(r["ok"] for r in rows)
    errors = [r["plan_error_max"] for r in rows if "plan_error_max" in r]
    errors_here = [r["plan_error_here_max"] for r in rows if "plan_error_here_max" in r]
    summary = {
        "bench": "pipeline",
        "smoke": args.smoke,
        "model_size": args.model_size,
        "micro_batches": args.micro_batches,
        "cores": cores,
        "ok": ok,
        "install_baseline_bytes": baseline,
        "plan_within_10pct": bool(errors) and max(errors) <= 0.10,
        "plan_within_10pct_here": bool(errors_here) and max(errors_here) <= 0.10,
        "runs": rows,
    }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
