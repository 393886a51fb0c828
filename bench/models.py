"""The built-in Llama under ftrain against the same model in a plain PyTorch loop, and ``ftrain
plan``'s peak-memory estimate for it against the measured peak.

    python bench/models.py [--size small] [--vocab-size 8192] [--seq-len 128] [--micro-batch 2]
                           [--steps 12] [--warmup 4] [--repeats 3] [--strategies ddp,fsdp,tp] [--smoke]

Per strategy, on CPU/gloo with 2 ranks (one thread each, bench/strategies.py's environment:
malloc tuned so that peak RSS is live memory), in pairs, one right after the other, the order
alternating from pair to pair:

- ``ftrain``: ``torchrun --standalone --nproc-per-node 2 -m ftrain train`` of ``model.arch =
  "llama"``, ``model.size`` (fp32, synthetic data, no checkpoints);
- ``plain``: ``torchrun --standalone --nproc-per-node=2 bench/lib/models_plain.py``: the same class
  (``ftrain.models.llama.Llama``), batch, token shapes, DDP / FSDP2 ``fully_shard`` per block /
  ``parallelize_module`` with the same splits, AdamW, clipping, and nothing else.

Tokens/s is the global batch's tokens over the median interval between step ends past
``--warmup`` (bench/lib/models_runs.py); a pair's ratio is ftrain / plain, the strategy's the
median of its pairs' (target >= 0.97). Memory: ``ftrain plan``'s per-rank estimate for the job
(CPU fp32) against the largest rank's peak RSS in ftrain's metrics (target within 10%), also with
the per-process baseline measured on this install (bench/pipeline.py's ``install_baseline``) in
place of ``CPU_BASELINE_BYTES``. ``--smoke``: the debug size, a few steps, one pair of ddp and fsdp.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "lib"))

from models_runs import ftrain_run, llama_toml, median_interval_s, plain_run
from strategies import aligned, worker_env

TARGET_RATIO, TARGET_PLAN_ERROR = 0.97, 0.10
STRATEGIES = ("ddp", "fsdp", "tp")
SMOKE = dict(size="debug", vocab_size=256, seq_len=32, micro_batch=2, steps=6, warmup=2, repeats=1)


def plan_bytes(config_path: Path, strategy: str, nproc: int) -> tuple[int, int]:
    """``ftrain plan``'s per-rank estimate (CPU fp32) and the model's parameter count."""
    from ftrain.config import load_config
    from ftrain.planning.memory import Target, layout_for, model_stats
    from ftrain.planning.plan import estimate

    cfg = load_config(config_path, [f"--parallel.strategy={strategy}"])
    stats = model_stats(cfg.model, cfg.optim)
    layout = layout_for(cfg, strategy, world_size=nproc, gpus_per_node=nproc)
    return estimate(stats, cfg, layout, Target("cpu", "fp32")).total_bytes, stats.num_params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="model.size of the built-in Llama (default small: 8 x 512)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch; one micro-batch per dp rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="leading steps left out (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="pairs per strategy (default 3)")
    p.add_argument("--strategies", default="ddp,fsdp,tp", help="comma-separated among ddp,fsdp,tp")
    p.add_argument("--timeout-s", type=float, default=600, help="per run")
    p.add_argument("--retries", type=int, default=1, help="re-run a failed run this many times (default 1)")
    p.add_argument("--smoke", action="store_true", help="the test suite's run: debug size, 6 steps, ddp and fsdp")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.strategies, args.timeout_s = "ddp,fsdp", min(args.timeout_s, 90)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or any(s not in STRATEGIES for s in strategies):
        p.error(f"strategies must be among {', '.join(STRATEGIES)}")
    if args.steps < args.warmup + 3:
        p.error("--steps must exceed --warmup by at least 3 (two intervals)")

    from pipeline import install_baseline

    from ftrain.planning.memory import CPU_BASELINE_BYTES

    nproc, started, load_start = 2, time.monotonic(), os.getloadavg()[0]
    model = {"arch": "llama", "size": args.size, "vocab_size": args.vocab_size, "seq_len": args.seq_len}
    env = worker_env(malloc_tuning=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ftrain-bench-models-") as tmp:
        workdir = Path(tmp)
        baseline = None if args.smoke else install_baseline(workdir, env=env, timeout_s=args.timeout_s)
        for strategy in strategies:
            dp = 1 if strategy == "tp" else nproc
            train = {"global_batch_size": args.micro_batch * nproc, "micro_batch_size": args.micro_batch}
            config_path = workdir / f"{strategy}.toml"
            config_path.write_text(llama_toml(model, train, steps=args.steps))
            tokens = train["global_batch_size"] * args.seq_len
            plan, num_params = plan_bytes(config_path, strategy, nproc)
            row: dict[str, Any] = {"strategy": strategy, "ranks": nproc, "dp": dp, "pairs": [], "plan_bytes": plan}
            for rep in range(args.repeats):
                order = ("plain", "ftrain") if rep % 2 == 0 else ("ftrain", "plain")
                pair: dict[str, Any] = {"order": list(order)}
                for side in order:
                    failures: list[str] = []
                    while True:  # a failed run goes again up to --retries times, each failure reported
                        if side == "ftrain":
                            run = ftrain_run(config_path, strategy, nproc, workdir, env=env, timeout_s=args.timeout_s)
                        else:
                            run = plain_run(
                                model,
                                strategy,
                                nproc,
                                workdir,
                                global_batch=train["global_batch_size"],
                                micro_batch=args.micro_batch,
                                steps=args.steps,
                                env=env,
                                timeout_s=args.timeout_s,
                            )
                        if run["ok"] or len(failures) >= args.retries:
                            break
                        failures.append(run["error"])
                        print(
                            f"  {strategy} [{rep}] {side}: failed, running it again: {run['error'][:300]}", flush=True
                        )
                    gap = median_interval_s(run["end_times"], args.warmup) if run["ok"] else None
                    pair[side] = {
                        "ok": run["ok"] and gap is not None,
                        "wall_s": run["wall_s"],
                        "failed_attempts": failures,
                        **({"error": run["error"]} if not run["ok"] else {}),
                    }
                    if gap is not None:
                        own = statistics.median(run["step_time_s"][args.warmup :])
                        pair[side] |= {
                            "tokens_per_s": tokens / gap,
                            "interval_s": gap,
                            "step_time_s": own,
                            "peak_rss_per_rank": run["peak_rss_per_rank"],
                            "final_loss": run["losses"][-1],
                        }
                    shown = f"{tokens / gap:,.0f} tokens/s" if gap else f"FAILED: {run.get('error', '')[:300]}"
                    print(f"  {strategy} [{rep}] {side:6s} {shown} ({run['wall_s']}s)", flush=True)
                if pair["ftrain"]["ok"] and pair["plain"]["ok"]:
                    pair["ratio"] = pair["ftrain"]["tokens_per_s"] / pair["plain"]["tokens_per_s"]
                row["pairs"].append(pair)
            summarise(row, baseline, CPU_BASELINE_BYTES)
            results.append(row)

    print()
    print(table(results))
    ratios = [r["ratio"] for r in results if r.get("ratio") is not None]
    errors = [abs(r["plan_error"]) for r in results if r.get("plan_error") is not None]
    ok = all(r["ok"] for r in results)
    summary = {
        "bench": "models",
        "smoke": args.smoke,
        "model": model,
        "num_params": num_params,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "ok": ok,
        "ratio_by_strategy": {r["strategy"]: r.get("ratio") for r in results},
        "ratio_target": f">= {TARGET_RATIO}",
        "ratio_target_met": ok and bool(ratios) and min(ratios) >= TARGET_RATIO,
        "plan_error_by_strategy": {r["strategy"]: r.get("plan_error") for r in results},
        "plan_target": f"within {TARGET_PLAN_ERROR:.0%}",
        "plan_target_met": ok and bool(errors) and max(errors) <= TARGET_PLAN_ERROR,
        "install_baseline_bytes": baseline,
        "cores": os.cpu_count(),
        "load_avg_1min": [load_start, os.getloadavg()[0]],
        "wall_s": round(time.monotonic() - started, 1),
        "results": results,
    }
    print(
        f"ftrain / plain tokens/s: {', '.join(f'{s} {r:.3f}' for s, r in summary['ratio_by_strategy'].items() if r)} "
        f"(target >= {TARGET_RATIO}: {'met' if summary['ratio_target_met'] else 'NOT met'}); plan vs measured peak: "
        f"{', '.join(f'{s} {e:+.1%}' for s, e in summary['plan_error_by_strategy'].items() if e is not None)} "
        f"(target within {TARGET_PLAN_ERROR:.0%}: {'met' if summary['plan_target_met'] else 'NOT met'})"
    )
    print(json.dumps(summary))
    return 0 if ok else 1


def summarise(row: dict[str, Any], baseline: int | None, constant: int) -> None:
    """The strategy's ratio (median of its pairs'), tokens/s per side, and the plan's error."""
    pairs = row["pairs"]
    good = [p for p in pairs if "ratio" in p]
    row["ok"] = len(good) == len(pairs) > 0
    if not good:
        row["ratio"] = None
        return
    row["ratio"] = statistics.median(p["ratio"] for p in good)
    for side in ("ftrain", "plain"):
        row[f"{side}_tokens_per_s"] = statistics.median(p[side]["tokens_per_s"] for p in good)
        row[f"{side}_peak_rss_bytes"] = max(max(p[side]["peak_rss_per_rank"]) for p in good)
    measured = row["ftrain_peak_rss_bytes"]
    row["plan_error"] = (row["plan_bytes"] - measured) / measured
    if baseline is not None:
        row["plan_error_here"] = (row["plan_bytes"] - constant + baseline - measured) / measured


def table(results: list[dict[str, Any]]) -> str:
    rows = [["strategy", "ftrain tok/s", "plain tok/s", "ftrain/plain", "plan MB", "ftrain peak MB", "plan err"]]
    for r in results:
        if r.get("ratio") is None:
            rows.append([r["strategy"], "FAILED", "", "", f"{r['plan_bytes'] / 1e6:,.0f}", "", ""])
            continue
        rows.append(
            [
                r["strategy"],
                f"{r['ftrain_tokens_per_s']:,.0f}",
                f"{r['plain_tokens_per_s']:,.0f}",
                f"{r['ratio']:.3f}",
                f"{r['plan_bytes'] / 1e6:,.0f}",
                f"{r['ftrain_peak_rss_bytes'] / 1e6:,.0f}",
                f"{r['plan_error']:+.1%}" + (f" ({r['plan_error_here']:+.1%} here)" if "plan_error_here" in r else ""),
            ]
        )
    return aligned(rows)


if __name__ == "__main__":
    sys.exit(main())
