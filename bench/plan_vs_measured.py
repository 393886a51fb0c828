"""Check ``ftrain plan``'s per-rank estimate against the peak RSS of real training runs.

    python bench/plan_vs_measured.py [--steps 3] [--strategies ddp,fsdp] [--micro-batch 4]
                                     [--model-size medium] [--no-malloc-tuning] [--smoke]

Trains a ~34M-parameter GPT (``--model-size medium``: vocab 8192, seq 256, d_model 512, 8
layers; fp32 on CPU) with ``torchrun --standalone --nproc-per-node 2 -m ftrain train`` for a few
steps per strategy, reads ``peak_mem_bytes`` (each rank's peak RSS) from the metrics file, and
prints the estimate's parts beside the measured peak and the relative error. Same environment as
bench/strategies.py. ``--smoke`` (the test suite's run) does the same with bench/strategies.py's
tiny model (0.14M parameters: the estimate is mostly the per-process baseline) for 2 steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from strategies import MODELS, RANKS, STRATEGIES, config_toml, run_with_retry, summarise, worker_env

SMOKE_MODEL, SMOKE_STEPS, SMOKE_TIMEOUT_S = "tiny", 2, 120.0


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="optimizer steps per run (default 3; AdamW state exists from step 1, so the peak is reached early)",
    )
    p.add_argument("--strategies", default="ddp,fsdp", help="comma-separated (default ddp,fsdp)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--retries", type=int, default=1, help="re-run a failed job this many times (default 1)")
    p.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults")
    p.add_argument(
        "--model-size",
        choices=sorted(MODELS),
        default="medium",
        help="bench/strategies.py's model sizes (default medium: 33.7M params)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"the test suite's run: the {SMOKE_MODEL} model, {SMOKE_STEPS} steps",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.model_size, args.steps = SMOKE_MODEL, SMOKE_STEPS
        args.timeout_s = min(args.timeout_s, SMOKE_TIMEOUT_S)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or any(s not in STRATEGIES for s in strategies):
        p.error(f"strategies must be among {', '.join(STRATEGIES)}")

    from ftrain.config import load_config
    from ftrain.planning.memory import Target, layout_for, model_stats
    from ftrain.planning.plan import estimate

    model = MODELS[args.model_size]["model"]
    train = {"global_batch_size": 2 * args.micro_batch, "micro_batch_size": args.micro_batch}
    env = worker_env(malloc_tuning=not args.no_malloc_tuning)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ftrain-plan-check-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "config.toml"
        text = config_toml(model, train, steps=args.steps)
        if args.activation_checkpointing:
            text += "\n[parallel]\nactivation_checkpointing = true\n"
        config_path.write_text(text)
        cfg = load_config(config_path)
        stats = model_stats(cfg.model, cfg.optim)
        print(
            f"model: {stats.num_params / 1e6:.2f}M params {model}, micro batch {args.micro_batch}, cpu fp32, "
            f"{args.steps} steps, activation checkpointing {'on' if args.activation_checkpointing else 'off'}, "
            f"malloc tuning {'off' if args.no_malloc_tuning else 'on'}",
            flush=True,
        )
        for s in strategies:
            nproc = RANKS.get(s, 2)
            job, failures = run_with_retry(
                config_path, nproc, s, workdir, env=env, timeout_s=args.timeout_s, retries=args.retries
            )
            r = summarise(job, warmup=0)
            layout = layout_for(cfg, s, world_size=nproc, gpus_per_node=nproc)
            e = estimate(stats, cfg, layout, Target("cpu", "fp32"))
            row = {
                "strategy": s,
                "ranks": nproc,
                "estimate_bytes": e.total_bytes,
                "phase": e.phase,
                "model_state_bytes": e.model_state_bytes,
                "activation_bytes": e.activation_bytes,
                "transient_bytes": e.transient_bytes,
                "step_transient_bytes": e.step_transient_bytes,
                "init_bytes": e.init_bytes,
                "overhead_bytes": e.overhead_bytes,
                "ok": r["ok"],
                "failed_attempts": failures,
            }
            if r["ok"]:
                row["measured_bytes"] = r["peak_rss_bytes"]
                row["measured_per_rank"] = r["peak_rss_per_rank"]
                row["relative_error"] = (e.total_bytes - r["peak_rss_bytes"]) / r["peak_rss_bytes"]
                print(
                    f"  {s} x{nproc}: measured {_mb(r['peak_rss_bytes'])} MB, estimate {_mb(e.total_bytes)} MB "
                    f"({row['relative_error']:+.1%})",
                    flush=True,
                )
            else:
                row["error"] = r["error"]
                print(f"  {s} x{nproc}: FAILED: {r['error']}", flush=True)
            rows.append(row)

    print()
    header = (
        "strategy",
        "ranks",
        "states",
        "activ.",
        "transient",
        "step tmp",
        "init",
        "overhead",
        "estimate",
        "measured",
        "error",
    )
    print(
        "MB per rank (10^6 bytes). estimate = overhead + the largest of: backward = params + optimizer state "
        "(+ grads for ddp/zero1) + activ. + transient; step = states + step tmp; init"
    )
    print("  ".join(f"{h:>9}" for h in header))
    for row in rows:
        measured = _mb(row["measured_bytes"]) if row["ok"] else "FAILED"
        error = f"{row['relative_error']:+.1%}" if row["ok"] else "-"
        cells = (
            row["strategy"],
            str(row["ranks"]),
            _mb(row["model_state_bytes"]),
            _mb(row["activation_bytes"]),
            _mb(row["transient_bytes"]),
            _mb(row["step_transient_bytes"]),
            _mb(row["init_bytes"]),
            _mb(row["overhead_bytes"]),
            _mb(row["estimate_bytes"]) + f" ({row['phase']})",
            measured,
            error,
        )
        print("  ".join(f"{c:>9}" for c in cells))
    print(
        json.dumps(
            {
                "bench": "plan_vs_measured",
                "smoke": args.smoke,
                "model_size": args.model_size,
                "steps": args.steps,
                "num_params": stats.num_params,
                "micro_batch": args.micro_batch,
                "activation_checkpointing": args.activation_checkpointing,
                "malloc_tuning": not args.no_malloc_tuning,
                "results": rows,
            }
        )
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
