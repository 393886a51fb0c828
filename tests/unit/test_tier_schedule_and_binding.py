"""The memory tier's pure decisions: when every rank snapshots (ftrain.recovery.tier_schedule), and whether a
snapshot found in checkpoint.memory_dir is this run's (ftrain.recovery.tier_binding)."""

from __future__ import annotations

import math

import pytest

from ftrain.checkpoint.errors import CheckpointError
from ftrain.checkpoint.manifest import FileEntry, Manifest
from ftrain.recovery.tier_binding import (
    Binding,
    agree_run_id,
    binding_of,
    binding_problem,
    config_differences,
    resolve_run_id,
)
from ftrain.recovery.tier_schedule import Figures, base_interval, is_due, next_interval, put_off


# -- the schedule -------------------------------------------------------------------------------
def _schedule(setting: int, start_interval: int, figures: list[Figures | None], steps: int) -> list[int]:
    """The steps a rank snapshots at in a round, given what each snapshot's agreement gave."""
    interval, next_step, taken = start_interval, 0, []
    measured = iter(figures)
    for step in range(1, steps + 1):
        if is_due(step, next_step, checkpointed=False):
            interval = next_interval(setting, interval, next(measured, None) if taken else None)
            next_step = step + interval
            taken.append(step)
    return taken


def test_a_round_starts_every_rank_on_the_same_schedule_whatever_it_measured_before():
    """A kept rank measured an interval of 5 in the round before; a spare starts fresh. Both
    start the round from base_interval: with the same agreed figures they take the same steps
    (the old code kept the 5 on one rank and 1 on the other: they parted at the second snapshot)."""
    agreed = [Figures(0.01, 0.3, 0.1), Figures(0.01, 0.3, 0.1), Figures(0.01, 0.5, 0.1)]
    kept = _schedule(-1, base_interval(-1), agreed, 20)
    spare = _schedule(-1, base_interval(-1), agreed, 20)
    assert kept == spare == [1, 2, 7, 12, 17]
    assert _schedule(-1, 5, agreed, 20) != spare  # the defect: a carried-over interval


def test_the_interval_follows_the_slowest_ranks_figures_and_stays_after_a_failure():
    assert base_interval(-1) == 1 and base_interval(4) == 4
    assert next_interval(-1, 1, Figures(blocked_s=0.01, seconds=0.2, step_time_s=0.1)) == 5  # 0.01 / (2% x 0.1)
    assert next_interval(-1, 1, Figures(blocked_s=0.0, seconds=0.35, step_time_s=0.1)) == 4  # completes in 3.5 steps
    assert next_interval(-1, 1, Figures(0.0, 0.0, 0.1)) == 1
    assert next_interval(-1, 7, None) == 7  # a snapshot failed on some rank: nothing agreed, nothing changes
    assert next_interval(4, 4, Figures(1.0, 9.0, 0.1)) == 4  # a fixed setting is not adapted
    for broken in (Figures(math.nan, 0.1, 0.1), Figures(0.1, math.inf, 0.1), Figures(0.1, 0.1, 0.0)):
        assert next_interval(-1, 3, broken) == 3
    assert next_interval(-1, 1, Figures(1e9, 0.0, 1e-9)) == 1_000_000


def test_a_checkpointed_step_is_always_due():
    assert is_due(3, 10, checkpointed=True) and not is_due(3, 10, checkpointed=False) and is_due(10, 10, False)


def test_a_put_off_snapshot_is_due_at_the_next_step_boundary_even_when_only_its_checkpoint_made_it_due():
    """Step 40 was checkpointed while the snapshot before was still exchanging: the snapshot is
    put off, and step 41 must take it (the schedule alone would wait for step 50, and a fault in
    between would find the tier older than storage: the CI failure of the fsdp live-recovery test)."""
    next_step = put_off(40, 50)
    assert next_step == 41 and is_due(41, next_step, checkpointed=False)
    assert put_off(12, 12) == 12  # due by the schedule already: stays due


# -- the binding --------------------------------------------------------------------------------
CONFIG = {"train": {"seed": 3, "steps": 40}, "checkpoint": {"uri": "s3://b/j"}, "agent": {"job": "j"}}


def _manifest(**kw) -> Manifest:
    fields = dict(
        step=12,
        round=0,
        world_size=2,
        layout={},
        config_hash="h1",
        config=CONFIG,
        trainer={"cursor": {}},
        digest_algorithm="xxh3_128",
        files={".metadata": FileEntry(1, "0" * 32)},
        created_time=1.0,
        job="j",
        run_id="r1",
    )
    fields.update(kw)
    return Manifest(**fields)  # type: ignore[arg-type]


OURS = binding_of(CONFIG, "h1", "r1")


def test_only_a_snapshot_of_this_run_config_and_root_is_this_runs():
    assert OURS == Binding("r1", "h1", "s3://b/j", CONFIG)
    assert binding_problem(_manifest(), OURS) == ""
    assert "another run (run id 'r0', this run 'r1')" in binding_problem(_manifest(run_id="r0"), OURS)
    seeded = {**CONFIG, "train": {"seed": 4, "steps": 40}}
    assert "train.seed: 4 -> 3" in binding_problem(_manifest(config_hash="h2", config=seeded), OURS)
    moved = {**CONFIG, "checkpoint": {"uri": "s3://b/old"}}
    assert "another checkpoint root (checkpoint.uri 's3://b/old', now 's3://b/j')" in binding_problem(
        _manifest(config=moved), OURS
    )
    assert "another run" in binding_problem(_manifest(run_id=""), OURS)  # an unbound snapshot is nobody's


def test_the_differing_keys_are_named_without_the_sections_the_hash_leaves_out():
    theirs = {"train": {"seed": 4, "steps": 40, "extra": [1, 2]}, "checkpoint": {"uri": "x"}, "agent": {"job": "k"}}
    assert config_differences(theirs, CONFIG) == [
        "checkpoint.uri: 'x' -> 's3://b/j'",
        "train.extra: [1, 2] -> (unset)",
        "train.seed: 4 -> 3",
    ]
    many = {"train": {f"k{i}": i for i in range(10)}}
    assert config_differences(many, {})[-1] == "4 more"


def test_the_run_id_comes_from_the_launcher_in_order():
    assert resolve_run_id({"FTRAIN_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "t"}) == ("mine", "FTRAIN_RUN_ID")
    assert resolve_run_id({"TORCHELASTIC_RUN_ID": "5b0c"}) == ("5b0c", "TORCHELASTIC_RUN_ID")
    from_etcd = resolve_run_id({"TORCHELASTIC_RUN_ID": "t"}, lambda: "etcd-1-7")
    assert from_etcd == ("etcd-1-7", "the job's round key in etcd")
    run_id, why = resolve_run_id({"TORCHELASTIC_RUN_ID": "none"})
    assert run_id == "" and "--rdzv-id" in why
    assert resolve_run_id({})[0] == ""

    def unreachable() -> str:
        raise CheckpointError("etcd down")

    run_id, why = resolve_run_id({"TORCHELASTIC_RUN_ID": "t"}, unreachable)
    assert run_id == "" and "etcd down" in why  # under an agent, torchrun's "none" is never taken instead
    agent = {"FTRAIN_ETCD": "http://etcd.invalid:2379", "FTRAIN_FENCE_KEY": "/ftrain/jobs/j/round"}
    run_id, why = resolve_run_id({**agent, "TORCHELASTIC_RUN_ID": "t"}, ask_etcd=False)  # no request made
    assert run_id == "" and "rank 0" in why  # and not torchrun's id, which rank 0's could never match


def test_the_ranks_of_a_round_agree_on_one_run_id():
    assert agree_run_id(["a", "a", ""]) == ("a", "")  # a rank that could not ask etcd learns it
    assert agree_run_id(["", ""])[0] == ""
    run_id, why = agree_run_id(["a", "b"])
    assert run_id == "" and "different run ids" in why


@pytest.mark.parametrize("bad", ["x" * 201, "a\nb", " a"])
def test_an_unusable_run_id_variable_stops_the_worker_naming_it(bad):
    from ftrain.contract.worker_env import WorkerEnv, WorkerEnvError

    with pytest.raises(WorkerEnvError, match="FTRAIN_RUN_ID"):
        WorkerEnv.from_env({"FTRAIN_RUN_ID": bad})
