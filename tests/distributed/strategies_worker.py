"""One rank of a batch of training runs in one torchrun launch (tests/distributed/batched_runs.py).

``strategies_worker.py CONFIG OUT CASES_JSON``: CASES_JSON maps a case's name to its command-line
overrides. The ranks join the process group once, then train every case in turn, as ``ftrain
train CONFIG OVERRIDES`` would (the same :func:`ftrain.config.load_config` and
:class:`ftrain.train.Trainer`: a fresh model, seed, data cursor and meshes for each case), each
writing ``OUT/<name>/metrics.jsonl`` and ``OUT/<name>/final.pt``. What a launch costs on a small
machine is mostly starting the processes and importing torch: one launch for many cases pays it
once. A case that fails fails the launch (its name is printed first). ``strategies_worker.py CONFIG
OUT CASES_JSON CASE_ENV_JSON``: CASE_ENV_JSON maps a case's name to environment variables set for
that case only (restored after it), and the faults of ftrain/faults.py are re-armed at each case's
start, as in a process of its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ftrain import faults
from ftrain.agent_link import flight_recorder
from ftrain.config import load_config
from ftrain.distributed import (
    exit_without_teardown,
    init_distributed,
    select_device,
    select_dtype,
    shutdown_distributed,
)
from ftrain.train import Trainer


def main(config: str, out: str, cases_json: str, case_env_json: str | None = None) -> None:
    cases: dict[str, list[str]] = json.loads(Path(cases_json).read_text())
    case_env: dict[str, dict[str, str]] = json.loads(Path(case_env_json).read_text()) if case_env_json else {}
    joined: tuple[int, int, int] | None = None
    for name, overrides in cases.items():
        case_dir = Path(out) / name
        case_dir.mkdir(parents=True, exist_ok=True)
        cfg = load_config(
            config,
            [
                f"--logging.metrics_path={case_dir / 'metrics.jsonl'}",
                f"--data.ledger_dir={case_dir / 'ledger'}",
                *overrides,
                f"--train.save_final_path={case_dir / 'final.pt'}",
            ],
        )
        device = select_device(cfg.train)
        if joined is None:  # as ftrain.train.train does, once: the cases share the process group
            flight_recorder.enable(cfg.logging.flight_recorder_entries)
            joined = init_distributed(cfg.parallel, device)
        rank, world, local_world = joined
        print(f"strategies_worker: rank {rank}: case {name}: {' '.join(overrides)}", flush=True)
        env = case_env.get(name, {})
        if case_env_json:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            faults._fired.clear()  # each fault fires once per process: once per case here
        trainer = Trainer(cfg, device, select_dtype(cfg.train, device), rank, world, local_world)
        trainer.run()
        trainer.close()
        dist.barrier()  # every rank is done with this case (its final state written) before the next
        if case_env_json:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
