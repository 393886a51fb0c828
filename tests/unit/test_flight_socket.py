"""The flight recorder's socket against what any local process can do to it, with real sockets
and real processes (tests/unit/flight_socket_worker.py is the worker; this test process is its
agent: ``FTRAIN_AGENT_PID`` is our pid, and ``ftrain.agents.flight.collect`` asks as the agent does):

- a process that took the worker's abstract name first does not stop the worker: it trains on
  without a recorder and says so once;
- a request from another uid, or from this uid but not the agent's pid, is refused: no
  snapshot, no file; the agent's own request is still answered;
- a flood of requests, from the agent itself or from a stranger, costs at most the
  rate-limited number of snapshots (and a stranger's none at all).

Plus the gate's parts on their own (:mod:`ftrain.agent_link.flight_gate`: the token bucket on a fake clock,
the verdict on a datagram, re-stamping a kept record).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftrain.agent_link import flight_gate
from ftrain.agents.flight import collect
from ftrain.contract.flight import FlightRecord, record_path, socket_name
from ftrain.testbed.procs import REPO, kill_tree, quiet_env
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(180)

WORKER = str(Path(__file__).with_name("flight_socket_worker.py"))


class Worker:
    """The worker process, driven one command at a time."""

    def __init__(self, tmp_path: Path):
        self.stack_dir = tmp_path / "stacks"
        env = quiet_env(
            FTRAIN_HEARTBEAT=str(tmp_path / "no-agent-listens.sock"),
            FTRAIN_STACK_DIR=str(self.stack_dir),
            FTRAIN_AGENT_PID=str(os.getpid()),
            FTRAIN_LOG_LEVEL="WARNING",
        )
        self.stderr_path = tmp_path / "worker.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        assert self._line() == {"ready": self.pid}

    def _line(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the worker exited ({self.proc.poll()}):\n{self.stderr()}"
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._line()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def record(self) -> FlightRecord | None:
        path = record_path(str(self.stack_dir), self.pid)
        return FlightRecord.decode(Path(path).read_bytes()) if os.path.exists(path) else None

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    self.ask("quit")
                self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, AssertionError, OSError, ValueError):
            pass
        finally:
            if self.proc.poll() is None:
                kill_tree(self.proc)
            self._stderr.close()


@pytest.fixture
def worker(tmp_path) -> Iterator[Worker]:
    w = Worker(tmp_path)
    try:
        yield w
    finally:
        w.close()


def _send_from(nonces: list[str], pid: int, *, uid: int | None = None, timeout_s: float = 60.0) -> None:
    """Send each of ``nonces`` to the worker ``pid`` from a new process (which first becomes
    ``uid`` if given), waiting while the socket's short queue is full."""
    code = (
        "import os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "if sys.argv[1] != '-':\n"
        "    os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))\n"
        "name = bytes.fromhex(sys.argv[2])\n"
        "for nonce in sys.argv[3:]:\n"
        "    s.sendto(nonce.encode(), name)\n"  # blocking: waits for room in the queue
    )
    who = "-" if uid is None else str(uid)
    subprocess.run([sys.executable, "-c", code, who, socket_name(pid).hex(), *nonces], check=True, timeout=timeout_s)


def test_a_name_taken_by_another_process_leaves_the_worker_training_without_a_recorder(worker):
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        squatter.bind(socket_name(worker.pid))  # what anyone can do with a pid they can predict
        started = worker.ask("start")
        assert started == {"started": True, "available": False}, worker.stderr()
        assert worker.ask("train") == {"trained": True}
        warnings = [line for line in worker.stderr().splitlines() if "flight recorder off" in line]
        assert len(warnings) == 1, worker.stderr()
        assert f"@ftrain-flight-{worker.pid}" in warnings[0] and "another process holds the name" in warnings[0]
        got = collect([worker.pid], str(worker.stack_dir), timeout_s=0.5)  # the agent's request reaches the squatter
        assert worker.pid in got.missing and not got.records
    finally:
        squatter.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another uid needs root (os.setuid in the sender)")
def test_requests_from_another_uid_or_another_process_are_refused_and_the_agents_answered(worker):
    assert worker.ask("start")["started"] is True
    _send_from(["from-nobody"], worker.pid, uid=65534)
    _send_from(["from-a-stranger"], worker.pid)  # this uid, but not the agent's pid

    def settled() -> dict[str, Any] | None:  # both refused, or (the old code) answered
        stats = worker.ask("stats")
        return stats if (stats["refused"] or 0) >= 2 or worker.record() is not None else None

    stats = wait_for(settled, 30, "the worker to refuse both requests", context=worker.stderr)
    assert worker.record() is None, worker.record()  # neither was answered
    assert stats == {"taken": 0, "refused": 2}
    refusals = [line for line in worker.stderr().splitlines() if "refused a request" in line]
    assert len(refusals) == 1 and "uid 65534" in refusals[0], worker.stderr()  # logged once, summed up later

    got = collect([worker.pid], str(worker.stack_dir), timeout_s=30)  # the agent, unchanged
    assert list(got.records) == [worker.pid], got.missing
    assert got.records[worker.pid].pid == worker.pid and len(got.records[worker.pid].entries) == 2000
    assert worker.ask("stats")["taken"] == 1


def test_a_flood_of_requests_costs_at_most_the_rate_limited_snapshots(worker):
    assert worker.ask("start")["started"] is True
    began = time.monotonic()
    strangers = 300
    _send_from([f"stranger-{i}" for i in range(strangers)], worker.pid)  # refused, whatever their number
    stranger_s = time.monotonic() - began
    stats = worker.ask("stats")
    assert stats["taken"] == 0 and worker.record() is None, stats
    # the server takes at most its budget of datagrams a second; the rest wait in the kernel's queue
    assert stats["refused"] <= flight_gate.DATAGRAMS_PER_S * (stranger_s + 1) + flight_gate.DATAGRAMS_PER_S

    began = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:  # the agent itself, asking again and again
        for i in range(100):
            sock.sendto(f"agent-{i}".encode(), socket_name(worker.pid))
        # (blocking sends: each waits for room in the queue the server drains at its budget's pace)
    last = wait_for(  # and once more, now that the queue has room for collect's non-blocking send
        lambda: collect([worker.pid], str(worker.stack_dir), timeout_s=5).records, 60, "the agent's answer"
    )
    elapsed_s = time.monotonic() - began
    assert list(last) == [worker.pid]
    taken = worker.ask("stats")["taken"]
    assert 1 <= taken <= 1 + elapsed_s / flight_gate.MIN_SNAPSHOT_INTERVAL_S, (taken, elapsed_s)


def test_the_budget_allows_a_burst_then_its_rate():
    now = [0.0]
    budget = flight_gate.Budget(5.0, 5.0, clock=lambda: now[0])
    assert [budget.take() for _ in range(7)] == [True] * 5 + [False] * 2
    assert budget.wait_s() == pytest.approx(0.2)
    now[0] += 0.2
    assert budget.take() and not budget.take()
    now[0] += 100.0
    assert sum(budget.take() for _ in range(20)) == 5  # never more than the burst at once


@pytest.mark.parametrize(
    ("data", "sender", "cut", "refused"),
    [
        (b"abc123", None, False, "no sender credentials"),
        (b"abc123", (os.getpid(), os.geteuid() + 1), False, "not this user"),
        (b"abc123", (os.getpid() + 1, os.geteuid()), False, "not this worker's agent"),
        (b"abc123", (os.getpid(), os.geteuid()), True, "longer than"),
        (b"a/../b", (os.getpid(), os.geteuid()), False, "not a nonce"),
        (b"", (os.getpid(), os.geteuid()), False, "not a nonce"),
        (b"x" * 65, (os.getpid(), os.geteuid()), False, "not a nonce"),
    ],
)
def test_a_datagram_is_a_request_only_from_the_agent_and_only_with_a_plain_nonce(data, sender, cut, refused):
    verdict = flight_gate.judge(data, sender, cut, agent_pid=os.getpid())
    assert isinstance(verdict, str) and refused in verdict
    ok = flight_gate.judge(b"0123abcd\n", (os.getpid(), os.geteuid()), False, agent_pid=os.getpid())
    assert ok == flight_gate.Request("0123abcd", os.getpid(), os.geteuid())
    assert isinstance(flight_gate.judge(b"x", (1, os.geteuid()), False, agent_pid=0), flight_gate.Request)


def test_a_kept_record_restamped_decodes_with_the_new_nonce_and_nothing_else_changed():
    record = FlightRecord(0, 7, 1.5, [], {"0": [0, 1], "nonce": [2]}, nonce="placeholder-1")
    again = FlightRecord.decode(flight_gate.restamp(record.encode(), "placeholder-1", "f00d"))
    assert again.nonce == "f00d" and again.groups == record.groups and again.taken_at == record.taken_at
    with pytest.raises(ValueError):
        flight_gate.restamp(b"{}", "placeholder-1", "f00d")


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_the_agent_refuses_a_fifo_or_a_link_planted_as_a_record_instead_of_waiting_on_it(tmp_path, planted):
    from ftrain.agents.flight import _read  # noqa: PLC2701 - the read every collect ends with

    path = Path(record_path(str(tmp_path), 4242))
    if planted == "fifo":
        os.mkfifo(path)  # an open for reading would wait for a writer forever
    else:
        (tmp_path / "elsewhere.json").write_text("{}")
        path.symlink_to(tmp_path / "elsewhere.json")
    answer: list[Any] = []
    reader = threading.Thread(target=lambda: answer.append(_read(str(path), "ab12")), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert answer and isinstance(answer[0], str) and "unreadable flight record" in answer[0], answer
