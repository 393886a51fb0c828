"""The step time of a user's loop with ``ftrain.Session`` against the same loop without it.

    python bench/session.py [--repeats 5] [--steps 300] [--save-every 20] [--smoke]

examples/own_loop/train.py (a Hugging Face Llama under FSDP2, 2 processes, ``torchrun
--standalone``) in pairs, one right after the other, the order alternating from pair to pair:

- ``session``: the example as it is: ``ftrain.Session`` with an asynchronous save every
  ``--save-every`` steps to a local directory (a fresh one per run), a heartbeat per step;
- ``plain``: the same loop with the session replaced by a stand-in that only joins the process
  group: no checkpoints.

Both run the example's ``main`` through bench/lib/own_loop_sides.py, which ends each process as
ftrain's workers end (no C++ teardown: gloo's threads can abort an exit on CPU).

Each run's figure is the loop's wall time over its steps as the example prints it (``done: N
steps in S s``, from after the load to after the last step, the final save excluded); each pair
gives the ratio session / plain, and the result is the median of the pairs' ratios (target:
<= 1.02). Prints one line per run and a final JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.steady_state import RunFailed, pair_summary, run_job, run_pairs  # noqa: E402 - after the path setup

TARGET_RATIO = 1.02
SIDES = REPO / "bench" / "lib" / "own_loop_sides.py"
DONE = re.compile(r"done: (\d+) steps in ([0-9.]+)s")


def run_side(side: str, name: str, workdir: Path, steps: int, save_every: int, timeout_s: float) -> float:
    """One run of ``side``: the loop's seconds per step."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SIDES), side,
        f"--steps={steps}", f"--save-every={save_every}", f"--ckpt={workdir / f'{name}.ckpt'}",
    ]  # fmt: skip
    run_job(cmd, workdir, name, timeout_s)
    found = DONE.findall((workdir / f"{name}.log").read_text(errors="replace"))
    if not found:
        raise RunFailed(f"{name}: no 'done: N steps in S s' line in {workdir / f'{name}.log'}")
    done, seconds = found[-1]
    return float(seconds) / int(done)


def measure(*, repeats: int, steps: int, save_every: int, timeout_s: float = 600.0) -> dict[str, Any]:
    started, load_start = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ftrain-bench-session-") as tmp:
        workdir = Path(tmp)

        def run(side: str, name: str) -> Path:
            step_s = run_side(side, name, workdir, steps, save_every, timeout_s)
            path = workdir / f"{name}.step.json"  # run_pairs reads a metrics file: one line, the figure
            path.write_text(json.dumps({"step_time_s": step_s}) + "\n")
            return path

        pairs = run_pairs(("session", "plain"), run, repeats=repeats, warmup=0)
    return pair_summary(
        "session",
        "session_vs_plain",
        ("session", "plain"),
        pairs,
        target=TARGET_RATIO,
        settings={"repeats": repeats, "steps": steps, "save_every": save_every, "nproc": 2},
        started=started,
        load_start=load_start,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="pairs of runs")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="one pair of 30-step runs (the test suite's)")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps = 1, 30
    summary = measure(repeats=args.repeats, steps=args.steps, save_every=args.save_every)
    summary["smoke"] = args.smoke
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
