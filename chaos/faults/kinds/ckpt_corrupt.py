"""``ckpt_corrupt``: the newest committed checkpoint is damaged (``mode``: bit flip, truncation,
deleted file or edited manifest; default a seeded choice), then, unless ``then_kill = false``,
every worker of the round is killed so that a load meets it (under live recovery a single
replacement would heal from a live peer and never read storage). The record names the damaged commit (``ckpt_step``,
``ckpt_created_time``): that commit is not verified at the end and must never be loaded after."""

from __future__ import annotations

import signal
from typing import Any

from ftrain.chaos.corrupt import MODES, corrupt_step
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_worker, round_workers, send_signal
from ftrain.checkpoint.catalog import list_steps, newest_committed
from ftrain.testbed.wait import wait_for


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    mode = spec.params.get("mode") or ctx.rng.choice(MODES)
    info = wait_for(lambda: newest_committed(list_steps(ctx.storage)), 120, "a committed checkpoint")
    damaged = corrupt_step(ctx.storage, info.dirname, mode, ctx.rng)
    record = ctx.emit(
        spec.kind,
        ckpt_step=info.step,
        ckpt_created_time=info.manifest.created_time,
        mode=mode,
        file=damaged,
        step=ctx.cluster.step(),
    )
    if spec.params.get("then_kill", True):  # make a load meet it
        node, pid = pick_worker(ctx, spec.node)
        everyone = round_workers(ctx)
        for victim in everyone:
            send_signal(victim, signal.SIGKILL)
        record.update(node=node, pid=pid, pids=everyone)
    return record


FAULT = FAULTS.register(Fault(kind="ckpt_corrupt", act=_act, outcome=Outcome.NEW_ROUND, damages_commit=True))
