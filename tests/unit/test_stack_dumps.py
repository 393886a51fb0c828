"""The agent reads a worker's stack dump once the kernel says the worker's handler returned."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

from ftrain.agents.workers import _usr1_blocking_threads, _usr1_in_flight, dump_stacks
from ftrain.testbed.wait import wait_for

# A worker as the heartbeat sets one up: faulthandler on SIGUSR1 writes every thread's stack to
# its file (<dir>/<pid>.txt, or an inherited fd); three threads deep in calls (a dump of some
# 10 KB), the main thread asleep in C (as one waiting in a collective is).
WORKER = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, threading, time
    where = sys.argv[1]
    out = os.fdopen(int(where), "w") if where.isdigit() else open(f"{where}/{os.getpid()}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True, chain=False)
    def deep(n):
        return deep(n - 1) if n else threading.Event().wait()
    for _ in range(3):
        threading.Thread(target=deep, args=(60,), daemon=True).start()
    def bottom_of_main():
        print("ready", flush=True)
        time.sleep(3600)  # in C, as a collective's wait is, until the test kills it
    bottom_of_main()
    """
)


def _start(where: str, **kw: object) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, where], stdout=subprocess.PIPE, text=True, **kw)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_a_dump_is_read_whole_from_a_running_and_a_stopped_worker_and_again_later(tmp_path):
    procs = [_start(str(tmp_path)) for _ in range(2)]
    try:
        running, stopped = (p.pid for p in procs)
        os.kill(stopped, signal.SIGSTOP)
        wait_for(lambda: open(f"/proc/{stopped}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 10, "stopped")
        for dump in range(2):  # the second dump is read from where the first ended
            stacks = dump_stacks([running, stopped], str(tmp_path), timeout_s=30)
            for pid in (running, stopped):
                text = stacks[pid]
                # whole: every thread, the deep ones to their 60th frame, the main one to its bottom
                assert text.count("(most recent call first)") == 4, text
                assert text.count("in deep") == 3 * 61 and "in bottom_of_main" in text, text
                assert text.rstrip().endswith("in <module>"), text
                # the handler ran on the main thread (sent to it): its own stack cannot be torn
                current = text[text.index("Current thread") :]
                assert "in bottom_of_main" in current and "in deep" not in current, text
                assert "cut:" not in text and ("was stopped" in text) == (pid == stopped and dump == 0), text
    finally:
        _stop(procs)


def test_the_kernel_says_when_a_handler_is_still_writing(tmp_path):
    """A handler held mid-dump (its pipe full) is in flight until its reader drains the pipe."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    proc = _start(str(w), pass_fds=(w,))
    os.close(w)
    try:
        before = _usr1_blocking_threads(proc.pid)
        assert not _usr1_in_flight(proc.pid, before)
        os.kill(proc.pid, signal.SIGUSR1)
        # the dump is more than a 4 KiB pipe holds: the handler waits in write() until it is read
        read = os.read(r, 512)
        assert _usr1_in_flight(proc.pid, before), "the handler returned before its dump was read"
        while not read.endswith(b"in <module>\n"):
            read += os.read(r, 4096)
        wait_for(lambda: not _usr1_in_flight(proc.pid, before), 10, "the handler returned")
        assert read.count(b"in deep") == 3 * 61
    finally:
        os.close(r)
        _stop([proc])
    # a process that is gone has nothing in flight
    assert not _usr1_in_flight(proc.pid, set())
