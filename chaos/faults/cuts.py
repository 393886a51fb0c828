"""Network faults that hold for a while and heal on their own: a cut made, held until
``duration_s`` passed or the job reached ``heal_at_step`` (whichever the spec asks; a step that
never comes heals at ``max_s``), then undone — healing never needs a human. The heal is recorded
as ``chaos_node_back`` for the node the cut was about, so the invariants can tell when that node
had to be back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_node
from ftrain.contract import events as ev
from ftrain.testbed.wait import WaitTimeout, wait_for


def held(
    ctx: Context,
    spec: FaultSpec,
    node: str,
    cut: Callable[[], None],
    heal: Callable[[], None],
    *,
    default_s: float,
    **detail: Any,
) -> dict[str, Any]:
    """Apply ``cut``, record the fault, hold it, then ``heal`` (also if the wait is interrupted)."""
    heal_at_step = spec.params.get("heal_at_step")
    duration_s = float(spec.params.get("duration_s", default_s))
    max_s = float(spec.params.get("max_s", 120.0))
    cut()
    began = time.monotonic()
    record = ctx.emit(spec.kind, node=node, step=ctx.cluster.step(), duration_s=duration_s, **detail)
    try:
        if heal_at_step is None:
            until = lambda: time.monotonic() - began >= duration_s  # noqa: E731
        else:
            until = lambda: ctx.cluster.step() >= int(heal_at_step)  # noqa: E731
        try:
            wait_for(lambda: ctx.stop() or until(), max_s if heal_at_step is not None else duration_s + 5, "the heal")
        except WaitTimeout:
            pass  # heal_at_step never came (the cut may be what stops training): heal now
    finally:
        heal()
        ctx.events.emit(ev.ChaosNodeBack(node=node))
    record["held_s"] = round(time.monotonic() - began, 3)
    return record


def cut_off_from(ctx: Context, spec: FaultSpec, node: str, others: list[str], *, default_s: float) -> dict[str, Any]:
    """:func:`held` for silent cuts of ``node`` from each of ``others`` (each drops what it
    would send to ``node``: the node's packets arrive and are never answered)."""
    net = ctx.need_net(spec.kind)

    def cut() -> None:
        for other in others:
            net.cut(node, other)

    def heal() -> None:
        for other in others:
            net.heal(node, other)

    return held(ctx, spec, node, cut, heal, default_s=default_s, cut_from=others)


def target(ctx: Context, spec: FaultSpec) -> str:
    """The node a network fault is about (``node``, or a seeded choice among running nodes)."""
    return pick_node(ctx, spec.node)
