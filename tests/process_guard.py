"""Every process a test run starts dies with the run, however the run ends.

A test kills what it starts in its own ``finally``. Two ends skip those ``finally`` blocks, and
the servers, agents and workers (in sessions of their own, so no process-group kill reaches
them) went on running after the run: a SIGTERM or SIGHUP to pytest (``make`` forwards a SIGTERM
to it), whose default action ends the interpreter at once; and a test or fixture whose cleanup
itself failed. So:

- SIGTERM and SIGHUP become :class:`KeyboardInterrupt` in the main thread: the test's
  ``finally`` blocks run, and pytest tears its fixtures down, as after a Ctrl-C.
- Every process started under this run carries ``FTRAIN_TEST_RUN=<this run's id>`` in its
  environment (children copy it: ours build their environments from ``os.environ``). When the
  session ends, any process still carrying it is SIGKILLed and named (a leak: the test that
  started it did not end it).

The id is this run's own, so a second pytest on the same machine (a nested run in a test, or
another developer's) is never touched.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from types import FrameType

MARK = "FTRAIN_TEST_RUN"
_HANDLED = (signal.SIGTERM, signal.SIGHUP)


def marked(run_id: str) -> list[int]:
    """The processes (other than this one) whose environment carries ``MARK=run_id``."""
    needle = f"{MARK}={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:  # gone, or not ours to read
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def kill_marked(run_id: str) -> list[str]:
    """SIGKILL every process of this run still alive; what each was (for the leak report)."""
    leaked = []
    for pid in marked(run_id):
        what = _command(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        if what:  # a zombie has no command line: it was already dead
            leaked.append(f"{pid}: {what}")
    return leaked


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def pytest_configure(config: object) -> None:
    """Mark this run's processes and turn SIGTERM/SIGHUP into KeyboardInterrupt."""
    os.environ[MARK] = uuid.uuid4().hex
    for sig in _HANDLED:
        signal.signal(sig, _interrupt)


def pytest_unconfigure(config: object) -> None:
    """After the session's fixtures are torn down: kill what is left of this run, and name it."""
    for sig in _HANDLED:
        signal.signal(sig, signal.SIG_DFL)
    run_id = os.environ.get(MARK, "")
    leaked = kill_marked(run_id) if run_id else []
    if leaked:
        print(f"\nprocess_guard: killed {len(leaked)} process(es) left running by tests:", file=sys.stderr)
        for line in leaked:
            print(f"  {line}", file=sys.stderr)


__all__ = ["MARK", "kill_marked", "marked", "pytest_configure", "pytest_unconfigure"]
