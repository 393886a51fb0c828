"""Child processes of tests, benchmarks and chaos runs: their environment and their end."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from ftrain.agents.workers import descendants, signal_pids

REPO = Path(__file__).resolve().parent.parent


def quiet_env(**extra: str) -> dict[str, str]:
    """This environment, with one intra-op thread per rank (bitwise reproducible, no fighting
    over cores) and this checkout first on the import path; then ``extra``."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    )
    env.update(extra)
    return env


def kill_tree(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGKILL a process and everything under it (workers run in their own sessions), and reap it."""
    signal_pids([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
    proc.wait(timeout=timeout_s)
