"""What the flight recorder costs: steady-state step time with it on against off, or under a flood.

    python bench/flight_recorder.py [--repeats 5] [--steps 300] [--warmup 30] [--entries 2000]
                                    [--config configs/demo.toml] [--smoke] [--flood RATE]

The demo job (ddp on 2 ranks, no checkpoints) under one node agent (``--recovery restart``:
heartbeats, the stack-dump handler and the flight-record server all running), in pairs run
one right after the other, the order alternating from pair to pair:

- ``on``: ``logging.flight_recorder_entries = --entries`` (the default, 2000): torch records
  every collective of every group, and each worker serves its record to the agent;
- ``off``: ``logging.flight_recorder_entries = 0``.

Each run's figure is the median ``step_time_s`` of rank 0's metrics after ``--warmup`` steps;
the result is the median over pairs of on / off (target: <= 1.02). Ends with one JSON line.

``--flood RATE``: both sides have the recorder on, and the pairs are ``flood`` / ``quiet``: during
the ``flood`` run this process sends ``RATE`` datagrams a second, spread over the flight sockets
of the workers it started (found in ``/proc/net/unix``), half of them carrying the worker's agent
pid as credentials (root may state any: so they pass the gate, and only the rate limit stands
between them and a snapshot each), half as a stranger. Datagrams the worker's full queue refuses
are counted, not retried. Target: flood / quiet <= 1.05 (before the gate and the rate limit, a
flood slowed the workers to 0.2-0.5x). Each flood also reports ``server_thread_core_share``: the
CPU seconds per second the busiest worker's flight-recorder thread used while flooded (from
``/proc/<pid>/task/*/stat``): the cost itself, which the machine's load does not blur.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.steady_state import (  # noqa: E402 - after the path setup
    pair_parser,
    pair_summary,
    parse_pair_args,
    report,
    run_agent,
    run_pairs,
)
from ftrain.agents.workers import descendants  # noqa: E402
from ftrain.contract.flight import socket_name  # noqa: E402
from ftrain.contract.worker_env import AGENT_PID  # noqa: E402

TARGET_RATIO = 1.02
TARGET_FLOOD_RATIO = 1.05
_FLIGHT_NAME = re.compile(r"@ftrain-flight-(\d+)$")


class Flood:
    """Sends ``rate_per_s`` datagrams a second to the flight sockets of this process's
    descendants (see the module doc) from a thread, until :meth:`stop`."""

    def __init__(self, rate_per_s: float):
        self.rate_per_s = rate_per_s
        self.sent = self.full = self.as_agent = 0
        self._server_cpu: dict[int, tuple[float, float, float]] = {}  #: pid -> (first seen, CPU s then, CPU s now)
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """What was sent, and the share of one core the workers' flight-recorder threads used
        while flooded (CPU seconds over wall seconds, the busiest worker's: a figure the
        machine's load does not blur, and a bound on the GIL they held)."""
        self._stop.set()
        self._thread.join()
        shares = [(now - then) / max(1e-9, time.monotonic() - seen) for seen, then, now in self._server_cpu.values()]
        return {
            "sent": self.sent,
            "queue_full": self.full,
            "as_agent": self.as_agent,
            "server_thread_core_share": round(max(shares, default=0.0), 5),
        }

    def _sample_server_cpu(self, pids: list[int]) -> None:
        tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        for pid in pids:
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                        stat = fh.read()
                    if "(flight-recorder)" not in stat:
                        continue
                    fields = stat.rpartition(")")[2].split()
                    cpu_s = (int(fields[11]) + int(fields[12])) * tick_s  # utime + stime
                    seen, then, _ = self._server_cpu.get(pid, (time.monotonic(), cpu_s, cpu_s))
                    self._server_cpu[pid] = (seen, then, cpu_s)
            except (OSError, ValueError, IndexError):
                continue

    @staticmethod
    def _targets() -> dict[int, int]:
        """pid -> its agent's pid, of every descendant with a flight socket."""
        ours = set(descendants(os.getpid()))
        try:
            with open("/proc/net/unix") as fh:
                named = {int(m.group(1)) for line in fh if (m := _FLIGHT_NAME.search(line.strip()))}
        except OSError:
            return {}
        targets = {}
        for pid in named & ours:
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
                targets[pid] = int(env.get(AGENT_PID.encode(), b"0") or 0)
            except (OSError, ValueError):
                continue
        return targets

    def _run(self) -> None:
        batch_s = 0.05
        per_batch = max(1, int(self.rate_per_s * batch_s))
        targets: dict[int, int] = {}
        looked_at = 0.0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            n = 0
            while not self._stop.wait(batch_s):
                if time.monotonic() - looked_at > 0.5:
                    targets, looked_at = self._targets(), time.monotonic()
                    self._sample_server_cpu(list(targets))
                for pid, agent_pid in targets.items():
                    for _ in range(max(1, per_batch // max(1, len(targets)))):
                        n += 1
                        nonce, creds = f"flood{n:x}".encode(), []
                        if n % 2 and agent_pid:
                            creds = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", agent_pid, 0, 0))]
                        try:
                            sock.sendmsg([nonce], creds, 0, socket_name(pid))
                            self.sent += 1
                            self.as_agent += bool(creds)
                        except BlockingIOError:
                            self.full += 1
                        except OSError:  # gone, or not allowed to state those credentials
                            continue


def measure(
    config: Path,
    *,
    repeats: int,
    steps: int,
    warmup: int,
    entries: int,
    nproc: int = 2,
    timeout_s: float = 600.0,
    flood_per_s: float = 0.0,
) -> dict[str, Any]:
    started, load_start = time.monotonic(), os.getloadavg()[0]
    sides = ("flood", "quiet") if flood_per_s else ("on", "off")
    what = f"a flood of {flood_per_s:.0f} datagrams/s vs quiet" if flood_per_s else "recorder on vs off"
    print(
        f"flight recorder: {repeats} pair(s) of {steps}-step runs of {config.name} on {nproc} ranks under an agent, "
        f"{what} ({entries} entries); first {warmup} steps left out",
        flush=True,
    )
    floods: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ftrain-flight-") as tmp:
        workdir = Path(tmp)

        def run(side: str, name: str) -> Path:
            extra = [f"--logging.flight_recorder_entries={0 if side == 'off' else entries}"]
            flood = Flood(flood_per_s) if side == "flood" else None
            try:
                return run_agent(config, workdir, name, steps, nproc, "restart", timeout_s, extra)
            finally:
                if flood is not None:
                    floods.append(flood.stop())
                    print(f"  flood: {floods[-1]}", flush=True)

        pairs = run_pairs(sides, run, repeats=repeats, warmup=warmup)
    settings = {"config": str(config), "steps": steps, "warmup": warmup, "entries": entries, "nproc": nproc}
    if flood_per_s:
        settings["flood_per_s"] = flood_per_s
    summary = pair_summary(
        "flight_recorder",
        "flood_vs_quiet" if flood_per_s else "recorder_on_vs_off",
        sides,
        pairs,
        target=TARGET_FLOOD_RATIO if flood_per_s else TARGET_RATIO,
        settings={**settings, "repeats": repeats},
        started=started,
        load_start=load_start,
    )
    if flood_per_s:
        summary["floods"] = floods
    return summary


def main(argv: list[str] | None = None) -> int:
    p = pair_parser(__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=2000, help="collectives kept when on (default 2000)")
    p.add_argument("--flood", type=float, default=0.0, help="datagrams a second: flood vs quiet instead of on vs off")
    args = parse_pair_args(p, argv)
    if args.entries < 1 or args.flood < 0:
        p.error("need --entries >= 1 and --flood >= 0")
    return report(
        lambda: measure(
            args.config,
            repeats=args.repeats,
            steps=args.steps,
            warmup=args.warmup,
            entries=args.entries,
            nproc=args.nproc,
            timeout_s=args.timeout_s,
            flood_per_s=args.flood,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
