"""One rank of tests/distributed/test_round_watchdog.py (torchrun, 3 ranks, gloo).

Phase 1 (prompt): a newer round is assigned to every rank while all of them are healthy; they
leave at their next "step boundary" well within the grace, so the watchdog must not fire.
Phase 2 (stuck): rank 2 stops itself (SIGSTOP); ranks 0 and 1 are blocked in an all-reduce with
it when their agent (a timer here) assigns a newer round: the watchdog must free them, after its
grace, or at once when the assignment says the old round lost a member (second argument
``interrupt``).
Ranks 0 and 1 write what happened to ``<out>/rank<r>.json``; rank 0 then continues rank 2,
whose own collective fails on the connections its peers shut down.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrain.contract.control import Assignment, ControlFile
from ftrain.distributed import exit_without_teardown
from ftrain.recovery.round_watchdog import RoundWatchdog


def _assign(control: ControlFile, round_: int, rank: int, interrupt: bool = False) -> None:
    control.write(
        Assignment(round=round_, rank=rank, world_size=3, local_rank=rank, local_world_size=3, node_rank=0, nnodes=1,
                   master_addr="127.0.0.1", master_port=29500 + round_, interrupt=interrupt)
    )  # fmt: skip


def main(out: str, interrupt: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pids = [None] * 3
    dist.all_gather_object(pids, os.getpid())
    control = ControlFile(str(Path(out) / f"control{rank}"))
    _assign(control, 1, rank)

    # a step estimate of 10 s: a 30 s grace, which a busy machine's slow barrier stays well within
    with RoundWatchdog(control.path, 1, lambda: 10.0, set()) as prompt:
        dist.barrier()
        _assign(control, 2, rank)  # the agent moves on; this "step" ends normally
        dist.all_reduce(torch.ones(4))
    dist.barrier()

    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        try:  # continued by rank 0 once the others are free: its peers' connections are gone
            dist.all_reduce(torch.ones(4))
        except RuntimeError:
            pass
        _leave()
    assigned_at = [0.0]

    def agent() -> None:
        time.sleep(0.3)
        assigned_at[0] = time.monotonic()
        _assign(control, 3, rank, interrupt)

    threading.Thread(target=agent, daemon=True).start()
    error = ""
    with RoundWatchdog(control.path, 2, lambda: 0.01, set()) as stuck:
        try:
            dist.all_reduce(torch.ones(4))  # rank 2 never joins
        except RuntimeError as e:
            error = str(e)
    freed_s = time.monotonic() - assigned_at[0]
    (Path(out) / f"rank{rank}.json").write_text(
        json.dumps({"prompt_fired": prompt.fired, "stuck_fired": stuck.fired, "error": error, "freed_s": freed_s})
    )
    if rank == 0:
        os.kill(pids[2], signal.SIGCONT)
    _leave()


def _leave() -> None:
    """Exit without tearing down the process group its peers shut down, as ``ftrain train``
    does: gloo's destructors can abort the process ("terminate called without an active
    exception", seen in CI on rank 2), which is not what this test is about."""
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "interrupt")
