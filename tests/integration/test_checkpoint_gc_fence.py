"""What a stale worker deletes or marks besides a save is fenced too (issue 25, item 8, "more of
the same kind"), with a real etcd fence (commit records) and a real local checkpoint root:

- a retention paused after it planned a torn step for deletion: a newer round saves and commits
  the step; the retention resumes and removes nothing of it (the round check refuses it; within
  one round, the step judged again is no longer the torn one planned);
- a retention paused before it drops the commit record of a step it found gone: a newer round
  saves and records the step again; the retention resumes and leaves that record;
- a loader paused before its verdict on a step that a newer round then clears and saves again:
  its verdict (the bytes no longer match the manifest it read) never marks the newer step
  corrupt, fenced or not (only the manifest that failed is ever marked);
- (the pause itself, ``FTRAIN_FAULT_PAUSE_BEFORE_GC``, is tested with the others in test_checkpoint_delete_fence.py)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.job_keys import JobKeys
from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, Manifest, manifest_digest, step_dir_name
from ftrain.checkpoint.storage import Storage
from ftrain.checkpointing import validate_trainer_state
from tests.integration.test_checkpoint_delete_fence import Pause, manager
from tests.integration.test_checkpoint_trust import fields, load, loaded_step, state

STEP8 = step_dir_name(8)
ROUND_AFTER = pytest.mark.parametrize("round_after", [3, 2], ids=["newer-round", "same-round"])


def step8_committed_and_loads(root: Path, fence: EtcdRoundFence | None, round_: int) -> None:
    """Step 8 is committed (with a fence: its stored manifest is the one recorded), unmarked, and
    loads the newer save's values (80)."""
    storage = Storage(str(root))
    assert not (root / STEP8 / CORRUPT_NAME).exists(), "the newer save's step was marked corrupt"
    recorded = fence.recorded() if fence is not None else None
    if recorded is not None:
        assert recorded.get(8) == manifest_digest(storage.read_bytes(f"{STEP8}/{MANIFEST_NAME}"))
    states = {s.step: s.state for s in list_steps(storage, job="job-a", recorded=recorded)}
    assert states.get(8) == "committed", states
    manifest, target = load(manager(root, fence), load_step=8)
    assert manifest is not None and manifest.round == round_ and loaded_step(target) == 80.0


def round_fence(etcd: Any, client: Any, job: str) -> tuple[JobKeys, EtcdRoundFence]:
    keys = JobKeys(job)
    client.put(keys.round, "2")
    return keys, EtcdRoundFence([etcd.endpoint], keys.round, commits_key=keys.commits)


@ROUND_AFTER
def test_a_retention_paused_after_planning_removes_nothing_of_a_step_saved_again(
    tmp_path, etcd, client, caplog, round_after
):
    keys, fence = round_fence(etcd, client, "gcjob")
    root = tmp_path / "ck"
    (root / STEP8).mkdir(parents=True)  # an earlier save of step 8 that died half way
    (root / STEP8 / "__0_0.distcp").write_bytes(b"half a shard")
    os.utime(root / STEP8 / "__0_0.distcp", (1000.0, 1000.0))  # long past the grace: garbage for any retention
    pause = Pause(8)
    zombie = manager(root, fence, before_gc=pause)
    try:
        with caplog.at_level(logging.INFO, logger="ftrain.checkpoint.retention"):
            # the commit of step 4 (round 2) starts a retention that plans the torn step 8 for deletion
            assert zombie.save(4, state(4), fields(4, round_=2), sync=True), zombie.status.last_error
            assert pause.reached.wait(120), "the retention never reached its deletion of step 8"
            client.put(keys.round, str(round_after))  # a newer round formed while round 2's retention was frozen

            current = manager(root, fence)
            assert current.save(8, state(80), fields(8, round_=round_after), sync=True), current.status.last_error
            current.wait()
            step8_committed_and_loads(root, fence, round_after)

            pause.go.set()
            zombie.wait()  # the paused retention ran to its end
        step8_committed_and_loads(root, fence, round_after)  # nothing of the newer save was removed
        said = caplog.text
        if round_after == 3:
            assert "this retention belongs to an old round and removes nothing more" in said, said
        else:
            assert f"{STEP8} left alone: it changed since it was planned for deletion" in said, said
    finally:
        pause.go.set()


@ROUND_AFTER
def test_a_retention_paused_before_dropping_a_commit_record_keeps_the_record_of_a_step_saved_again(
    tmp_path, etcd, client, round_after
):
    keys, fence = round_fence(etcd, client, "forgetjob")
    root = tmp_path / "ck"
    pause = Pause(8)
    zombie = manager(root, fence, before_gc=pause)
    try:
        assert zombie.save(8, state(8), fields(8, round_=2), sync=True), zombie.status.last_error
        zombie.wait()
        shutil.rmtree(root / STEP8)  # a retention that died after removing step 8, before dropping its record
        # the commit of step 9 starts a retention that finds step 8's record without its directory
        assert zombie.save(9, state(9), fields(9, round_=2), sync=True), zombie.status.last_error
        assert pause.reached.wait(120), "the retention never reached the record of step 8"
        client.put(keys.round, str(round_after))

        current = manager(root, fence)  # the newer round saves step 8 again (a rollback), and records it
        assert current.save(8, state(80), fields(8, round_=round_after), sync=True), current.status.last_error
        current.wait()
        step8_committed_and_loads(root, fence, round_after)

        pause.go.set()
        zombie.wait()
        step8_committed_and_loads(root, fence, round_after)  # its record is still there
    finally:
        pause.go.set()


@pytest.mark.parametrize("fenced", [True, False], ids=["etcd-fence", "no-fence"])
def test_a_loader_paused_before_its_verdict_never_marks_the_step_a_newer_round_saved_again(
    tmp_path, etcd, client, fenced
):
    keys, fence_ = round_fence(etcd, client, "markjob")
    fence = fence_ if fenced else None
    root = tmp_path / "ck"
    writer = manager(root, fence)
    for step in (4, 8):
        assert writer.save(step, state(step), fields(step, round_=2), sync=True), writer.status.last_error
    writer.wait()

    reached, go = threading.Event(), threading.Event()
    target = state(-1)

    def paused_before_fetching(manifest: Manifest) -> dict[str, Any]:
        if manifest.step == 8:  # the step is chosen, its manifest read; its files not yet
            reached.set()
            assert go.wait(120), "the test never let the paused loader go"
        return target

    stale = CheckpointManager(
        url=str(root), job="job-a", async_mode="off", fence=fence, round=2, options=writer.options
    )
    result: list[Manifest | None] = []
    loader = threading.Thread(
        target=lambda: result.append(stale.load(paused_before_fetching, validate=validate_trainer_state)), daemon=True
    )
    loader.start()
    try:
        assert reached.wait(120), "the stale loader never reached step 8"
        # meanwhile step 8 rots; the newer round's load marks it, falls back to 4, and saves 8 again
        shard = next(p for p in (root / STEP8).iterdir() if p.suffix == ".distcp")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
        if fenced:
            client.put(keys.round, "3")
        current = manager(root, fence, round=3)
        manifest, _ = load(current)
        assert manifest is not None and manifest.step == 4
        assert (root / STEP8 / CORRUPT_NAME).exists(), "the rotten step was not marked"
        assert current.save(8, state(80), fields(8, round_=3), sync=True), current.status.last_error
        current.wait()
        step8_committed_and_loads(root, fence, 3)

        go.set()
        loader.join(120)
        assert not loader.is_alive()
        # it read the newer save's files against the manifest it had read before: refused, never marked
        assert len(result) == 1 and result[0] is not None and result[0].step == 4
        step8_committed_and_loads(root, fence, 3)
    finally:
        go.set()
        loader.join(120)
