"""Throughput and peak memory of every parallel strategy on the same model and global batch.

    python bench/strategies.py [--steps 10] [--warmup 3] [--model-size tiny|small|medium]
                               [--strategies ddp,zero1,...] [--no-malloc-tuning] [--smoke]

Each strategy is a real ``torchrun --standalone -m ftrain train`` job on CPU/gloo (2 ranks;
hsdp and fsdp+tp need 4). Every job gets the same environment: OMP_NUM_THREADS=1,
OMP_WAIT_POLICY=PASSIVE and, unless --no-malloc-tuning, MALLOC_MMAP_THRESHOLD_=65536
MALLOC_TRIM_THRESHOLD_=0 (glibc returns freed tensors, so peak RSS is live memory rather than
fragmentation). The first --warmup steps are dropped; tokens/s is the median of the rest,
peak RSS the largest rank's. ``plan`` is ``ftrain plan``'s estimate for the same job.

Prints a table, ratios to DDP, and one final JSON line with every number. ``--smoke`` (the
test suite's run) is the same path on the tiny model for a few steps: ddp, fsdp and the 4-rank
hsdp unless ``--strategies`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ftrain.parallel.strategies import STRATEGIES  # the registry's names; torch-free

RANKS = {"hsdp": 4, "fsdp+tp": 4}  # 2 otherwise
CORES_NOTE_THRESHOLD = 4
#: --smoke: the tiny model, a few steps, a 2-rank replicated, a 2-rank sharded and a 4-rank job.
SMOKE_STRATEGIES = ("ddp", "fsdp", "hsdp")
SMOKE_STEPS, SMOKE_WARMUP, SMOKE_TIMEOUT_S = 4, 1, 120.0

#: Model sizes. n_head is a multiple of 4 so tp (2 ranks) and fsdp+tp (tp=2) both split it.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": dict(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64),
        "train": dict(global_batch_size=16, micro_batch_size=4),
    },
    # Model states (16 B/param = 163 MB for DDP) outweigh activations (~21 MB), so the memory
    # columns show the strategies; 512 tokens per step keep the 7 jobs to a few minutes.
    "small": {
        "model": dict(vocab_size=4096, seq_len=64, n_layer=4, n_head=4, d_model=384),
        "train": dict(global_batch_size=8, micro_batch_size=2),
    },
    "medium": {
        "model": dict(vocab_size=8192, seq_len=256, n_layer=8, n_head=8, d_model=512),
        "train": dict(global_batch_size=8, micro_batch_size=2),
    },
}

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def config_toml(model: dict[str, Any], train: dict[str, Any], *, steps: int, num_samples: int = 10_000) -> str:
    """A CPU fp32 job: synthetic data, no dropout, progress lines off."""
    lines = ["[train]", f"steps = {steps}", 'device = "cpu"', 'dtype = "fp32"', "seed = 0"]
    lines += [f"{k} = {v}" for k, v in train.items()]
    lines += ["", "[model]"] + [f"{k} = {v}" for k, v in model.items()]
    lines += [
        "",
        "[data]",
        f"num_samples = {num_samples}",
        "",
        "[optim]",
        "warmup_steps = 2",
        "",
        "[logging]",
        'progress = "off"',
    ]
    return "\n".join(lines) + "\n"


def worker_env(malloc_tuning: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        FTRAIN_LOG_LEVEL="WARNING",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    if malloc_tuning:
        env.update(MALLOC_ENV)
    else:
        for key in MALLOC_ENV:
            env.pop(key, None)
    return env


@dataclass
class Job:
    strategy: str
    nproc: int
    returncode: int
    wall_s: float
    output: str
    metrics: list[dict[str, Any]] = field(default_factory=list)


def torchrun_train(
    config_path: Path,
    nproc: int,
    strategy: str,
    workdir: Path,
    *,
    env: dict[str, str],
    timeout_s: float,
    overrides: tuple[str, ...] = (),
) -> Job:
    """One ``torchrun --standalone -m ftrain train`` job; its processes are killed in ``finally``."""
    from ftrain.observability.metrics import read_metrics
    from ftrain.testbed.jobs import run_within

    metrics_path = workdir / f"metrics-{strategy.replace('+', '_')}-{nproc}.jsonl"
    metrics_path.unlink(missing_ok=True)  # the writer appends
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "ftrain",
        "train",
        str(config_path),
        f"--parallel.strategy={strategy}",
        f"--logging.metrics_path={metrics_path}",
        *overrides,
    ]
    start = time.perf_counter()
    proc = run_within(cmd, timeout_s=timeout_s, env=env, cwd=workdir)
    metrics = read_metrics(metrics_path) if metrics_path.exists() else []
    return Job(strategy, nproc, proc.returncode, time.perf_counter() - start, proc.stdout or "", metrics)


def failure_reason(job: Job) -> str:
    return output_failure(job.output, job.returncode)


def output_failure(output: str, returncode: int) -> str:
    """What a failed torchrun job said: a worker's own fatal lines first (torchrun's report after
    them names only the signal), else its error lines, else the end of its output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if ln.startswith(("terminate called", "what()", "Fatal Python error"))]
    keys = ("Error", "error:", "Signal", "Killed", "timed out")
    picked = fatal + [ln for ln in lines if any(k in ln for k in keys) and "error_file" not in ln]
    return " / ".join((picked[:1] + picked[1:][-3:]) if picked else lines[-4:])[:600] or f"exit {returncode}, no output"


def run_with_retry(
    config_path: Path,
    nproc: int,
    strategy: str,
    workdir: Path,
    *,
    env: dict[str, str],
    timeout_s: float,
    retries: int,
    overrides: tuple[str, ...] = (),
) -> tuple[Job, list[str]]:
    """Run a job; a failed one is run again up to ``retries`` times and each failure reported."""
    failures = []
    while True:
        job = torchrun_train(config_path, nproc, strategy, workdir, env=env, timeout_s=timeout_s, overrides=overrides)
        if job.returncode == 0 or len(failures) >= retries:
            return job, failures
        failures.append(failure_reason(job))
        print(
            f"  {strategy} x{nproc}: failed (exit {job.returncode}), running it again: {failures[-1]}",
            file=sys.stderr,
            flush=True,
        )


def summarise(job: Job, warmup: int) -> dict[str, Any]:
    measured = [m for m in job.metrics if m["step"] > warmup]
    if job.returncode != 0 or not measured:
        return {"strategy": job.strategy, "ranks": job.nproc, "ok": False, "error": failure_reason(job)}
    return {
        "strategy": job.strategy,
        "ranks": job.nproc,
        "ok": True,
        "steps_measured": len(measured),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in measured),
        "step_time_s": statistics.median(m["step_time_s"] for m in measured),
        # ru_maxrss is a lifetime peak: the last step holds the run's peak per rank.
        "peak_rss_bytes": max(job.metrics[-1]["peak_mem_bytes"]),
        "peak_rss_per_rank": job.metrics[-1]["peak_mem_bytes"],
        "final_loss": job.metrics[-1]["loss"],
        "wall_s": round(job.wall_s, 1),
    }


def plan_estimate(config_path: Path, strategy: str, nproc: int) -> int | None:
    """``ftrain plan``'s per-rank estimate for this job (CPU fp32, all ranks on one node)."""
    from ftrain.config import load_config
    from ftrain.planning.memory import Target, layout_for, model_stats
    from ftrain.planning.plan import estimate

    cfg = load_config(config_path, [f"--parallel.strategy={strategy}"])
    layout = layout_for(cfg, strategy, world_size=nproc, gpus_per_node=nproc)
    return estimate(model_stats(cfg.model, cfg.optim), cfg, layout, Target("cpu", "fp32")).total_bytes


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f} MB"


def format_table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["strategy"] == "ddp" and r["ok"]), None)
    header = ["strategy", "ranks", "tokens/s", "vs ddp", "peak RSS/rank", "vs ddp", "plan est.", "plan err"]
    rows = [header]
    for r in results:
        if not r["ok"]:
            rows.append([r["strategy"], str(r["ranks"]), "FAILED", "", "", "", "", r["error"][:60]])
            continue
        tps, peak = r["tokens_per_s"], r["peak_rss_bytes"]
        est = r.get("plan_bytes")
        rows.append(
            [
                r["strategy"],
                str(r["ranks"]),
                f"{tps:,.0f}",
                f"{tps / base['tokens_per_s']:.2f}x" if base else "-",
                _mb(peak),
                f"{peak / base['peak_rss_bytes']:.2f}x" if base else "-",
                _mb(est),
                f"{(est - peak) / peak:+.0%}" if est else "-",
            ]
        )
    return aligned(rows)


def aligned(rows: list[list[str]], left: int = 1) -> str:
    """``rows`` (the first is the header) as a text table: the first ``left`` columns left-aligned,
    the rest right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = (c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per strategy (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="leading steps left out of the median (default 3)")
    p.add_argument("--model-size", choices=sorted(MODELS), default="small")
    p.add_argument("--strategies", help=f"comma-separated (default: all; with --smoke: {','.join(SMOKE_STRATEGIES)})")
    p.add_argument("--timeout-s", type=float, default=600, help="per job (default 600)")
    p.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults")
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="re-run a failed job this many times (default 1; every failure is reported)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"the test suite's run: tiny model, {SMOKE_STEPS} steps ({SMOKE_WARMUP} warm-up), "
        f"{','.join(SMOKE_STRATEGIES)} unless --strategies",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.model_size, args.steps, args.warmup = "tiny", SMOKE_STEPS, SMOKE_WARMUP
        args.timeout_s = min(args.timeout_s, SMOKE_TIMEOUT_S)
    default = SMOKE_STRATEGIES if args.smoke else STRATEGIES
    strategies = [s.strip() for s in (args.strategies or ",".join(default)).split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        p.error(f"unknown or no strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    from ftrain.config import load_config
    from ftrain.planning.memory import model_stats

    spec = MODELS[args.model_size]
    env = worker_env(malloc_tuning=not args.no_malloc_tuning)
    cores = os.cpu_count() or 1
    load_start = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="ftrain-bench-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "config.toml"
        config_path.write_text(config_toml(spec["model"], spec["train"], steps=args.steps))
        cfg = load_config(config_path)
        num_params = model_stats(cfg.model, cfg.optim).num_params
        print(
            f"model {args.model_size}: {num_params / 1e6:.2f}M params, {spec['model']}; global batch "
            f"{cfg.train.global_batch_size} x seq {cfg.model.seq_len}, micro batch {cfg.train.micro_batch_size}; "
            f"cpu fp32, {args.steps} steps ({args.warmup} warmup dropped); {cores} cores; "
            f"malloc tuning {'off' if args.no_malloc_tuning else 'on'}",
            flush=True,
        )
        for s in strategies:
            nproc = RANKS.get(s, 2)
            job, failures = run_with_retry(
                config_path, nproc, s, workdir, env=env, timeout_s=args.timeout_s, retries=args.retries
            )
            r = summarise(job, args.warmup)
            if failures:
                r["failed_attempts"] = failures
            if r["ok"]:
                r["plan_bytes"] = plan_estimate(config_path, s, nproc)
                print(
                    f"  {s:8s} x{nproc}: {r['tokens_per_s']:,.0f} tokens/s, peak {_mb(r['peak_rss_bytes'])}"
                    f"/rank, {r['wall_s']}s",
                    flush=True,
                )
            else:
                print(f"  {s:8s} x{nproc}: FAILED (exit {job.returncode}): {r['error']}", flush=True)
            results.append(r)
    print()
    print(format_table(results))
    oversubscribed = [r["strategy"] for r in results if r["ranks"] > cores]
    if oversubscribed:
        print(
            f"\ncaveat: {cores} cores; the runs with more ranks than cores ({', '.join(oversubscribed)}) "
            "oversubscribe them, so their tokens/s is not comparable with the 2-rank runs (it measures "
            "time-slicing as much as the strategy)."
        )
    load_end = os.getloadavg()[0]
    print(
        f"load average (1 min): {load_start:.1f} at the start, {load_end:.1f} at the end, on {cores} cores "
        "(other work on the machine skews tokens/s; peak RSS is not affected)"
    )
    print(
        "note: CPU/gloo, one thread per rank: communication is memory copies on one host, not a network. "
        "Use the ranking and the memory ratios, not the absolute speeds, to reason about GPUs."
    )
    print(
        json.dumps(
            {
                "bench": "strategies",
                "smoke": args.smoke,
                "model_size": args.model_size,
                "num_params": num_params,
                "steps": args.steps,
                "warmup": args.warmup,
                "cores": cores,
                "malloc_tuning": not args.no_malloc_tuning,
                "load_avg_1min": [load_start, load_end],
                "results": results,
            }
        )
    )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
