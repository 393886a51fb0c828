"""``s3_faults``: for ``duration_s`` (default 8 s) the S3 proxy injects, at seeded rates, 5xx
replies (``error``), delays of ``latency_s`` (``latency``), connection resets (``reset``) and
truncated bodies (``truncate``). What it injected is added to the record and emitted as
``chaos_fault_done``. Storage retries must ride it out."""

from __future__ import annotations

import time
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.s3proxy import FaultRates
from ftrain.contract import events as ev


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    duration_s = float(spec.params.get("duration_s", 8.0))
    rates = FaultRates(
        error=float(spec.params.get("error", 0.1)),
        latency=float(spec.params.get("latency", 0.1)),
        reset=float(spec.params.get("reset", 0.05)),
        truncate=float(spec.params.get("truncate", 0.05)),
        latency_s=float(spec.params.get("latency_s", 0.3)),
    )
    proxy = ctx.need_proxy(spec.kind)
    before = dict(proxy.injected)
    proxy.set_faults(rates)
    record = ctx.emit(spec.kind, duration_s=duration_s, rates=str(rates), step=ctx.cluster.step())
    try:
        time.sleep(duration_s)
    finally:
        proxy.set_faults(None)
    record["injected"] = {k: v - before[k] for k, v in proxy.injected.items()}
    ctx.events.emit(ev.ChaosFaultDone(kind=spec.kind, detail={"injected": record["injected"]}))
    return record


FAULT = FAULTS.register(Fault(kind="s3_faults", act=_act, outcome=Outcome.RIDDEN_OUT))
