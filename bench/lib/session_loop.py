"""examples/own_loop/train.py with a stopwatch: the example's own ``train`` and arguments, run by
``bench/recovery.py``'s ``session_live`` system as the script of ``ftrain agent --script
bench/lib/session_loop.py --recovery live -- [--probe-log PATH] [--step-sleep-s S] EXAMPLE_ARGS``.

The example's loop is not copied: its ``train(session, args)`` is called as its ``main`` calls it,
with :class:`ProbeSession` for the session, an :class:`ftrain.Session` that appends a JSON line
to ``--probe-log`` (one file for every process of the job, ``O_APPEND``) at each
``step``: :meth:`ftrain.Session.step` was called, the step's update is done (the mark is taken on
entry, before the session's heartbeat, boundary agreement and save, as ``ftrain train``'s
metrics line is written before its own). A round's restore needs no mark of the loop's: the
session logs ``live_restored`` into the job's event log.

After each step it sleeps ``--step-sleep-s`` (``ftrain train``'s ``FTRAIN_FAULT_STEP_SLEEP_S``,
so that a fault finds the job running); ``step_time_s`` is the time since the previous step's
sleep ended (the sleep excluded).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ftrain

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop" / "train.py"


class ProbeSession(ftrain.Session):
    """A session that writes a timestamped JSON line at each step (see the module doc)."""

    def __init__(self, checkpoint_uri: str, *, probe_log: str, step_sleep_s: float, **kwargs: Any):
        super().__init__(checkpoint_uri, **kwargs)
        self._probe_fd = os.open(probe_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._step_sleep_s = step_sleep_s
        self._since = 0.0  #: monotonic end of the previous step's sleep (0: none this round)

    def _mark(self, kind: str, **fields: Any) -> None:
        record = {
            "time": time.time(),
            "probe": kind,
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.world_size,
            "round": self.round,
            **fields,
        }
        os.write(self._probe_fd, (json.dumps(record) + "\n").encode())  # one write: lines never interleave

    def load(self, state: Mapping[str, Any], *, step: int = -1) -> int:
        self._since = 0.0  # the first step after a load has no interval
        return super().load(state, step=step)

    def step(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> bool:
        now = time.monotonic()
        self._mark("step", step=step, step_time_s=round(now - self._since, 6) if self._since else None)
        saved = super().step(step, state, metrics)
        if self._step_sleep_s > 0:
            time.sleep(self._step_sleep_s)
        self._since = time.monotonic()
        return saved


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("own_loop_train", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe-log", required=True, help="the JSON-lines file every process appends its marks to")
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="sleep after each step (default 0)")
    ours, rest = p.parse_known_args(argv)
    example = load_example()
    args = example.parse(rest)
    session = ProbeSession(
        args.ckpt, interval_steps=args.save_every, probe_log=ours.probe_log, step_sleep_s=ours.step_sleep_s
    )
    session.run(lambda s: example.train(s, args), warm_up=lambda: example.warm_up(args.seq))  # as the example


if __name__ == "__main__":
    main(sys.argv[1:])
