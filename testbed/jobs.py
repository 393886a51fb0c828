"""Real torchrun jobs of ``ftrain train`` on one machine, and what they wrote (tests and benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftrain.contract.events import read_jsonl
from ftrain.testbed.procs import REPO, kill_tree, quiet_env

#: A model small enough that a 4-rank torchrun job on 2 cores takes seconds.
TINY_CONFIG = """
[train]
steps = 10
global_batch_size = 16
micro_batch_size = 2
seed = 3

[model]
vocab_size = 64
seq_len = 16
n_layer = 2
n_head = 4
d_model = 32

[data]
seed = 5

[optim]
lr = 1e-2
warmup_steps = 2

[logging]
progress = "lines"
"""


def worker_env(**extra: str) -> dict[str, str]:
    """:func:`ftrain.testbed.procs.quiet_env` with warnings-only worker logs."""
    return quiet_env(**{"FTRAIN_LOG_LEVEL": "WARNING", **extra})


def run(
    cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run a command in its own session; on timeout or error kill it and everything it started."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or worker_env(),
        cwd=cwd or REPO,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def run_within(
    cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """:func:`run`, with a timeout told in the output (``timed out after N s``, exit code -9) instead of raised."""
    try:
        return run(cmd, timeout_s=timeout_s, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, -9, f"timed out after {timeout_s:.0f}s", None)


def torchrun_cmd(nproc: int, cfg_path: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "ftrain",
        "train",
        str(cfg_path),
        *args,
    ]


@dataclass
class RunResult:
    returncode: int
    output: str
    metrics: list[dict[str, Any]]
    final: dict[str, Any] | None
    workdir: Path


def train_job(
    workdir: Path,
    nproc: int,
    *overrides: str,
    config: str = TINY_CONFIG,
    timeout_s: float = 240,
    save_final: bool = True,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> RunResult:
    """``torchrun --standalone --nproc-per-node N -m ftrain train`` with metrics and final state."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "config.toml"
    cfg_path.write_text(config)
    metrics_path = workdir / "metrics.jsonl"
    final_path = workdir / "final.pt"
    args = [f"--logging.metrics_path={metrics_path}", *overrides]
    if save_final:
        args.append(f"--train.save_final_path={final_path}")
    cmd = torchrun_cmd(nproc, cfg_path, *args)
    proc = run(cmd, timeout_s=timeout_s, env=worker_env(**(env or {})))
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    metrics = read_jsonl(metrics_path) if metrics_path.exists() else []
    final = torch.load(final_path, weights_only=False) if final_path.exists() else None
    return RunResult(proc.returncode, proc.stdout, metrics, final, workdir)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"different keys: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def optimizer_tensors(optim_sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flatten ``{"state": {name: {"exp_avg": t, ...}}}`` into ``{"name.exp_avg": t}``."""
    return {
        f"{name}.{key}": value
        for name, state in optim_sd["state"].items()
        for key, value in state.items()
        if torch.is_tensor(value) and value.dim() > 0
    }
