"""One rank of tests/distributed/test_in_flight.py (torchrun, 2 ranks, gloo, recorder on).

Both ranks fill the recorder with ``ENTRIES`` completed collectives; then rank 0 enqueues
collectives that rank 1 joins only when rank 0 says so (through the store), and records what
:func:`ftrain.agent_link.flight_recorder.oldest_in_flight` says before, during and after, and again in a
second world of the same processes (live recovery's re-initialisation). Rank 0 writes
``<out>/in_flight.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ENTRIES = 2000
os.environ["TORCH_FR_BUFFER_SIZE"] = str(ENTRIES)

import torch  # noqa: E402 - after the recorder's setting
import torch.distributed as dist  # noqa: E402

from ftrain.agent_link import flight_recorder  # noqa: E402
from ftrain.agent_link.flight_recorder import EXACT_AFTER_S, oldest_in_flight  # noqa: E402
from ftrain.distributed import exit_without_teardown, shutdown_distributed  # noqa: E402


def _until(predicate, what: str, timeout_s: float = 30.0, *, fail: bool = True) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    if fail:
        raise AssertionError(f"timed out waiting for {what}")
    return None


def _as_dict(c) -> dict[str, Any] | None:
    return None if c is None else {"seq": c.seq, "group": c.group, "op": c.op, "sizes": c.sizes,
                                   "enqueued_s": c.enqueued_s, "done": c.done}  # fmt: skip


def _cost_ms(calls: int = 200) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        oldest_in_flight()
    return (time.perf_counter() - started) / calls * 1e3


def _settled() -> bool:
    """Nothing in flight (torch marks a group's status completed a moment after wait() returns)."""
    return bool(_until(lambda: oldest_in_flight() is None, "nothing in flight", fail=False))


def _world(store: dist.Store, rank: int, prefix: str) -> None:
    flight_recorder.new_world()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )


def _held(store: dist.Store, rank: int, key: str, group=None) -> dict[str, Any]:
    """Rank 0 enqueues an all_reduce that rank 1 joins only once ``key`` is set."""
    out: dict[str, Any] = {}
    if rank == 1:
        store.wait([key])
        dist.all_reduce(torch.ones(4), group=group)
        return out
    before = time.time()
    work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    out["first"] = _as_dict(_until(oldest_in_flight, "a first sighting"))
    out["enqueued_after_s"] = before
    out["exact"] = _as_dict(_until(lambda: (c := oldest_in_flight()) is not None and c.op and c, "the exact entry"))
    out["cost_exact_ms"] = _cost_ms()
    saved = os.environ.pop("TORCH_FR_BUFFER_SIZE")
    out["recorder_off"] = _as_dict(oldest_in_flight())
    os.environ["TORCH_FR_BUFFER_SIZE"] = saved
    store.set(key, "1")
    work.wait()
    out["settled"] = _settled()
    return out


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, rank == 0)
    _world(store, rank, "world1")
    for _ in range(ENTRIES):
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    result: dict[str, Any] = {"exact_after_s": EXACT_AFTER_S}
    if rank == 0:
        result["idle"] = _settled()
        result["cost_idle_ms"] = _cost_ms()
    result["default"] = _held(store, rank, "go-default")
    sub = dist.new_group([0, 1])
    result["subgroup"] = _held(store, rank, "go-sub", group=sub)
    shutdown_distributed()
    _world(store, rank, "world2")  # a second world: nothing of the first one is in flight
    result["second_world_idle"] = _settled() if rank == 0 else None
    result["second_world"] = _held(store, rank, "go-second")
    shutdown_distributed()
    if rank == 0:
        Path(out, "in_flight.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
