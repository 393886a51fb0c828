"""``bit_flip``: silent data corruption. A live worker of the current round flips one bit of its
first parameter (``target = "param"``, the default) or of that parameter's first AdamW moment
(``target = "exp_avg"``) after its next optimizer update, in memory, with no error anywhere
(``FTRAIN_FAULT_REQUESTS_DIR``, ``ftrain/faults.py``: the fault writes a request file named after
the worker's pid). The job rides it out: the cross-replica consistency check must find it
(``replica_mismatch``) and roll back to a verified checkpoint, so the scenario's job must set
``--consistency.interval`` > 0 and ``--consistency.on_mismatch=rollback`` (the fault refuses to
act otherwise), and a strategy whose replicas are compared (ddp, hsdp; see docs/checkpoints.md).
It waits for a round of more than one rank: in a world of one nothing can be compared, and a
soak that flipped a bit there kept the corruption to its end (the stress profile, seed 1: a
flip in a one-node round after a node loss went unseen and the final state differed). A round
change between that check and the flip can still put the flip in a one-rank world.
The record's ``step`` is the step training had reached when the request was written: the flip
happens after the first update that follows."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultError, FaultSpec
from ftrain.chaos.faults.targets import ask_worker, current_round, pick_worker
from ftrain.contract.events import Event
from ftrain.faults import BITFLIP_TARGETS
from ftrain.testbed.wait import WaitTimeout, wait_for


def _checked(ctx: Context, spec: FaultSpec) -> str:
    target = str(spec.params.get("target", "param"))
    if target not in BITFLIP_TARGETS:
        raise FaultError(f"{spec.kind}: target {target!r} is not one of {', '.join(BITFLIP_TARGETS)}")
    args = ctx.cluster.worker_args
    interval = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("--consistency.interval=")), "0")
    policy = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("--consistency.on_mismatch=")), "")
    if interval in ("", "0") or policy != "rollback":
        raise FaultError(
            f"{spec.kind}: the job must check its replicas and roll back (add --consistency.interval=1 and "
            "--consistency.on_mismatch=rollback to the scenario's [job] overrides)"
        )
    return target


def _replicated_round(ctx: Context) -> bool:
    """The current round has more than one rank: a flip has a replica to be compared with (in a
    world of one nothing can find it, by design: docs/checkpoints.md)."""
    rounds = ctx.cluster.events(Event.ROUND_FORMED)
    return bool(rounds) and max(rounds, key=lambda e: e["new_round"]).get("world_size", 0) > 1


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    target = _checked(ctx, spec)
    try:
        wait_for(lambda: ctx.stop() or _replicated_round(ctx), 300, "a round with more than one rank")
    except WaitTimeout as e:
        raise FaultError(f"{spec.kind}: {e}") from None
    if ctx.stop():
        return ctx.emit(spec.kind, step=ctx.cluster.step(), detection_owed=False, why="the run ended first")
    node, pid = pick_worker(ctx, spec.node)
    started = ctx.cluster.events(Event.WORKER_STARTED, round=current_round(ctx), pid=pid)
    rank = started[-1]["rank"] if started else -1
    record = ctx.emit(spec.kind, node=node, pid=pid, rank=rank, target=target, step=ctx.cluster.step())
    ask_worker(ctx, pid, target)
    return record


FAULT = FAULTS.register(
    Fault(
        kind="bit_flip",
        act=_act,
        outcome=Outcome.RIDDEN_OUT,
        detected_by=(Event.REPLICA_MISMATCH,),
        must_be_detected=True,
    )
)
