"""A writer paused past its fence check changes nothing once a newer round formed (issue 25,
item 8), with a real etcd fence (commit records) and a real local checkpoint root:

- paused after it inspected a torn step directory and before clearing it: the newer round clears
  it, saves and commits the step; the stale writer resumes, is told its round is over, and
  removes nothing: the committed step is still there and loads;
- the same with an empty step directory (where it would abort unfinished uploads and then let its
  ranks write over the newer round's files);
- the pauses themselves (``FTRAIN_FAULT_PAUSE_BEFORE_CLEAR``, ``..._BEFORE_GC``) stop a real process
  at the armed step only, once;
- paused after its commit's fence check (``after_fence``) while the newer round commits the same
  step: it does not store its manifest over the newer one (which would make that commit's record
  no longer match: the step lost).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.faults.targets import continue_process, is_stopped
from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import MANIFEST_NAME, manifest_digest, step_dir_name
from ftrain.checkpoint.storage import Storage
from ftrain.testbed.procs import kill_tree, quiet_env
from ftrain.testbed.wait import wait_for
from tests.integration.test_checkpoint_trust import FAST_RETRIES, Events, fields, load, loaded_step, state

STEP8 = step_dir_name(8)


class Pause:
    """A fault hook (``before_clear`` / ``after_fence``) that holds the writer at step ``step``
    until the test lets it go: a worker frozen at that point."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self, step: int) -> None:
        if step == self.step:
            self.reached.set()
            assert self.go.wait(120), "the test never let the paused writer go"


def manager(root: Path, fence: EtcdRoundFence, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        url=str(root), job="job-a", async_mode="off", options=FAST_RETRIES, fence=fence, on_event=Events(), **kwargs
    )


def stale_save(mgr: CheckpointManager, step: int) -> tuple[threading.Thread, list[bool]]:
    """Round 2's save of ``step``, in a thread of its own (the hook pauses it there)."""
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(mgr.save(step, state(step), fields(step, round_=2), sync=True)), daemon=True
    )
    thread.start()
    return thread, result


def committed_and_loads(root: Path, fence: EtcdRoundFence, value: float) -> None:
    """Step 8 is committed (its stored manifest is the one recorded) and loads with ``value``."""
    storage = Storage(str(root))
    recorded = fence.recorded() or {}
    assert recorded.get(8) == manifest_digest(storage.read_bytes(f"{STEP8}/{MANIFEST_NAME}"))
    states = {s.step: s.state for s in list_steps(storage, job="job-a", recorded=recorded)}
    assert states.get(8) == "committed", states
    manifest, target = load(manager(root, fence))
    assert manifest is not None and manifest.step == 8 and manifest.round == 3 and loaded_step(target) == value


@pytest.mark.parametrize("torn", [True, False], ids=["torn-directory", "empty-directory"])
def test_a_writer_paused_before_clearing_removes_nothing_once_a_newer_round_committed(tmp_path, etcd, client, torn):
    keys = JobKeys("clearjob")
    client.put(keys.round, "2")
    fence = EtcdRoundFence([etcd.endpoint], keys.round, commits_key=keys.commits)
    root = tmp_path / "ck"
    if torn:  # an earlier save of step 8 that died half way
        (root / STEP8).mkdir(parents=True)
        (root / STEP8 / "__0_0.distcp").write_bytes(b"half a shard")
    pause = Pause(8)
    zombie = manager(root, fence, before_clear=pause)
    try:
        thread, result = stale_save(zombie, 8)
        assert pause.reached.wait(120), "the stale save never reached its clearing"
        client.put(keys.round, "3")  # a newer round formed while round 2's writer was frozen

        current = manager(root, fence)
        assert current.save(8, state(80), fields(8, round_=3), sync=True), current.status.last_error
        committed_and_loads(root, fence, 80.0)

        pause.go.set()
        thread.join(120)
        assert not thread.is_alive() and result == [False]
        committed_and_loads(root, fence, 80.0)  # nothing of the newer round's step was removed or written over
        assert "round 2 is no longer current" in zombie.status.last_error, zombie.status.last_error
    finally:
        pause.go.set()


def test_a_writer_paused_after_its_commit_check_does_not_replace_a_newer_commit(tmp_path, etcd, client):
    keys = JobKeys("commitjob")
    client.put(keys.round, "2")
    fence = EtcdRoundFence([etcd.endpoint], keys.round, commits_key=keys.commits)
    root = tmp_path / "ck"
    pause = Pause(8)
    zombie = manager(root, fence, after_fence=pause)
    try:
        thread, result = stale_save(zombie, 8)
        assert pause.reached.wait(120), "the stale save never reached its commit"
        client.put(keys.round, "3")
        # the newer round finds round 2's files (no manifest: a torn save), clears them, commits
        current = manager(root, fence)
        assert current.save(8, state(80), fields(8, round_=3), sync=True), current.status.last_error
        committed_and_loads(root, fence, 80.0)

        pause.go.set()
        thread.join(120)
        assert not thread.is_alive() and result == [False]
        committed_and_loads(root, fence, 80.0)  # the newer round's manifest is still the recorded one
        assert "committed by another writer" in zombie.status.last_error, zombie.status.last_error
    finally:
        pause.go.set()


_HOOK = """
import sys
from ftrain import faults
pause = getattr(faults, sys.argv[1])
pause(4)  # not armed for step 4
print("before", flush=True)
pause(8)  # stops this process until continued
pause(8)  # once per process
print("after", flush=True)
"""


@pytest.mark.parametrize(
    ("hook", "variable"),
    [
        ("maybe_pause_before_clear", "FTRAIN_FAULT_PAUSE_BEFORE_CLEAR"),
        ("maybe_pause_before_gc", "FTRAIN_FAULT_PAUSE_BEFORE_GC"),
    ],
)
def test_a_pause_hook_is_armed_by_the_environment_and_stops_a_real_process(hook, variable):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOOK, hook],
        stdout=subprocess.PIPE,
        text=True,
        env=quiet_env(**{variable: "8:0", "RANK": "0"}),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "before\n"
        wait_for(lambda: is_stopped(proc.pid), 60, "the process to stop itself at step 8")
        continue_process(proc.pid)
        assert proc.stdout.readline() == "after\n"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            kill_tree(proc)
