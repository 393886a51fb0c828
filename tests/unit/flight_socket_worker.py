"""A worker's flight-recorder side as tests/unit/test_flight_socket.py drives it: a real process
that joins a one-rank gloo world with the recorder on (``ENTRIES`` collectives recorded), then
obeys one command per stdin line and answers each with one JSON line on stdout:

- ``start``: ``ftrain.agent_link.heartbeat.from_env`` as a worker started by an agent calls it (the agent's
  pid, heartbeat path and stack directory come from the environment the test sets);
- ``stats``: how many snapshots the recorder took (counted here, around the module's own
  ``snapshot``, so that any version of the server is counted alike), and what the server says;
- ``train``: a few more collectives, to show the worker goes on;
- ``quit``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ENTRIES = 2000
os.environ["TORCH_FR_BUFFER_SIZE"] = str(ENTRIES)

import torch  # noqa: E402 - after the recorder's setting
import torch.distributed as dist  # noqa: E402

from ftrain.agent_link import flight_recorder, heartbeat  # noqa: E402

taken = 0
_snapshot = flight_recorder.snapshot


def _counted(*args: Any, **kwargs: Any) -> Any:
    global taken
    taken += 1
    return _snapshot(*args, **kwargs)


flight_recorder.snapshot = _counted  # the server looks it up at call time


def main() -> None:
    flight_recorder.new_world()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for _ in range(ENTRIES):
        dist.all_reduce(torch.ones(4))
    hb = None
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "start":
            hb = heartbeat.from_env(0, 0)
            flight = hb.flight if hb is not None else None
            out: dict[str, Any] = {"started": hb is not None, "available": getattr(flight, "available", None)}
        elif command == "stats":
            flight = hb.flight if hb is not None else None
            refusals = getattr(flight, "refusals", None)
            out = {"taken": taken, "refused": getattr(refusals, "total", None)}
        elif command == "train":
            for _ in range(10):
                dist.all_reduce(torch.ones(4))
            out = {"trained": True}
        elif command == "quit":
            break
        else:
            out = {"error": f"unknown command {command!r}"}
        print(json.dumps(out), flush=True)
    if hb is not None:
        hb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
