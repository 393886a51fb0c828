"""A session's saves go through the agent's commit fence in etcd: a session of a round that is no
longer current commits nothing and writes no shard; one of the current round commits, recording
its round in the manifest."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import ftrain
from ftrain.agents.job_keys import JobKeys


@pytest.fixture
def fenced(monkeypatch, etcd, client):
    keys = JobKeys("fenced-session")
    client.put(keys.round, "2")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FTRAIN_HEARTBEAT", "FTRAIN_CONTROL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("FTRAIN_ETCD", etcd.endpoint)
    monkeypatch.setenv("FTRAIN_FENCE_KEY", keys.round)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("round_,commits", [("1", False), ("2", True)])
def test_a_stale_rounds_save_is_refused_and_the_current_rounds_commits(tmp_path, fenced, round_, commits):
    fenced.setenv("FTRAIN_ROUND", round_)
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters())}
    with ftrain.Session(str(tmp_path / "ckpt"), job="fenced-session") as session:
        assert session.round == int(round_)
        session.save(5, state, sync=True)
        status = session.wait()
    manifests = list((tmp_path / "ckpt").glob("*/manifest.json"))
    if commits:
        assert status.last_committed_step == 5
        assert [json.loads(m.read_text())["round"] for m in manifests] == [2]
    else:
        assert status.last_committed_step == -1 and "StaleRoundError" in status.last_error, status
        assert not manifests and not list((tmp_path / "ckpt").rglob("*.distcp")), "a stale round wrote a step"
