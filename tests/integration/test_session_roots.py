"""A checkpoint root that a Session wrote, given to a real ``ftrain train`` run of the same job id
(issue 38, item 5): the trainer refuses the Session's newest step by name, marks nothing, trains
nothing, and the Session still loads every step it wrote. (A Session given ``ftrain train``'s
steps refuses them the same way: tests/unit/test_session_state.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ftrain
from ftrain.checkpoint.manifest import CORRUPT_NAME
from ftrain.testbed.jobs import train_job

JOB = "shared-root"


@pytest.fixture
def alone(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FTRAIN_HEARTBEAT", "FTRAIN_JOB", "FTRAIN_CONTROL"):
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_ftrain_train_refuses_a_sessions_steps_by_name_and_marks_none(tmp_path, alone):
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 4)
    with ftrain.Session(str(root), job=JOB) as session:
        for step in (2, 4):
            session.save(step, {"model": model}, sync=True)
    assert sorted(p.parent.name for p in root.glob("step-*/manifest.json")) == ["step-000000002", "step-000000004"]

    run = train_job(
        tmp_path / "train",
        1,
        "--train.steps=8",
        f"--checkpoint.uri={root}",
        "--checkpoint.async_mode=off",
        save_final=False,
        check=False,
        env={"FTRAIN_JOB": JOB},
    )
    assert run.returncode != 0, run.output[-3000:]
    assert (
        "step 4 under" in run.output and "was written by a Session (writer=session), not by ftrain train" in run.output
    )
    assert "give this job its own checkpoint root (checkpoint.uri)" in run.output, run.output[-3000:]
    assert run.metrics == [], "ftrain train trained over another loop's checkpoints"
    assert not list(root.rglob(CORRUPT_NAME)), "an intact step of another kind of loop was marked corrupt"

    with ftrain.Session(str(root), job=JOB) as session:
        assert session.load({"model": torch.nn.Linear(4, 4)}) == 4
