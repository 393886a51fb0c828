"""Liveness on the heartbeat channel: a frozen worker is told from a busy one within the hang
timeout, whatever its phase (a SIGSTOP during a long load used to wait out the start timeout)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ftrain.agents.heartbeat import Beat, HeartbeatServer
from ftrain.agents.supervision import hung_ranks
from ftrain.testbed.wait import wait_for

WORKER = """
import sys, time
from ftrain.agent_link import heartbeat
hb = heartbeat.from_env(0, 0)
hb.beat(-1, phase="loading")
print("ready", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _loading_worker(tmp_path: Path, round_: int) -> Iterator[tuple[HeartbeatServer, subprocess.Popen]]:
    """A heartbeat server in ``round_`` and a worker of that round that beats once (loading),
    then only says alive; both gone afterwards."""
    server = HeartbeatServer(str(tmp_path / "hb.sock"))
    server.reset(round_)
    env = {**os.environ, "FTRAIN_HEARTBEAT": server.path, "FTRAIN_ROUND": str(round_), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield server, proc
    finally:
        proc.kill()
        proc.wait()
        server.close()


def test_a_loading_worker_says_alive_until_it_is_stopped(tmp_path):
    with _loading_worker(tmp_path, 7) as (server, proc):
        first = wait_for(lambda: server.beats().get(0), 10, "the loading beat")
        assert first.phase == "loading" and first.step == -1
        later = wait_for(
            lambda: (b := server.beats()[0]).alive_at > first.alive_at + 0.5 and b, 10, "alive datagrams while loading"
        )
        assert later.received_at == first.received_at and later.phase == "loading"  # no progress claimed
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)  # an alive datagram already on its way may still land
        stopped_at = server.beats()[0].alive_at
        deadline = time.monotonic() + 2.5  # more than two alive intervals
        while time.monotonic() < deadline:
            assert server.beats()[0].alive_at == stopped_at, "a SIGSTOPped worker cannot say alive"
            time.sleep(0.1)


def _hung(beats: dict[int, Beat], *, hang_timeout_s: float = 5.0, start_timeout_s: float = 60.0) -> list[int]:
    now = time.monotonic()
    return hung_ranks(
        beats,
        nproc_per_node=len(beats),
        started_at=now - 100,
        now=now,
        hang_timeout_s=hang_timeout_s,
        start_timeout_s=start_timeout_s,
    )


def _beat(local_rank: int, phase: str, progress_age_s: float, alive_age_s: float, finished: bool | None = None) -> Beat:
    now = time.monotonic()
    return Beat(
        local_rank=local_rank,
        rank=local_rank,
        pid=100 + local_rank,
        step=-1,
        step_time_s=0.0,
        committed_step=-1,
        received_at=now - progress_age_s,
        phase=phase,
        alive_at=now - alive_age_s,
        finished=finished,
    )


def test_hang_rules_progress_by_phase_and_liveness_in_any_phase():
    assert _hung({0: _beat(0, "loading", 30, 0.5)}) == []  # busy loading, alive: the start timeout applies
    assert _hung({0: _beat(0, "loading", 30, 6)}) == [0]  # frozen while loading: hang timeout
    assert _hung({0: _beat(0, "loading", 61, 0.5)}) == [0]  # alive but no progress past the start timeout
    assert _hung({0: _beat(0, "training", 6, 0.5)}) == [0]  # alive, blocked between steps: a hang
    assert _hung({0: _beat(0, "training", 1, 0.5), 1: _beat(1, "saving", 10, 6)}) == [1]
    # a worker that failed and said so is leaving, not frozen: torchrun's exit (seconds under
    # load) reports the round's end, with the worker's error, not a hang
    assert _hung({0: _beat(0, "exiting", 8, 8, finished=False)}) == []


def test_a_kept_worker_that_freezes_as_the_round_changes_is_hung_after_the_hang_timeout(tmp_path):
    """A worker kept for a new round beats in it only once it has switched; until then its last
    beat stands for it and its "alive" datagrams (of the old round) keep it alive. Frozen just
    before the round changed, it is found by its silence — not after the start timeout (the soak
    waited 60 s for one)."""
    with _loading_worker(tmp_path, 7) as (server, proc):
        wait_for(lambda: server.beats().get(0), 10, "the round-7 beat")
        last = server.beats()
        server.reset(8)
        started_at = time.monotonic()
        server.carry({0: last[0]}, started_at)
        carried = server.beats()[0]
        assert carried.phase == "recovering" and carried.received_at == started_at

        def hung() -> list[int]:
            return hung_ranks(
                server.beats(),
                nproc_per_node=1,
                started_at=started_at,
                now=time.monotonic(),
                hang_timeout_s=1.5,
                start_timeout_s=600.0,
            )

        wait_for(lambda: server.beats()[0].alive_at > carried.alive_at, 10, "round-7 alive datagrams renewing it")
        assert hung() == []  # alive and not switched yet: the start timeout applies to its progress
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: hung() == [0], 15, "the frozen kept worker judged hung")
        assert time.monotonic() - started_at < 60  # far below the start timeout
        server.reset(9)  # forgotten with the round
        assert server.beats() == {}
