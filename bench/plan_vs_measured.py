"""Check ``ftrain plan``'s per-rank estimate against the peak RSS of real training runs.

    python bench/plan_vs_measured.py [--steps 3] [--strategies ddp,fsdp] [--micro-batch 4]
                                     [--accum-steps 1] [--gradient-reduce auto]
                                     [--model-size medium] [--no-malloc-tuning] [--smoke]

Trains a ~34M-parameter GPT (``--model-size medium``: vocab 8192, seq 256, d_model 512, 8
layers; fp32 on CPU) with ``torchrun --standalone --nproc-per-node 2 -m ftrain train`` for a few
steps per strategy, reads ``peak_mem_bytes`` (each rank's peak RSS) from the metrics file, and
prints the estimate's parts beside the measured peak and the relative error. The start-up phase
is compared on its own: what building the model and making it parallel added to each rank's
resident memory (the ``model_built`` event: its peak then less what it held before the build)
against the plan's ``init`` term (the rank's part plus the largest parameter where the model is
built on the meta device; the whole model, with DDP's buckets, for ddp and zero1). Same environment as
bench/strategies.py. ``--smoke`` (the test suite's run) does the same with bench/strategies.py's
tiny model (0.14M parameters: the estimate is mostly the per-process baseline) for 2 steps,
2 micro-batches per rank and step, fsdp in both gradient reduction modes.

``--gradient-reduce every_micro_batch,last_micro_batch`` runs each FSDP strategy once per mode of
``parallel.gradient_reduce`` (ddp, zero1, tp once); with ``--accum-steps`` > 1 the two differ by the
unsharded fp32 gradients ``last_micro_batch`` accumulates (4 bytes per parameter less the shard).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from strategies import MODELS, RANKS, STRATEGIES, config_toml, run_with_retry, summarise, worker_env

from ftrain.contract.events import read_jsonl
from ftrain.parallel.strategies._gradient_reduce import EVERY_MICRO_BATCH, GRADIENT_REDUCE_MODES, LAST_MICRO_BATCH

SMOKE_MODEL, SMOKE_STEPS, SMOKE_TIMEOUT_S = "tiny", 2, 120.0
SMOKE_ACCUM, SMOKE_GRADIENT_REDUCE = 2, "every_micro_batch,last_micro_batch"


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
    p.add_argument(
        "--accum-steps", type=int, default=1, help="micro-batches per rank and step (default 1: no accumulation)"
    )
    p.add_argument(
        "--gradient-reduce",
        default="auto",
        help="comma-separated parallel.gradient_reduce modes; each FSDP strategy runs once per mode (default auto)",
    )
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
        args.accum_steps, args.gradient_reduce = SMOKE_ACCUM, SMOKE_GRADIENT_REDUCE
        args.timeout_s = min(args.timeout_s, SMOKE_TIMEOUT_S)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or any(s not in STRATEGIES for s in strategies):
        p.error(f"strategies must be among {', '.join(STRATEGIES)}")
    modes = [m.strip() for m in args.gradient_reduce.split(",") if m.strip()]
    if not modes or any(m not in GRADIENT_REDUCE_MODES for m in modes):
        p.error(f"--gradient-reduce modes must be among {', '.join(GRADIENT_REDUCE_MODES)}")
    if args.accum_steps < 1:
        p.error("--accum-steps must be >= 1")

    from ftrain.config import load_config
    from ftrain.parallel.strategies import Wrapper
    from ftrain.parallel.strategies import get as get_strategy
    from ftrain.planning.memory import Target, layout_for, model_stats
    from ftrain.planning.plan import estimate

    model = MODELS[args.model_size]["model"]
    # RANKS gives every strategy run here 2 data-parallel ranks but hsdp (4) and fsdp+tp (dp 2 of 4)
    train = {"global_batch_size": 2 * args.micro_batch * args.accum_steps, "micro_batch_size": args.micro_batch}
    env = worker_env(malloc_tuning=not args.no_malloc_tuning)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ftrain-plan-check-") as tmp:
        workdir = Path(tmp)
        text = config_toml(model, train, steps=args.steps)
        configs = {}
        for mode in modes:
            config_path = workdir / mode / "config.toml"
            config_path.parent.mkdir()
            parallel = f"gradient_reduce = {json.dumps(mode)}\n"
            if args.activation_checkpointing:
                parallel += "activation_checkpointing = true\n"
            config_path.write_text(text + "\n[parallel]\n" + parallel)
            configs[mode] = config_path
        stats = model_stats(load_config(configs[modes[0]]).model, load_config(configs[modes[0]]).optim)
        print(
            f"model: {stats.num_params / 1e6:.2f}M params {model}, micro batch {args.micro_batch} x "
            f"{args.accum_steps} per rank and step, cpu fp32, {args.steps} steps, activation checkpointing "
            f"{'on' if args.activation_checkpointing else 'off'}, malloc tuning "
            f"{'off' if args.no_malloc_tuning else 'on'}",
            flush=True,
        )
        runs = [
            (s, mode) for s in strategies for mode in (modes if get_strategy(s).wrapper is Wrapper.FSDP else modes[:1])
        ]
        for s, mode in runs:
            nproc = RANKS.get(s, 2)
            config_path = configs[mode]
            # a global batch every run divides: micro batch x accumulation x its data-parallel size
            dp = layout_for(load_config(config_path), s, world_size=nproc, gpus_per_node=nproc).dp_size
            events = config_path.parent / f"events-{s.replace('+', '_')}.jsonl"
            events.unlink(missing_ok=True)
            overrides = (
                f"--train.global_batch_size={args.micro_batch * args.accum_steps * dp}",
                f"--logging.events_path={events}",
            )
            cfg = load_config(config_path, list(overrides[:1]))
            job, failures = run_with_retry(
                config_path,
                nproc,
                s,
                config_path.parent,
                env=env,
                timeout_s=args.timeout_s,
                retries=args.retries,
                overrides=overrides,
            )
            r = summarise(job, warmup=0)
            layout = layout_for(cfg, s, world_size=nproc, gpus_per_node=nproc)
            e = estimate(stats, cfg, layout, Target("cpu", "fp32"))
            name = f"{s} ({e.gradient_reduce})" if e.gradient_reduce else s
            row = {
                "strategy": s,
                "gradient_reduce": e.gradient_reduce,
                "accum_steps": args.accum_steps,
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
            built = [ev for ev in read_jsonl(events) if ev["event"] == "model_built"] if events.exists() else []
            if built:
                # start-up: what building the model and making it parallel added to each rank's resident
                # memory (model_built: its peak then, less what it held before the build), against the
                # plan's init term (the per-process baseline is the running comparison's)
                row["startup_estimate_bytes"] = e.init_bytes
                row["startup_measured_bytes"] = max(ev["host_peak_bytes"] - ev["host_before_bytes"] for ev in built)
                row["startup_relative_error"] = (row["startup_estimate_bytes"] - row["startup_measured_bytes"]) / row[
                    "startup_measured_bytes"
                ]
            if r["ok"]:
                row["measured_bytes"] = r["peak_rss_bytes"]
                row["measured_per_rank"] = r["peak_rss_per_rank"]
                row["relative_error"] = (e.total_bytes - r["peak_rss_bytes"]) / r["peak_rss_bytes"]
                startup = (
                    f"; start-up added {_mb(row['startup_measured_bytes'])} MB, init "
                    f"{_mb(row['startup_estimate_bytes'])} MB ({row['startup_relative_error']:+.1%})"
                    if "startup_measured_bytes" in row
                    else ""
                )
                print(
                    f"  {name} x{nproc}: measured {_mb(r['peak_rss_bytes'])} MB, estimate {_mb(e.total_bytes)} MB "
                    f"({row['relative_error']:+.1%}){startup}",
                    flush=True,
                )
            else:
                row["error"] = r["error"]
                print(f"  {name} x{nproc}: FAILED: {r['error']}", flush=True)
            rows.append(row)

    print()
    header = (
        "strategy",
        "grad reduce",
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
    print("  ".join(f"{h:>9}" if i != 1 else f"{h:>17}" for i, h in enumerate(header)))
    for row in rows:
        measured = _mb(row["measured_bytes"]) if row["ok"] else "FAILED"
        error = f"{row['relative_error']:+.1%}" if row["ok"] else "-"
        cells = (
            row["strategy"],
            row["gradient_reduce"] or "-",
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
        print("  ".join(f"{c:>9}" if i != 1 else f"{c:>17}" for i, c in enumerate(cells)))
    by_mode = {(r["strategy"], r["gradient_reduce"]): r for r in rows if r["ok"]}
    for s in strategies:
        every, last = by_mode.get((s, EVERY_MICRO_BATCH)), by_mode.get((s, LAST_MICRO_BATCH))
        if every is not None and last is not None:
            print(
                f"{s}, {args.accum_steps} micro-batches per step: {LAST_MICRO_BATCH} - {EVERY_MICRO_BATCH}: "
                f"measured {_mb(last['measured_bytes'] - every['measured_bytes'])} MB, "
                f"plan {_mb(last['estimate_bytes'] - every['estimate_bytes'])} MB per rank"
            )
    print(
        json.dumps(
            {
                "bench": "plan_vs_measured",
                "smoke": args.smoke,
                "model_size": args.model_size,
                "steps": args.steps,
                "num_params": stats.num_params,
                "micro_batch": args.micro_batch,
                "accum_steps": args.accum_steps,
                "gradient_reduce": modes,
                "activation_checkpointing": args.activation_checkpointing,
                "malloc_tuning": not args.no_malloc_tuning,
                "results": rows,
            }
        )
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
