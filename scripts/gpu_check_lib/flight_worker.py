"""One rank for the flight recorder check: joins a one-rank group with the recorder on, issues
``--count`` all_reduces of a device tensor, waits for the device, and prints one JSON line: what
``ftrain.agent_link.flight_recorder.snapshot`` holds of them and what is still in flight.

    python scripts/gpu_check_lib/flight_worker.py --backend nccl --device cuda --count 32
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from ftrain.agent_link import flight_recorder
from ftrain.testbed.wait import WaitTimeout, wait_for

SETTLE_TIMEOUT_S = 10.0


def _settled(backend: str, count: int) -> bool:
    mine = [c for c in flight_recorder.snapshot(0).entries if c.op == f"{backend}:all_reduce"]
    return len(mine) >= count and all(c.done for c in mine) and flight_recorder.oldest_in_flight() is None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--entries", type=int, default=2000, help="the recorder's buffer (logging.flight_recorder_entries)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    flight_recorder.enable(args.entries)  # before the first group, as ftrain's workers do
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    flight_recorder.new_world()
    dist.init_process_group(
        args.backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        x = torch.ones(1024, device=device)
        for _ in range(args.count):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # torch marks entries completed from another thread (NCCL's watchdog; gloo's work
        # callbacks): wait until every one is, or the deadline, and report what was there
        began = time.monotonic()
        try:
            wait_for(lambda: _settled(args.backend, args.count), SETTLE_TIMEOUT_S, "every all_reduce completed")
        except WaitTimeout:
            pass
        settle_s = time.monotonic() - began
        record = flight_recorder.snapshot(0)
        in_flight = flight_recorder.oldest_in_flight()
        ops = collections.Counter(c.op for c in record.entries)
        mine = [c for c in record.entries if c.op == f"{args.backend}:all_reduce"]
        out = {
            "backend": args.backend,
            "device": str(device),
            "buffer_env": {k: os.environ.get(k, "") for k in flight_recorder.BUFFER_ENV},
            "available": record.available,
            "issued": args.count,
            "recorded": len(mine),
            "recorded_done": sum(c.done for c in mine),
            "sizes": mine[-1].sizes if mine else None,
            "dtypes": mine[-1].dtypes if mine else None,
            "ops": dict(ops),
            "groups": record.groups,
            "in_flight_after_sync": in_flight.describe() if in_flight else None,
            "settle_s": round(settle_s, 3),
            "result_ok": bool((x == 1).all()),  # a sum over one rank leaves the tensor as it was
        }
        print(json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
