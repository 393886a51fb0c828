"""A SIGTERM to a test run ends every process its tests started (tests/process_guard.py).

The run under test is a real pytest with the guard loaded, whose one test starts two processes
in sessions of their own (as agents and workers are): one its ``finally`` kills, one nothing
kills (a leak). A SIGTERM arrives while the test runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from ftrain.agents.workers import descendants, signal_pids
from ftrain.testbed.procs import REPO, quiet_env
from ftrain.testbed.wait import wait_for

INNER = """
import subprocess, time
from pathlib import Path

def test_long_running():
    out = Path(__file__).parent
    cleaned = subprocess.Popen(["sleep", "600"], start_new_session=True)
    leaked = subprocess.Popen(["sleep", "601"], start_new_session=True)
    (out / "pids").write_text(f"{cleaned.pid} {leaked.pid}")
    try:
        time.sleep(600)  # a long test, interrupted by the SIGTERM
    finally:
        cleaned.kill()
        cleaned.wait()
        (out / "finally-ran").write_text("yes")
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # a zombie: dead, not yet reaped
    except OSError:
        return True


def test_sigterm_runs_the_tests_finally_and_kills_what_it_left(tmp_path: Path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.process_guard",
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env=quiet_env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pids: list[int] = []
    try:
        text = wait_for(
            lambda: (tmp_path / "pids").is_file() and (tmp_path / "pids").read_text(),
            60,
            "the inner test's processes",
            alive=lambda: run.poll() is None,
        )
        pids = [int(p) for p in text.split()]
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
        log = out.decode(errors="replace")
        assert (tmp_path / "finally-ran").is_file(), log
        wait_for(lambda: all(_gone(p) for p in pids), 30, "both processes to be gone", context=lambda: log)
        assert "killed 1 process(es) left running by tests" in log and "sleep 601" in log, log
        assert run.returncode != 0, log  # an interrupted run is no success
    finally:
        if run.poll() is None:
            signal_pids([run.pid, *descendants(run.pid)], signal.SIGKILL)
            run.wait(timeout=30)
        signal_pids([p for p in pids if not _gone(p)], signal.SIGKILL)


def test_the_guard_leaves_other_runs_alone(tmp_path: Path):
    """A process marked with another run's id is not this run's to kill."""
    from tests import process_guard

    other = subprocess.Popen(
        ["sleep", "600"], env={**os.environ, process_guard.MARK: "another-run"}, start_new_session=True
    )
    try:
        assert other.pid not in process_guard.marked(os.environ[process_guard.MARK])
        assert other.pid in process_guard.marked("another-run")
    finally:
        other.kill()
        other.wait()
