"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_agent_unit import Job

#: what a launcher (torchrun, the node agent) sets: a test of a process on its own has none
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTRAIN_HEARTBEAT", "FTRAIN_JOB")
LAUNCHER_ENV += ("FTRAIN_CONTROL", "FTRAIN_ROUND", "FTRAIN_AGENT_PID", "FTRAIN_STACK_DIR", "FTRAIN_ETCD")
LAUNCHER_ENV += ("FTRAIN_FENCE_KEY",)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    """Agents on one in-memory store and fake clock (tests/unit/test_agent_unit.py's :class:`Job`)."""
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as if nothing launched it; a process group a test made is destroyed after it."""
    import torch.distributed as dist

    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
