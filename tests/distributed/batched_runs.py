"""Many uninterrupted training runs of the tiny config in few torchrun launches.

``batched_runs(tmp_path_factory, cases)``: ``cases`` maps a name to (ranks, overrides); the
returned ``get(name)`` gives that case's :class:`~ftrain.testbed.jobs.RunResult`. On the first
``get`` of a world size, every case of that size is trained in one launch
(tests/distributed/strategies_worker.py: the process group joined once, then each case as
``ftrain train`` runs it, the same config loading and a fresh Trainer: model, seed, data cursor,
meshes), its metrics, final state and ledger under ``<workdir>/<name>``. On this machine starting
the ranks and importing torch was most of each small run's time; the parity checks are unchanged.
A case whose run failed, or a launch that did not exit 0, fails every ``get`` of that size with
the launch's output; after a launch that succeeded, a case's ``output`` is what was printed from
rank 0's start of that case to its start of the next. ``case_env`` (optional) maps a case's name
to environment variables set in its ranks for that case only (the faults of ftrain/faults.py:
each case may fire its own, as in a process of its own).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch

from ftrain.contract.events import read_jsonl
from ftrain.testbed.jobs import TINY_CONFIG, RunResult, run, worker_env

WORKER = "tests/distributed/strategies_worker.py"


def _case_output(output: str, case: str, cases: list[str]) -> str:
    """The part of a launch's output from rank 0's line that starts ``case`` to the one that starts the next."""

    def start(name: str) -> int:
        return output.find(f"strategies_worker: rank 0: case {name}:")

    begin = start(case)
    assert begin >= 0, f"{case}: rank 0 never started it:\n{output[-6000:]}"
    later = [start(name) for name in cases[cases.index(case) + 1 :]]
    return output[begin : min([i for i in later if i >= 0], default=len(output))]


def batched_runs(
    tmp_path_factory: pytest.TempPathFactory,
    cases: Mapping[str, tuple[int, Sequence[str]]],
    *,
    config: str = TINY_CONFIG,
    timeout_s: float = 900,
    env: Mapping[str, str] | None = None,
    case_env: Mapping[str, Mapping[str, str]] | None = None,
) -> Callable[[str], RunResult]:
    runs: dict[str, RunResult] = {}

    def get(name: str) -> RunResult:
        nproc = cases[name][0]
        if name not in runs:
            workdir = tmp_path_factory.mktemp(f"batch-x{nproc}")
            batch = {n: list(overrides) for n, (world, overrides) in cases.items() if world == nproc}
            (workdir / "cases.json").write_text(json.dumps(batch))
            (workdir / "config.toml").write_text(config)
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            worker = [WORKER, str(workdir / "config.toml"), str(workdir), str(workdir / "cases.json")]
            if case_env:
                (workdir / "case_env.json").write_text(json.dumps({n: dict(case_env.get(n, {})) for n in batch}))
                worker.append(str(workdir / "case_env.json"))
            proc = run([*launch, *worker], timeout_s=timeout_s, env=worker_env(**(env or {})))
            for case in batch:
                metrics, final = workdir / case / "metrics.jsonl", workdir / case / "final.pt"
                runs[case] = RunResult(
                    proc.returncode,
                    _case_output(proc.stdout, case, list(batch)) if proc.returncode == 0 else proc.stdout,
                    read_jsonl(metrics) if metrics.exists() else [],
                    torch.load(final, weights_only=False) if final.exists() else None,
                    workdir / case,
                )
        result = runs[name]
        assert result.returncode == 0 and result.final is not None, (
            f"{name}: training failed (exit {result.returncode}):\n{result.output[-6000:]}"
        )
        assert result.metrics and result.metrics[0]["world_size"] == nproc, f"{name}: not run on {nproc} ranks"
        return result

    return get
