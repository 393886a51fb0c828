"""One checkpoint stager serves every save of a job, whatever the torch release does with it.

torch 2.13's ``DefaultStager`` keeps its copier (and buffers) for the next copy; torch 2.11's
closes its copier after every copy, so a stager kept for a second save failed it with
``KeyError: <class 'type'>`` (every save after a process's first, seen on the H200 with torch
2.11). These CPU tests make this torch behave as 2.11 does where needed.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from ftrain.checkpoint.staging import new_stager, stager_reusable


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(4.0) + step}, "optim": {"param_groups": [{"lr": 0.1}]}, "step": step}


@pytest.fixture
def closes_after_each_copy(monkeypatch):
    """This torch's DefaultStager made to close its copier after every copy, as torch 2.11's does."""
    copy = DefaultStager._stage

    def copy_then_close(self, state_dict, **kwargs):
        staged = copy(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", copy_then_close)
    stager_reusable.cache_clear()
    yield
    stager_reusable.cache_clear()


@pytest.mark.parametrize("torch_like", ["this torch", "torch 2.11"])
def test_a_kept_stager_stages_every_save_and_outlives_dcps_close(torch_like, request):
    if torch_like == "torch 2.11":
        request.getfixturevalue("closes_after_each_copy")
        assert not stager_reusable()
    stager = new_stager("cpu", asynchronous=False)
    try:
        for step in range(3):
            state = _state(step)
            staged = stager.stage(state)
            stager.close()  # DCP's call once an upload is done (torch 2.11 makes it): not the end
            assert torch.equal(staged["model"]["w"], torch.arange(4.0) + step), step
            assert staged["optim"] == state["optim"] and staged["step"] == step
            assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # a copy, not a view
    finally:
        stager.release()


def test_where_torch_keeps_the_copier_the_next_copy_goes_into_the_same_buffers():
    stager_reusable.cache_clear()
    if not stager_reusable():
        pytest.skip("this torch closes its stager's copier after each copy")
    stager = new_stager("cpu", asynchronous=False)
    try:
        state = _state(0)
        first = stager.stage(state)["model"]["w"].data_ptr()
        state["model"]["w"].add_(1.0)
        second = stager.stage(state)["model"]["w"]
        assert second.data_ptr() == first and torch.equal(second, torch.arange(4.0) + 1.0)
    finally:
        stager.release()
