"""The run id a worker under ``ftrain agent`` binds its memory-tier snapshots to: the job's
incarnation in a real etcd (ftrain.agent_link.fence.EtcdRoundFence.incarnation), the same for every round
of the job and new when the job's keys are made again."""

from __future__ import annotations

import pytest

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.etcd import EtcdClient
from ftrain.checkpoint.errors import CheckpointError
from ftrain.recovery.tier_binding import resolve_run_id

KEY = "/ftrain/jobs/j/round"


def test_the_incarnation_stays_across_rounds_and_changes_when_the_job_starts_anew(etcd):
    fence = EtcdRoundFence([etcd.endpoint], KEY, timeout_s=2.0)
    with EtcdClient([etcd.endpoint], timeout_s=2.0) as client:
        with pytest.raises(CheckpointError, match="gave no cluster id and create revision"):
            fence.incarnation()  # no round yet
        client.put(KEY, "1")
        first = fence.incarnation()
        assert first.startswith("etcd-")
        client.put("/ftrain/jobs/j/status/n", "{}")
        client.put(KEY, "2")  # the next round: the key's value moves on
        assert fence.incarnation() == first
        env = {"FTRAIN_ETCD": etcd.endpoint, "FTRAIN_FENCE_KEY": KEY, "TORCHELASTIC_RUN_ID": "none"}
        assert resolve_run_id(env, fence.incarnation) == (first, "the job's round key in etcd")
        client.delete_prefix("/ftrain/jobs/j/")  # the job started anew
        client.put(KEY, "1")
        assert fence.incarnation() not in ("", first)


def test_an_unreachable_etcd_gives_no_run_id_and_says_why():
    dead = EtcdRoundFence(["http://127.0.0.1:9"], KEY, timeout_s=0.5)
    run_id, why = resolve_run_id({"TORCHELASTIC_RUN_ID": "none"}, dead.incarnation)
    assert run_id == "" and "could not be read from etcd" in why
