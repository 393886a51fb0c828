"""ftrain.parallel.pipeline_schedule: torch's action orders, the in-flight peak, the bubble, the micro-batch rule."""

from __future__ import annotations

import itertools

import pytest

from ftrain.contract.config import ConfigError
from ftrain.parallel.pipeline_schedule import (
    actions,
    bubble_fraction,
    check_micro_batches,
    peak_in_flight,
    simulate,
    timeline,
)


def _f(micro: int, stage: int) -> tuple[str, int, int]:
    return ("F", micro, stage)


def _b(micro: int, stage: int) -> tuple[str, int, int]:
    return ("B", micro, stage)


# ---------------------------------------------------------------------------------------------
# Orders, by hand.


def test_1f1b_two_ranks_four_micro_batches():
    rank0, rank1 = actions("1f1b", 2, 4, 1)
    # Rank 0 warms up with pp - 0 = 2 forwards, then backward-forward pairs, then drains.
    assert rank0 == [_f(0, 0), _f(1, 0), _b(0, 0), _f(2, 0), _b(1, 0), _f(3, 0), _b(2, 0), _b(3, 0)]
    # The last rank runs each micro-batch's backward right after its forward.
    assert rank1 == [_f(0, 1), _b(0, 1), _f(1, 1), _b(1, 1), _f(2, 1), _b(2, 1), _f(3, 1), _b(3, 1)]


def test_gpipe_runs_every_forward_then_every_backward():
    assert actions("gpipe", 2, 3, 1)[1] == [_f(0, 1), _f(1, 1), _f(2, 1), _b(0, 1), _b(1, 1), _b(2, 1)]


def test_interleaved_two_ranks_two_chunks_four_micro_batches():
    # Rank r runs stages r and r + 2; rounds of pp = 2 micro-batches; warm-up (v-1)*2 + 2*(pp-1-r).
    rank0, rank1 = actions("interleaved_1f1b", 2, 4, 2)
    assert rank0 == [
        *(_f(0, 0), _f(1, 0), _f(0, 2), _f(1, 2)),  # warm-up: 4 forwards
        *(_f(2, 0), _b(0, 2), _f(3, 0), _b(1, 2), _f(2, 2), _b(0, 0), _f(3, 2), _b(1, 0)),  # F then B
        *(_b(2, 2), _b(3, 2), _b(2, 0), _b(3, 0)),  # cool-down
    ]
    assert rank1 == [
        *(_f(0, 1), _f(1, 1)),
        *(_f(0, 3), _b(0, 3), _f(1, 3), _b(1, 3), _f(2, 1), _b(0, 1), _f(3, 1), _b(1, 1)),
        *(_f(2, 3), _b(2, 3), _f(3, 3), _b(3, 3)),
        *(_b(2, 1), _b(3, 1)),
    ]


# ---------------------------------------------------------------------------------------------
# Orders, against torch's own code (the runtime runs torch's schedules).


class _RecordingStage:
    """What Schedule1F1B/ScheduleGPipe._step_microbatches call on their stage, recording the compute."""

    def __init__(self, index: int, num_stages: int):
        self.stage_index, self.num_stages, self.is_last = index, num_stages, index == num_stages - 1
        self.log: list[tuple[str, int, int]] = []

    def __getattr__(self, name):  # get_fwd_recv_ops and friends: no P2P
        if name.startswith("get_"):
            return lambda *args, **kwargs: []
        raise AttributeError(name)

    def forward_one_chunk(self, micro, *args, **kwargs):
        self.log.append(_f(micro, self.stage_index))

    def backward_one_chunk(self, micro, **kwargs):
        self.log.append(_b(micro, self.stage_index))

    def perform_reduce_grad(self, *args):
        pass


def _torch_single_stage_order(cls, pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    out = []
    for rank in range(pp):
        schedule = object.__new__(cls)  # no process group: only the schedule's loop runs
        schedule._stage = _RecordingStage(rank, pp)
        schedule._num_stages, schedule._n_microbatches, schedule.scale_grads = pp, m, False
        schedule._check_inputs = lambda *args: ([()] * m, [{}] * m)
        schedule._initialize_stage = lambda *args, **kwargs: None
        schedule._maybe_compute_loss = lambda *args, **kwargs: None
        schedule._maybe_get_loss = lambda *args, **kwargs: None
        schedule._update_losses = lambda *args, **kwargs: None
        schedule._step_microbatches()
        out.append(schedule._stage.log)
    return out


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 2), (2, 5), (3, 7), (4, 4), (4, 9), (8, 16)])
def test_single_stage_orders_are_torchs(name, pp, m):
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    assert actions(name, pp, m, 1) == _torch_single_stage_order(cls, pp, m)


INTERLEAVED = [(2, 4, 2), (2, 3, 3), (2, 6, 3), (4, 8, 2), (4, 3, 2), (4, 10, 2), (3, 6, 4), (8, 16, 2)]


@pytest.mark.parametrize("pp,m,v", INTERLEAVED)
def test_interleaved_order_is_torchs(pp, m, v):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    theirs = [
        [
            ("F" if a.computation_type == _ComputationType.FORWARD else "B", a.microbatch_index, a.stage_index)
            for a in schedule._calculate_single_rank_operations(rank)
            if a is not None
        ]
        for rank in range(pp)
    ]
    assert actions("interleaved_1f1b", pp, m, v) == theirs


# ---------------------------------------------------------------------------------------------
# Every action once, on its rank, in an order that can run.

CASES = (
    [("gpipe", pp, m, 1) for pp, m in itertools.product((1, 2, 3, 4), (1, 2, 5, 8))]
    + [("1f1b", pp, m, 1) for pp, m in [(1, 1), (2, 2), (2, 7), (3, 3), (4, 8), (4, 13)]]
    + [
        ("interleaved_1f1b", pp, m, v)
        for pp, m, v in [(2, 1, 2), (2, 4, 2), (2, 6, 3), (4, 3, 2), (4, 8, 2), (4, 12, 4)]
    ]
)


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_every_action_once_on_its_rank_and_dependencies_hold(schedule, pp, m, v):
    order = actions(schedule, pp, m, v)
    stages = pp * v
    for rank, mine in enumerate(order):
        expected = {(k, i, s) for k in "FB" for i in range(m) for s in range(rank, stages, pp)}
        assert len(mine) == len(set(mine)) == len(expected) and set(mine) == expected
        for i, s in itertools.product(range(m), range(rank, stages, pp)):
            assert mine.index(_f(i, s)) < mine.index(_b(i, s))  # a stage's backward after its forward
    spans = timeline(order)
    for (kind, i, s), (start, _) in spans.items():
        if kind == "F":
            deps = [_f(i, s - 1)] if s > 0 else []
        else:
            deps = [_f(i, s)] + ([_b(i, s + 1)] if s < stages - 1 else [])
        assert all(spans[d][1] <= start for d in deps)


def test_an_order_that_cannot_run_is_refused():
    # The last rank waits for a backward whose forward it has queued behind it.
    order = [[_f(0, 0), _b(0, 0)], [_b(0, 1), _f(0, 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        timeline(order)


# ---------------------------------------------------------------------------------------------
# Memory: activations in flight.


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 9), (8, 8), (3, 20)])
def test_1f1b_holds_pp_minus_rank_micro_batches_and_gpipe_all(pp, m):
    assert [peak_in_flight("1f1b", pp, m, 1, r) for r in range(pp)] == [min(m, pp - r) for r in range(pp)]
    assert [peak_in_flight("gpipe", pp, m, 1, r) for r in range(pp)] == [m] * pp


def test_interleaved_peak_counts_and_block_weights():
    # Rank 0 of pp=2, v=2, m=4 (order above): 4 warm-up forwards, then a forward before each backward.
    assert peak_in_flight("interleaved_1f1b", 2, 4, 2, 0) == 5
    assert peak_in_flight("interleaved_1f1b", 2, 4, 2, 1) == 3
    # Stage 0 three blocks, the others one: F0@0 F1@0 F0@2 F1@2 F2@0 -> 3+3+1+1+3 = 11, B0@2 -> 10,
    # F3@0 -> 13, B1@2 -> 12, F2@2 -> 13, then only less.
    assert peak_in_flight("interleaved_1f1b", 2, 4, 2, 0, blocks_per_stage=[3, 1, 1, 1]) == 13
    assert peak_in_flight("1f1b", 2, 4, 1, 0, blocks_per_stage=[5, 2]) == 10


def test_peak_in_flight_checks_its_arguments():
    with pytest.raises(ValueError, match="entries for 4 stages"):
        peak_in_flight("interleaved_1f1b", 2, 4, 2, 0, blocks_per_stage=[1, 1])
    with pytest.raises(ValueError, match="pp_rank 2"):
        peak_in_flight("1f1b", 2, 4, 1, 2)


# ---------------------------------------------------------------------------------------------
# The bubble.


def test_bubble_by_hand():
    # gpipe, 2 ranks, 2 micro-batches, F = 1 s, B = 2 s: rank 0 busy 6 s of (2 + 2 - 1) x 3 = 9 s.
    assert simulate("gpipe", 2, 2, 1) == pytest.approx(1 / 3)
    assert bubble_fraction("gpipe", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (2, 8), (3, 5), (4, 4), (4, 16), (8, 8)])
@pytest.mark.parametrize("forward_s,backward_s", [(1.0, 2.0), (1.0, 1.0), (1.0, 3.5)])
def test_simulated_bubble_is_the_textbook_one_for_gpipe_and_1f1b(schedule, pp, m, forward_s, backward_s):
    assert simulate(schedule, pp, m, 1, forward_s, backward_s) == pytest.approx(bubble_fraction(schedule, pp, m, 1))


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (2, 3, 2), (4, 4, 2), (4, 5, 2), (4, 8, 3), (8, 16, 2)])
def test_interleaved_bubble_is_the_textbook_one_from_pp_micro_batches(pp, m, v):
    for forward_s, backward_s in [(1.0, 2.0), (1.0, 1.0)]:
        assert simulate("interleaved_1f1b", pp, m, v, forward_s, backward_s) == pytest.approx(
            bubble_fraction("interleaved_1f1b", pp, m, v)
        )
    assert bubble_fraction("interleaved_1f1b", pp, m, v) < bubble_fraction("1f1b", pp, m, 1)


@pytest.mark.parametrize("pp,m,v", [(4, 2, 2), (4, 3, 2), (8, 4, 3)])
def test_interleaved_bubble_exceeds_the_textbook_one_below_pp_micro_batches(pp, m, v):
    assert simulate("interleaved_1f1b", pp, m, v) > bubble_fraction("interleaved_1f1b", pp, m, v) + 0.05


# ---------------------------------------------------------------------------------------------
# What torch refuses.


def test_1f1b_needs_pp_micro_batches():
    with pytest.raises(ConfigError) as e:
        check_micro_batches("1f1b", 4, 3, 1)
    assert e.value.key == "train.micro_batch_size"
    assert "parallel.pp_size=4" in str(e.value) and "got 3 micro-batch" in str(e.value)
    assert "lower train.micro_batch_size or raise train.global_batch_size" in str(e.value)
    with pytest.raises(ConfigError):
        actions("1f1b", 4, 3, 1)  # what the orders are built from refuses too
    check_micro_batches("1f1b", 4, 4, 1)
    check_micro_batches("gpipe", 4, 1, 1)  # gpipe takes any count


def test_interleaved_needs_a_multiple_of_its_rounds():
    with pytest.raises(ConfigError) as e:
        check_micro_batches("interleaved_1f1b", 4, 9, 2)  # 2 rounds of 4
    assert e.value.key == "train.micro_batch_size"
    assert "2 rounds" in str(e.value) and "make it 8 or 10" in str(e.value)
    with pytest.raises(ConfigError, match="make it 4 or 6"):
        check_micro_batches("interleaved_1f1b", 2, 5, 2)
    for m in (1, 3, 4, 6, 7, 8, 10, 12):  # one round below 2 x pp; torch runs pp=4 with 3 (its docstring)
        check_micro_batches("interleaved_1f1b", 4, m, 2)


def test_unknown_schedule_and_bad_shapes():
    with pytest.raises(ConfigError) as e:
        actions("zb", 2, 4, 1)
    assert e.value.key == "parallel.pp_schedule"
    with pytest.raises(ValueError, match="one stage per rank"):
        actions("1f1b", 2, 4, 2)
