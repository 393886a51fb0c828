"""Steady-state step time under the node agents against plain ``torchrun --standalone``.

    python bench/steady_state.py [--repeats 5] [--steps 300] [--warmup 30] [--recovery live|restart]
                                 [--config configs/demo.toml] [--smoke]

One job, no faults, no checkpoints (``configs/demo.toml`` by default: ddp on 2 ranks), run in
pairs, one right after the other, the order alternating from pair to pair so that a drift of
the machine's load hits both sides alike:

- ``torchrun``: ``torchrun --standalone --nproc-per-node 2 -m ftrain train CONFIG``;
- ``agent``: a local etcd and one ``ftrain agent --nnodes 1 --nproc-per-node 2`` (by default
  ``--recovery live``: the agent's own worker processes, a warm spare waiting, heartbeats, the
  control file and each worker's round watchdog all running — everything a job pays for being
  recoverable).

Each run's figure is the median ``step_time_s`` of rank 0's metrics lines after ``--warmup``
steps; each pair gives the ratio agent / torchrun, and the result is the median of the pairs'
ratios (target: <= 1.01). Prints one line per run and a final JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ftrain.contract.events import read_jsonl  # noqa: E402 - after the path setup
from ftrain.testbed.etcd import EtcdServer
from ftrain.testbed.jobs import torchrun_cmd, worker_env
from ftrain.testbed.procs import kill_tree

TARGET_RATIO = 1.01
#: --smoke (steady_state, flight_recorder): proves the pair runs end to end, not a measurement
SMOKE_STEPS, SMOKE_WARMUP = 20, 5
DEFAULT_CONFIG = REPO / "configs" / "demo.toml"


class RunFailed(RuntimeError):
    """A job did not finish, or wrote no step past the warm-up."""


def run_job(cmd: list[str], workdir: Path, name: str, timeout_s: float) -> None:
    """Run one job to its end (in its own session; killed with everything it started if it
    overruns); RunFailed with the end of its log if it does not exit 0."""
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                kill_tree(proc)
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RunFailed(f"{name} {'timed out' if rc is None else f'exited {rc}'}:\n{tail}")


def median_step_s(metrics_path: Path, warmup: int) -> float:
    times = [m["step_time_s"] for m in read_jsonl(metrics_path)] if metrics_path.exists() else []
    measured = times[warmup:]
    if not measured:
        raise RunFailed(f"no step after the {warmup} warm-up steps in {metrics_path}")
    return statistics.median(measured)


def train_args(config: Path, workdir: Path, name: str, steps: int, extra: Sequence[str] = ()) -> tuple[list[str], Path]:
    metrics = workdir / f"{name}.metrics.jsonl"
    return [
        str(config),
        f"--train.steps={steps}",
        "--checkpoint.uri=",
        f"--logging.metrics_path={metrics}",
        "--logging.progress=off",
        *extra,
    ], metrics


def run_torchrun(config: Path, workdir: Path, name: str, steps: int, nproc: int, timeout_s: float) -> Path:
    args, metrics = train_args(config, workdir, name, steps)
    run_job(torchrun_cmd(nproc, config, *args[1:]), workdir, name, timeout_s)
    return metrics


def run_agent(
    config: Path,
    workdir: Path,
    name: str,
    steps: int,
    nproc: int,
    recovery: str,
    timeout_s: float,
    extra: Sequence[str] = (),
) -> Path:
    """One job under one agent (its own etcd); ``extra``: overrides of the config."""
    args, metrics = train_args(config, workdir, name, steps, extra)
    with EtcdServer() as etcd:
        cmd = [
            sys.executable,
            "-m",
            "ftrain",
            "agent",
            "--etcd",
            etcd.endpoint,
            "--job",
            name,
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(nproc),
            "--node-id",
            "n0",
            "--recovery",
            recovery,
            "--run-dir",
            str(workdir / f"{name}.run"),
            "--",
            *args,
        ]
        run_job(cmd, workdir, name, timeout_s)
    return metrics


def run_pairs(
    sides: tuple[str, str], run: Callable[[str, str], Path], *, repeats: int, warmup: int
) -> list[dict[str, Any]]:
    """``repeats`` pairs of runs, one right after the other, the order alternating from pair to
    pair (``sides[1]`` first in the first pair); ``run(side, name)`` runs one and returns its
    metrics file. Each pair: every side's median step time after ``warmup``, ``ratio`` (the
    first side's over the second's) and the ``order``."""
    pairs: list[dict[str, Any]] = []
    for rep in range(repeats):
        order = sides[::-1] if rep % 2 == 0 else sides
        pair: dict[str, Any] = {"order": list(order)}
        for side in order:
            pair[side] = median_step_s(run(side, f"r{rep}-{side}"), warmup)
            print(f"  [{rep}] {side:8s} median step {1000 * pair[side]:.2f} ms", flush=True)
        pair["ratio"] = pair[sides[0]] / pair[sides[1]]
        print(f"  [{rep}] {sides[0]} / {sides[1]} = {pair['ratio']:.4f}", flush=True)
        pairs.append(pair)
    return pairs


def pair_summary(
    bench: str,
    ratio_key: str,
    sides: tuple[str, str],
    pairs: list[dict[str, Any]],
    *,
    target: float,
    settings: dict[str, Any],
    started: float,
    load_start: float,
) -> dict[str, Any]:
    """The JSON line of a paired benchmark: the median of the pairs' ratios against ``target``."""
    ratio = statistics.median(p["ratio"] for p in pairs)
    summary = {
        "bench": bench,
        ratio_key: round(ratio, 4),
        **{f"{side}_step_s": round(statistics.median(p[side] for p in pairs), 5) for side in sides},
        "ratios": [round(p["ratio"], 4) for p in pairs],
        "target": f"<= {target}",
        "target_met": ratio <= target,
        "settings": settings,
        "cores": os.cpu_count(),
        "load_avg_1min": [load_start, os.getloadavg()[0]],
        "wall_s": round(time.monotonic() - started, 1),
    }
    a, b = (summary[f"{side}_step_s"] for side in sides)
    print(
        f"{bench}: {sides[0]} {1000 * a:.2f} ms vs {sides[1]} {1000 * b:.2f} ms per step: {ratio:.4f}x "
        f"(target <= {target})",
        flush=True,
    )
    return summary


def measure(
    config: Path,
    *,
    repeats: int,
    steps: int,
    warmup: int,
    nproc: int = 2,
    recovery: str = "live",
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run ``repeats`` pairs and return the summary (RunFailed if a run fails)."""
    started, load_start = time.monotonic(), os.getloadavg()[0]
    print(
        f"steady state: {repeats} pair(s) of {steps}-step runs of {config.name}, {nproc} ranks; "
        f"agent --recovery {recovery}; first {warmup} steps left out",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ftrain-steady-") as tmp:
        workdir = Path(tmp)

        def run(side: str, name: str) -> Path:
            if side == "torchrun":
                return run_torchrun(config, workdir, name, steps, nproc, timeout_s)
            return run_agent(config, workdir, name, steps, nproc, recovery, timeout_s)

        pairs = run_pairs(("agent", "torchrun"), run, repeats=repeats, warmup=warmup)
    settings = {
        "config": str(config),
        "steps": steps,
        "warmup": warmup,
        "nproc": nproc,
        "recovery": recovery,
        "repeats": repeats,
    }
    return pair_summary(
        "steady_state",
        "steady_state_vs_torchrun",
        ("agent", "torchrun"),
        pairs,
        target=TARGET_RATIO,
        settings=settings,
        started=started,
        load_start=load_start,
    )


def pair_parser(description: str) -> argparse.ArgumentParser:
    """The options every paired benchmark takes (each adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--repeats", type=int, default=5, help="pairs of runs (default 5)")
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="first steps of each run left out (default 30)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit per run (default 600)")
    p.add_argument("--smoke", action="store_true", help=f"one pair of {SMOKE_STEPS}-step runs (the test suite's)")
    return p


def parse_pair_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.warmup = 1, SMOKE_STEPS, SMOKE_WARMUP
    if args.repeats < 1 or args.warmup >= args.steps:
        p.error("need --repeats >= 1 and --warmup < --steps")
    return args


def report(run: Callable[[], dict[str, Any]]) -> int:
    """Print the summary ``run`` returns as the last line (exit 0), or why a run failed (exit 1)."""
    try:
        summary = run()
    except RunFailed as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--recovery", choices=("live", "restart"), default="live", help="the agent's mode (default live)")
    args = parse_pair_args(p, argv)
    return report(
        lambda: measure(
            args.config,
            repeats=args.repeats,
            steps=args.steps,
            warmup=args.warmup,
            nproc=args.nproc,
            recovery=args.recovery,
            timeout_s=args.timeout_s,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
