"""A live worker's held state follows it to this round's device (its local rank's GPU can change
between rounds); the meta device stands in for a second GPU on this CPU-only machine."""

from __future__ import annotations

import torch

from ftrain.recovery.peer_state import HeldState, held_on


def _held() -> HeldState:
    model = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    optim = {"state": {"w": {"exp_avg": torch.ones(2, 2), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    return HeldState(step=3, committed_step=2, model=model, optim=optim, cursor={"step": 3})


def test_held_tensors_move_to_the_rounds_device_and_nothing_else_changes():
    held = _held()
    moved = held_on(held, torch.device("meta"))
    assert moved is not None and moved.model is not None and moved.optim is not None
    assert all(t.device.type == "meta" for t in moved.model.values())
    assert moved.optim["state"]["w"]["exp_avg"].device.type == "meta"
    assert moved.optim["param_groups"] == [{"lr": 0.1}]
    assert (moved.step, moved.committed_step, moved.cursor) == (3, 2, {"step": 3})
    assert held.model is not None and held.model["w"].device.type == "cpu"  # the original is left alone


def test_state_already_there_is_kept_and_no_state_is_no_state():
    held = _held()
    same = held_on(held, torch.device("cpu"))
    assert same is not None and same.model is not None and held.model is not None
    assert same.model["w"] is held.model["w"]
    assert held_on(None, torch.device("meta")) is None
    bare = HeldState(step=3, committed_step=2)  # a sharded strategy's: the step only
    assert held_on(bare, torch.device("meta")) is bare
