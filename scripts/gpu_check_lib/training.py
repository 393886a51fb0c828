"""Training checks: ``ftrain train`` of the reference GPT and the built-in Llama, every strategy
``ftrain plan`` accepts at one rank (NCCL on the device), two ranks on the one device over gloo
(``ftrain.distributed.select_device`` lets them share the device), and ``ftrain plan``'s estimate against the peak
memory those jobs measure (``torch.cuda.max_memory_allocated``; peak RSS on the CPU).

Every command line is validated before it runs (its config loaded with its overrides, the
strategy's layout at that world size computed): a renamed key fails even the checks the dry run
does not run.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpu_check_lib.core import Check, CheckFailed, Deadline, Mode, Skip

TWO_RANK_STRATEGIES = ("ddp", "fsdp")
#: the one job of each kind the dry run runs (the others are validated only)
DRY_RUNS = {("gpt", 1): "ddp", ("llama", 1): "fsdp", ("gpt", 2): "ddp"}

#: [model] keys: small enough for seconds per job; "plan" sizes make the states outweigh the
#: allocator's fixed costs, so the estimate's error means something
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpu": {
        "gpt": {"vocab_size": 512, "seq_len": 256, "n_layer": 4, "n_head": 8, "d_model": 256},
        "llama": {"arch": "llama", "size": "tiny", "vocab_size": 512, "seq_len": 256},
    },
    "dry": {
        "gpt": {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 32},
        "llama": {"arch": "llama", "size": "debug", "vocab_size": 64, "seq_len": 16},
    },
    "plan-gpu": {
        "gpt": {"vocab_size": 8192, "seq_len": 1024, "n_layer": 8, "n_head": 16, "d_model": 1024},
        "llama": {"arch": "llama", "size": "small", "vocab_size": 32000, "seq_len": 1024},
    },
}
STEPS = {"gpu": 20, "dry": 3}
PLAN_ROWS = {"gpu": (("gpt", "ddp"), ("llama", "fsdp")), "dry": (("gpt", "ddp"),)}


def config_text(model: dict[str, Any], *, steps: int, global_batch: int, micro_batch: int) -> str:
    """A job's TOML: synthetic data, no dropout, no progress bar; device and dtype come as overrides."""
    value = lambda v: json.dumps(v) if isinstance(v, str) else str(v)  # noqa: E731 - TOML scalars
    lines = ["[train]", f"steps = {steps}", f"global_batch_size = {global_batch}", f"micro_batch_size = {micro_batch}"]
    lines += ["seed = 0", "", "[model]", *(f"{k} = {value(v)}" for k, v in model.items())]
    lines += ["", "[optim]", "warmup_steps = 2", "", "[logging]", 'progress = "off"']
    return "\n".join(lines) + "\n"


def _kind(mode: Mode) -> str:
    return "dry" if mode.dry else "gpu"


def torchrun_command(nproc: int, config: Path, overrides: list[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node=N -m ftrain train`` (two ranks on a one-GPU host
    share its device: :func:`ftrain.distributed.select_device`)."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*head, "-m", "ftrain", "train", str(config), *overrides]


def validate(config: Path, overrides: list[str], strategy: str, nproc: int) -> None:
    """What ``ftrain train`` checks before any work, and the strategy's layout at ``nproc`` ranks."""
    from ftrain.config import ConfigError, load_config
    from ftrain.planning.memory import layout_for

    try:
        cfg = load_config(config, overrides)
        layout_for(cfg, strategy, world_size=nproc, gpus_per_node=nproc)
    except ConfigError as e:
        raise CheckFailed(f"config error: {e}") from e


def run_job(
    mode: Mode, workdir: Path, nproc: int, overrides: list[str], deadline: Deadline, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Run one job; its metrics and the command line. CheckFailed with the worker's fatal line
    first (``bench.strategies.output_failure``) if it fails."""
    from bench.strategies import output_failure
    from ftrain.contract.events import read_jsonl
    from ftrain.testbed.jobs import run_within

    metrics_path = workdir / "metrics.jsonl"
    cmd = torchrun_command(nproc, workdir / "config.toml", [*overrides, f"--logging.metrics_path={metrics_path}"])
    proc = run_within(cmd, timeout_s=deadline.remaining(), env=env or mode.env(), cwd=workdir)
    out = proc.stdout or ""
    metrics = read_jsonl(metrics_path) if metrics_path.exists() else []
    if proc.returncode != 0:
        raise CheckFailed(output_failure(out, proc.returncode), out, {"command": shlex.join(cmd)})
    return metrics, shlex.join(cmd)


def train_figures(metrics: list[dict[str, Any]], steps: int, output: str = "") -> dict[str, Any]:
    if len(metrics) != steps:
        raise CheckFailed(f"{len(metrics)} of {steps} steps in the metrics file", output)
    losses = [m["loss"] for m in metrics]
    if not all(math.isfinite(x) for x in losses):
        raise CheckFailed(f"non-finite loss: {losses}", output)
    later = metrics[1:] or metrics  # the first step pays for warm-up
    return {
        "steps": len(metrics),
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
        "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in later)),
        "step_time_s": round(statistics.median(m["step_time_s"] for m in later), 4),
        "peak_mem_bytes": max(metrics[-1]["peak_mem_bytes"]),
    }


def train_check(mode: Mode, model: str, strategy: str, nproc: int, root: Path, timeout_s: float) -> Check:
    """``train/<model>/<strategy>/x1`` (the device's own backend) or ``.../x2-gloo`` (two ranks, one device)."""
    name = f"train/{model}/{strategy}/x{nproc}" + ("-gloo" if nproc > 1 else "")
    runs = not mode.dry or DRY_RUNS.get((model, nproc)) == strategy
    steps = STEPS[_kind(mode)]

    def run(deadline: Deadline) -> dict[str, Any]:
        workdir = Path(tempfile.mkdtemp(prefix=name.replace("/", "-") + "-", dir=root))
        (workdir / "config.toml").write_text(
            config_text(SIZES[_kind(mode)][model], steps=steps, global_batch=8 * nproc, micro_batch=4)
        )
        overrides = [*mode.train_overrides(), f"--parallel.strategy={strategy}"]
        if nproc > 1:
            overrides.append("--parallel.backend=gloo")
        validate(workdir / "config.toml", overrides, strategy, nproc)
        backend = "gloo" if nproc > 1 else mode.collective_backend
        where = {"world_size": nproc, "device": mode.device, "dtype": mode.dtype, "backend": backend}
        if not runs:
            job = shlex.join(torchrun_command(nproc, workdir / "config.toml", overrides))
            raise Skip("dry mode runs one job of each kind; this one was validated, not run", {**where, "command": job})
        metrics, _ = run_job(mode, workdir, nproc, overrides, deadline)
        figures = {**where, **train_figures(metrics, steps)}
        figures["peak_mem_is"] = "cpu peak RSS" if mode.dry else "torch.cuda.max_memory_allocated"
        return figures

    return Check(name, run, timeout_s)


def one_rank_strategies(mode: Mode, model: str) -> tuple[list[str], dict[str, str]]:
    """The strategies ``ftrain plan`` finds feasible at one rank for ``model``, and why the rest are not."""
    from ftrain.config import load_config
    from ftrain.planning.memory import model_stats, resolve_target
    from ftrain.planning.plan import estimate_all

    with tempfile.TemporaryDirectory(prefix="ftrain-gpu-check-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(config_text(SIZES[_kind(mode)][model], steps=1, global_batch=8, micro_batch=4))
        cfg = load_config(path, mode.train_overrides())
    target = resolve_target(cfg)
    estimates, skipped = estimate_all(
        model_stats(cfg.model, cfg.optim), cfg, world_size=1, gpus_per_node=1, target=target
    )
    return [e.strategy for e in estimates], {s.strategy: s.reason for s in skipped}


def plan_check(mode: Mode, root: Path, timeout_s: float) -> Check:
    """``ftrain plan``'s per-rank estimate against the peak memory of a real one-rank job.

    On the device the metric is ``torch.cuda.max_memory_allocated``, which leaves out what the plan
    calls overhead (CUDA context, workspaces, NCCL buffers: assumed, not measured): the estimate
    compared is total less overhead, and both are reported. On the CPU (dry) it is the total
    against peak RSS, as ``bench/plan_vs_measured.py`` compares them. The error is reported, not
    judged: the check fails only if a job or the estimate fails."""

    def run(deadline: Deadline) -> dict[str, Any]:
        from bench.strategies import MALLOC_ENV
        from ftrain.config import load_config
        from ftrain.planning.memory import layout_for, model_stats, resolve_target
        from ftrain.planning.plan import estimate
        from ftrain.planning.plan_report import plan_report

        rows = []
        kind = _kind(mode)
        for model, strategy in PLAN_ROWS[kind]:
            workdir = Path(tempfile.mkdtemp(prefix=f"plan-{model}-{strategy}-", dir=root))
            sizes = SIZES["plan-gpu" if mode.cuda else "dry"][model]
            micro = 4 if mode.cuda else 2
            (workdir / "config.toml").write_text(config_text(sizes, steps=3, global_batch=micro, micro_batch=micro))
            overrides = [*mode.train_overrides(), f"--parallel.strategy={strategy}"]
            validate(workdir / "config.toml", overrides, strategy, 1)
            cfg = load_config(workdir / "config.toml", overrides)
            stats = model_stats(cfg.model, cfg.optim)
            target = resolve_target(cfg)
            e = estimate(stats, cfg, layout_for(cfg, strategy, world_size=1, gpus_per_node=1), target)
            report = plan_report(cfg, world_size=1)
            recommended = next((ln for ln in report.splitlines() if ln.startswith("recommended:")), "")
            env = mode.env(**MALLOC_ENV) if mode.dry else None
            metrics, _ = run_job(mode, workdir, 1, overrides, deadline, env=env)
            train_figures(metrics, 3)
            measured = max(metrics[-1]["peak_mem_bytes"])
            compared = e.total_bytes - (e.overhead_bytes if target.device == "cuda" else 0)
            rows.append(
                {
                    "model": model,
                    "strategy": strategy,
                    "num_params": stats.num_params,
                    "target": f"{target.device} {target.dtype}",
                    "phase": e.phase,
                    "estimate_total_bytes": e.total_bytes,
                    "estimate_overhead_bytes": e.overhead_bytes,
                    "estimate_compared_bytes": compared,
                    "measured_bytes": measured,
                    "measured_is": "cpu peak RSS" if mode.dry else "torch.cuda.max_memory_allocated",
                    "relative_error": round((compared - measured) / measured, 4),
                    "plan_says": recommended,
                }
            )
        return {"rows": rows}

    return Check("plan_vs_measured", run, timeout_s)
