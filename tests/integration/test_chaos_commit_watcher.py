"""What the chaos invariants count as a commit (:class:`ftrain.chaos.runner.CommitWatcher`), with a
real etcd fence and a real checkpoint root: a step whose manifest is stored but whose commit
record is not in etcd (its writer killed between the two, or a zombie's record refused) is not a
commit — no reader trusts it, and a round that goes on from the step before it is right."""

from __future__ import annotations

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.runner import CommitWatcher
from ftrain.checkpoint.storage import Storage
from tests.integration.test_checkpoint_delete_fence import manager
from tests.integration.test_checkpoint_trust import fields, state


def test_a_stored_manifest_without_its_commit_record_is_not_counted_as_a_commit(tmp_path, etcd, client):
    keys = JobKeys("watchjob")
    client.put(keys.round, "2")
    fence = EtcdRoundFence([etcd.endpoint], keys.round, commits_key=keys.commits)
    root = tmp_path / "ck"
    writer = manager(root, fence)
    for step in (4, 8):
        assert writer.save(step, state(step), fields(step), sync=True), writer.status.last_error
    assert sorted(fence.recorded() or {}) == [4, 8]
    assert client.delete(f"{keys.commits}{8:012d}")  # as if its writer died after storing the manifest

    watcher = CommitWatcher(Storage(str(root)), fence.recorded)
    watcher.poll()
    assert sorted(step for step, _ in watcher.commits) == [4]
