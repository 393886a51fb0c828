"""bench/models.py's runs: one ``torchrun -m ftrain train`` job of the built-in Llama, or the same
model in bench/lib/models_plain.py's plain PyTorch loop, and the step figures both are read by.

Both sides are timed the same way: the median interval between consecutive steps' end times
(``time`` of ftrain's metrics lines, ``time.time()`` after each step of the plain loop) past the
warm-up, so whatever ftrain does between steps (its metrics line, its per-step all-gather of
losses and peaks) is in its figure.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent
PLAIN = BENCH / "lib" / "models_plain.py"


def llama_toml(model: dict[str, Any], train: dict[str, Any], *, steps: int) -> str:
    """A CPU fp32 job of the built-in Llama: synthetic data, no checkpoints, progress off."""

    def value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    lines = ["[train]", f"steps = {steps}", 'device = "cpu"', 'dtype = "fp32"', "seed = 0"]
    lines += [f"{k} = {value(v)}" for k, v in train.items()]
    lines += ["", "[model]"] + [f"{k} = {value(v)}" for k, v in model.items()]
    lines += ["", "[data]", "num_samples = 10000", "", "[logging]", 'progress = "off"']
    return "\n".join(lines) + "\n"


def median_interval_s(end_times: list[float], warmup: int) -> float | None:
    """The median time between consecutive step ends, steps 1..warmup left out."""
    ends = end_times[warmup:]
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def ftrain_run(
    config_path: Path, strategy: str, nproc: int, workdir: Path, *, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """One ``torchrun --standalone -m ftrain train`` job: its step end times, step times, losses and peaks."""
    from strategies import failure_reason, torchrun_train

    job = torchrun_train(config_path, nproc, strategy, workdir, env=env, timeout_s=timeout_s)
    if job.returncode != 0 or not job.metrics:
        return {"ok": False, "error": failure_reason(job), "wall_s": round(job.wall_s, 1)}
    return {
        "ok": True,
        "end_times": [m["time"] for m in job.metrics],
        "step_time_s": [m["step_time_s"] for m in job.metrics],
        "losses": [m["loss"] for m in job.metrics],
        "peak_rss_per_rank": job.metrics[-1]["peak_mem_bytes"],
        "wall_s": round(job.wall_s, 1),
    }


def plain_run(
    model: dict[str, Any],
    strategy: str,
    nproc: int,
    workdir: Path,
    *,
    global_batch: int,
    micro_batch: int,
    steps: int,
    env: dict[str, str],
    timeout_s: float,
) -> dict[str, Any]:
    """One run of bench/lib/models_plain.py under ``torchrun --standalone``."""
    from strategies import output_failure

    from ftrain.testbed.jobs import run_within

    out = workdir / f"plain-{strategy}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(PLAIN),
        f"--model={json.dumps(model)}",
        f"--strategy={strategy}",
        f"--global-batch={global_batch}",
        f"--micro-batch={micro_batch}",
        f"--steps={steps}",
        f"--out={out}",
    ]
    start = time.perf_counter()
    proc = run_within(cmd, timeout_s=timeout_s, env=env, cwd=workdir)
    wall = round(time.perf_counter() - start, 1)
    if proc.returncode != 0 or not out.exists():
        return {"ok": False, "error": output_failure(proc.stdout or "", proc.returncode), "wall_s": wall}
    result = json.loads(out.read_text())
    return {"ok": True, **result, "wall_s": wall}
