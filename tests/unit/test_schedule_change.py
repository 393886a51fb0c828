"""A changed LR schedule at resume is a decision (``train.on_schedule_change``): the pure rules of
:mod:`ftrain.optim` and the record a manifest carries (:mod:`ftrain.checkpointing`)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import FileEntry, Manifest
from ftrain.checkpointing import SCHEDULE_KEY, manifest_fields, recorded_schedule, validate_trainer_state
from ftrain.config import load_config
from ftrain.contract import events as ev
from ftrain.contract.config import ConfigError
from ftrain.data import DataCursor
from ftrain.optim import (
    KEPT,
    RESCALED,
    SAME,
    UNRECORDED,
    Schedule,
    ScheduleChange,
    ScheduleChangeError,
    decide_schedule,
    lr_at,
    peak_lr,
)

SAVED = Schedule(total_steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1, lr_scaling="none", base_world_size=1)


def test_the_configured_schedule_gives_the_learning_rates_it_always_gave():
    cfg = load_config(None, ["--train.steps=50", "--optim.lr=2e-3", "--optim.lr_scaling=linear"])
    schedule = Schedule.of(cfg)
    assert (schedule.total_steps, schedule.lr, schedule.warmup_steps) == (50, 2e-3, cfg.optim.warmup_steps)
    for step in (0, 5, 10, 30, 49, 80):
        assert schedule.lr_at(step, 4) == lr_at(
            step,
            peak=peak_lr(cfg.optim, 4),
            warmup_steps=cfg.optim.warmup_steps,
            total_steps=50,
            min_lr_ratio=cfg.optim.min_lr_ratio,
        )


def test_it_round_trips_through_manifest_json():
    assert Schedule.from_dict(json.loads(json.dumps(SAVED.to_dict()))) == SAVED


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ([1, 2], "not an object"),
        ({**SAVED.to_dict(), "extra": 1}, "exactly the fields"),
        ({k: v for k, v in SAVED.to_dict().items() if k != "lr"}, "exactly the fields"),
        ({**SAVED.to_dict(), "total_steps": True}, "total_steps must be an int"),
        ({**SAVED.to_dict(), "warmup_steps": -1}, "warmup_steps must be an int >= 0"),
        ({**SAVED.to_dict(), "lr": "0.1"}, "lr must be a finite number"),
        ({**SAVED.to_dict(), "lr": 0.0}, "lr must be > 0"),
        ({**SAVED.to_dict(), "min_lr_ratio": 1.5}, "min_lr_ratio must be in [0, 1]"),
        ({**SAVED.to_dict(), "lr_scaling": "cubic"}, "lr_scaling must be one of"),
        ({**SAVED.to_dict(), "base_world_size": 0}, "base_world_size must be an int >= 1"),
    ],
)
def test_a_malformed_record_is_named(raw, words):
    with pytest.raises(ValueError, match="schedule|must") as info:
        Schedule.from_dict(raw)
    assert words in str(info.value)


def test_changes_name_each_config_key_old_to_new():
    new = dataclasses.replace(SAVED, total_steps=200, lr=2e-3)
    assert SAVED.changes_to(new) == [
        ScheduleChange("train.steps", 100, 200),
        ScheduleChange("optim.lr", 1e-3, 2e-3),
    ]
    assert str(ScheduleChange("train.steps", 100, 200)) == "train.steps 100 -> 200"


def test_base_world_size_is_a_change_only_where_it_scales_the_peak():
    assert SAVED.changes_to(dataclasses.replace(SAVED, base_world_size=8)) == []
    linear = dataclasses.replace(SAVED, lr_scaling="linear")
    assert [c.key for c in linear.changes_to(dataclasses.replace(linear, base_world_size=8))] == [
        "optim.base_world_size"
    ]
    assert [c.key for c in SAVED.changes_to(linear)] == ["optim.lr_scaling"]


def test_a_new_world_size_is_not_a_new_schedule():
    """The data-parallel size is an argument, not part of the schedule: elastic resizes go on."""
    linear = dataclasses.replace(SAVED, lr_scaling="linear", base_world_size=2)
    assert linear.peak(8) == 4 * linear.peak(2)
    assert decide_schedule(linear, dataclasses.replace(linear), "fail", step=40).outcome == SAME


@pytest.mark.parametrize("policy", ["fail", "keep", "rescale"])
def test_an_unchanged_schedule_goes_on_under_any_policy(policy):
    decision = decide_schedule(SAVED, dataclasses.replace(SAVED), policy, step=40)
    assert decision.outcome == SAME and decision.schedule == SAVED and decision.changes == ()


@pytest.mark.parametrize("policy", ["fail", "keep", "rescale"])
def test_a_checkpoint_without_a_record_is_taken_as_configured(policy):
    configured = dataclasses.replace(SAVED, total_steps=300)
    decision = decide_schedule(None, configured, policy, step=40)
    assert decision.outcome == UNRECORDED and decision.schedule == configured


def test_fail_refuses_naming_each_change_and_the_options():
    configured = dataclasses.replace(SAVED, total_steps=200, warmup_steps=20, min_lr_ratio=0.0)
    with pytest.raises(ScheduleChangeError) as info:
        decide_schedule(SAVED, configured, "fail", step=40)
    e = info.value
    assert isinstance(e, ConfigError) and e.key == "train.on_schedule_change"
    assert e.fatal is True  # the node agent ends the job instead of restarting into the same refusal
    message = str(e)
    for words in (
        "checkpoint step 40",
        "train.steps 100 -> 200",
        "optim.warmup_steps 10 -> 20",
        "optim.min_lr_ratio 0.1 -> 0.0",
        "--train.on_schedule_change=keep",
        "--train.on_schedule_change=rescale",
    ):
        assert words in message, message
    assert "optim.lr " not in message
    assert [c.key for c in e.changes] == ["train.steps", "optim.warmup_steps", "optim.min_lr_ratio"]


def test_keep_goes_on_with_the_saved_schedule_and_its_floor_past_its_end():
    configured = dataclasses.replace(SAVED, total_steps=200, lr=5e-3)
    decision = decide_schedule(SAVED, configured, "keep", step=40)
    assert decision.outcome == KEPT and decision.schedule == SAVED
    assert [str(c) for c in decision.changes] == ["train.steps 100 -> 200", "optim.lr 0.001 -> 0.005"]
    floor = SAVED.lr * SAVED.min_lr_ratio
    assert decision.schedule.lr_at(40, 1) == SAVED.lr_at(40, 1)
    assert decision.schedule.lr_at(99, 1) > floor  # its last step (0-based)
    assert all(decision.schedule.lr_at(s, 1) == pytest.approx(floor) for s in (100, 150, 199))


def test_rescale_applies_the_configured_schedule_from_the_resumed_step():
    configured = dataclasses.replace(SAVED, total_steps=200)
    decision = decide_schedule(SAVED, configured, "rescale", step=40)
    assert decision.outcome == RESCALED and decision.schedule == configured
    assert decision.schedule.lr_at(100, 1) > SAVED.lr_at(100, 1)  # the new cosine is still above its floor


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="train.on_schedule_change"):
        decide_schedule(SAVED, SAVED, "ignore", step=1)


def test_the_config_key_offers_exactly_the_policies():
    assert load_config(None, []).train.on_schedule_change == "fail"
    with pytest.raises(ConfigError, match="train.on_schedule_change"):
        load_config(None, ["--train.on_schedule_change=ignore"])


# -- the record in the manifest ---------------------------------------------------------------


def _manifest(trainer: dict) -> Manifest:
    return Manifest(
        step=8,
        round=0,
        world_size=1,
        layout={"strategy": "ddp"},
        config_hash="h",
        config={},
        trainer=trainer,
        digest_algorithm="xxh3_128",
        files={".metadata": FileEntry(3, digest_bytes(b"abc", "xxh3_128"))},
        created_time=1.0,
    )


def _cursor_at(step: int) -> DataCursor:
    cursor = DataCursor(64, 8, 0)
    for _ in range(step):
        cursor.next_global_batch()
    return cursor


def test_each_save_records_the_schedule_in_force_and_it_reads_back():
    cfg = load_config(None, ["--train.steps=16"])
    par = SimpleNamespace(layout=SimpleNamespace(world_size=1, describe=lambda: {"strategy": "ddp"}))
    fields = manifest_fields(cfg, par, _cursor_at(8), 0)  # type: ignore[arg-type]
    assert fields["trainer"][SCHEDULE_KEY] == Schedule.of(cfg).to_dict()
    kept = manifest_fields(cfg, par, _cursor_at(8), 0, schedule=SAVED)  # type: ignore[arg-type]
    manifest = Manifest.from_json(_manifest(kept["trainer"]).to_json())
    validate_trainer_state(manifest)
    assert recorded_schedule(manifest) == SAVED


def test_an_older_checkpoint_without_the_record_still_loads():
    manifest = _manifest({"cursor": _cursor_at(8).state_dict()})
    validate_trainer_state(manifest)
    assert recorded_schedule(manifest) is None


def test_a_malformed_record_makes_the_step_corrupt():
    manifest = _manifest({"cursor": _cursor_at(8).state_dict(), SCHEDULE_KEY: {"total_steps": "many"}})
    with pytest.raises(ManifestError, match="trainer.schedule"):
        validate_trainer_state(manifest)


def test_the_resumed_event_carries_the_decision_and_reads_back_from_older_lines(tmp_path):
    log = ev.EventLog(str(tmp_path / "events.jsonl"))
    record = ev.Resumed(
        step=8,
        from_world_size=1,
        world_size=1,
        round=0,
        schedule=SAVED.to_dict(),
        schedule_outcome=KEPT,
        schedule_changes=["train.steps 100 -> 200"],
    )
    log.emit(record)
    log.close()
    (line,) = ev.read_events(tmp_path / "events.jsonl")
    assert ev.parse(line) == record
    old = ev.parse({"event": "resumed", "step": 8, "from_world_size": 1, "world_size": 1, "round": 0})
    assert isinstance(old, ev.Resumed) and old.schedule == {} and old.schedule_outcome == ""


def test_the_refusal_reaches_the_node_agent_as_fatal():
    """The worker's exit message says a restart cannot help: the agent ends the job with it."""
    from ftrain.train import say_goodbye

    said: dict = {}

    class Heartbeat:
        def exit(self, step: int, **kw) -> None:
            said.update(kw, step=step)

    error = ScheduleChangeError(8, [ScheduleChange("train.steps", 8, 16)])
    say_goodbye(Heartbeat(), None, error)  # type: ignore[arg-type]
    assert said["fatal"] is True and said["finished"] is False
    assert "ScheduleChangeError: train.on_schedule_change: checkpoint step 8" in said["error"]
    assert "train.steps 8 -> 16" in said["error"]
