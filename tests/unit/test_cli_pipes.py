"""The ``ftrain`` command line when its reader goes away (``ftrain config --reference | head``,
``ftrain status ... | head``): it ends quietly, as a command ended by SIGPIPE does, with no
``BrokenPipeError`` traceback (issue 38 item 19)."""

from __future__ import annotations

import subprocess
import sys

from ftrain.cli import BROKEN_PIPE
from ftrain.testbed.procs import REPO


def test_a_reader_that_went_away_ends_the_command_quietly() -> None:
    """The read end is closed before the command writes a byte (``| head`` that had enough, or
    ``| true``): every write fails with EPIPE, the deterministic case of a reader gone."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftrain", "config", "--reference"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == BROKEN_PIPE, stderr
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert stderr == ""
