"""A real ``ftrain agent`` whose workers are cheap stand-ins, for the control-plane benchmark's
faithfulness check (its simulated agents against real agent processes).

    python bench/lib/control_plane_agent.py agent [ftrain agent options] -- CONFIG.toml
    python bench/lib/control_plane_agent.py worker --nproc 1 --node-rank 0   (the agent starts it)

``agent`` runs the ``ftrain agent`` command line unchanged (``ftrain.cli.main``: the production
wiring, heartbeat socket, event log, torchrun supervision by PID) except for the one command
each round launches: instead of ``torchrun ... -m ftrain train`` it starts ``worker`` here, a
launcher that forks one process per local rank; each sends the agent a step beat every
``--step-s`` and an ``alive`` every second on the heartbeat socket, as a training worker does
(:class:`ftrain.contract.heartbeat.Message`), and nothing else: no torch, no etcd.

What must stay true: the launcher and its ranks die with their parent (parent-death signal), as
torchrun and its workers do; the ranks are the launcher's children, so the agent takes on their
PIDs from the beats as it does a real round's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
import time

PR_SET_PDEATHSIG = 1
#: a step's time by phase (shares of the step), as control_plane_fakes.PHASE_SHARES
PHASE_SHARES = {"data": 0.05, "forward": 0.3, "backward": 0.45, "comm_wait": 0.1, "optimizer": 0.1}


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_loop(round_: int, rank: int, local_rank: int, path: str, step_s: float) -> None:
    """Beat every ``step_s`` and say ``alive`` every second, forever."""
    from ftrain.contract.heartbeat import Message

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    started = time.monotonic()
    step, next_alive = 0, started + 1.0
    phases = {p: share * step_s for p, share in PHASE_SHARES.items()}
    while True:
        next_beat = started + (step + 1) * step_s
        now = time.monotonic()
        if now >= next_beat:
            msg = Message(
                kind="beat", round=round_, rank=rank, local_rank=local_rank, pid=os.getpid(), time=time.time(),
                step=step, step_time_s=step_s, committed_step=(step // 100) * 100 if step >= 100 else -1,
                phases_s=phases,
            )  # fmt: skip
            step += 1
        elif now >= next_alive:
            msg = Message(
                kind="alive", round=round_, rank=rank, local_rank=local_rank, pid=os.getpid(), time=time.time()
            )
            next_alive += 1.0
        else:
            time.sleep(min(next_beat, next_alive) - now)  # a worker's own pace, not synchronisation
            continue
        try:
            sock.sendto(msg.encode(), path)
        except OSError:
            pass  # the agent's socket is gone or full: a real worker drops the datagram too


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="control_plane_agent.py worker")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--step-s", type=float, default=0.5)
    args = p.parse_args(argv)
    die_with_parent()
    round_, path = int(os.environ["FTRAIN_ROUND"]), os.environ["FTRAIN_HEARTBEAT"]
    for local_rank in range(args.nproc):
        if os.fork() == 0:
            die_with_parent()
            rank_loop(round_, args.node_rank * args.nproc + local_rank, local_rank, path, args.step_s)
            os._exit(0)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return 0


def agent_main(argv: list[str]) -> int:
    from ftrain.agents.workers import Launch
    from ftrain.cli import main

    script = os.path.abspath(__file__)

    def command(self: Launch) -> list[str]:
        return [
            sys.executable,
            script,
            "worker",
            "--nproc",
            str(self.nproc_per_node),
            "--node-rank",
            str(self.node_rank),
        ]

    Launch.command = command  # the one change: what a round launches
    return main(["agent", *argv])


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("agent", "worker"):
        sys.exit("usage: control_plane_agent.py agent|worker ...")
    sys.exit((agent_main if sys.argv[1] == "agent" else worker_main)(sys.argv[2:]))
