"""Where a step's time goes (ftrain.observability.step_phases): phases add up to the interval, backward's wait
after its last gradient is communication, and the heartbeat carries the breakdown checked."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ftrain.contract.heartbeat import STEP_PHASES, Message
from ftrain.observability.step_phases import StepPhases


def test_phases_add_up_to_the_interval_and_backward_after_its_last_gradient_is_waiting():
    model = torch.nn.Linear(8, 8)
    phases = StepPhases(model)
    with phases.phase("data"):
        x = torch.randn(4, 8)
    with phases.phase("forward"):
        loss = model(x).sum()
    with phases.backward():
        loss.backward()
        time.sleep(0.05)  # after the last gradient: what a rank waiting for the all-reduce looks like
    busy = phases.busy_s()
    assert busy >= sum(phases.so_far(p) for p in ("data", "forward", "backward")) and busy < 0.05 + 1.0
    began = time.perf_counter()
    took = phases.take()
    assert list(took) == list(STEP_PHASES)
    assert took["comm_wait"] >= 0.05 and took["backward"] < 0.05, took
    assert sum(took.values()) <= time.perf_counter() - began + 1.0  # the interval since construction
    assert all(v == 0.0 for k, v in phases.take().items() if k != "other"), "take() starts a new interval"


def test_without_gradient_hooks_firing_backward_keeps_its_time():
    model = torch.nn.Linear(8, 8)
    phases = StepPhases(model)
    with phases.backward():
        time.sleep(0.02)  # no gradient accumulated in this window (FSDP assigns its sharded ones)
    took = phases.take()
    assert took["backward"] >= 0.02 and took["comm_wait"] == 0.0


def _beat(**fields) -> bytes:
    return json.dumps({"kind": "beat", "round": 1, "rank": 0, "local_rank": 0, "pid": 10, **fields}).encode()


def test_a_beat_carries_the_breakdown_and_a_wrong_one_is_refused():
    assert Message.decode(_beat(phases_s={"forward": 0.1, "comm_wait": 0.2})).phases_s == {
        "forward": 0.1,
        "comm_wait": 0.2,
    }
    for bad in ({"sleep": 1.0}, {"forward": -1}, {"forward": "1"}, [0.1]):
        with pytest.raises(ValueError, match="phases_s|forward"):
            Message.decode(_beat(phases_s=bad))
