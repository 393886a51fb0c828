"""DataCursor: resume at any world size consumes exactly the remaining samples, in order."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.config import ConfigError
from ftrain.data import DataCursor, DataError, GlobalBatch, accumulation_steps, micro_batches, micro_steps
from ftrain.data.cursor import epoch_permutation


def _step_at_world_size(cursor: DataCursor, micro: int, world: int) -> tuple[GlobalBatch, np.ndarray]:
    """One step: the union over ranks of their micro-batches, in rank then micro-batch order."""
    batch = cursor.next_global_batch()
    parts = []
    seen_indices = []
    for rank in range(world):
        for mb in micro_batches(batch, rank, world, micro):
            seen_indices.append(mb.index)
            parts.append(mb.sample_ids)
    assert seen_indices == list(range(batch.sample_ids.size // micro))
    return batch, np.concatenate(parts)


@st.composite
def _runs(draw: st.DrawFn) -> dict[str, int]:
    micro = draw(st.integers(1, 4))
    world1 = draw(st.integers(1, 4))
    world2 = draw(st.integers(1, 4))
    batch = micro * math.lcm(world1, world2) * draw(st.integers(1, 3))
    num_samples = draw(st.integers(batch, 4 * batch + 7))
    steps = draw(st.integers(1, 30))
    stop = draw(st.integers(0, steps))
    seed = draw(st.integers(0, 2**32))
    return dict(
        micro=micro,
        world1=world1,
        world2=world2,
        batch=batch,
        num_samples=num_samples,
        steps=steps,
        stop=stop,
        seed=seed,
    )


@settings(max_examples=150, deadline=None)
@given(_runs())
def test_resume_at_another_world_size_consumes_exactly_the_remaining_samples(run: dict[str, int]) -> None:
    n, B, b, seed = run["num_samples"], run["batch"], run["micro"], run["seed"]

    golden = DataCursor(n, B, seed)
    golden_steps = [_step_at_world_size(golden, b, run["world1"]) for _ in range(run["steps"])]

    first = DataCursor(n, B, seed)
    resumed_steps = [_step_at_world_size(first, b, run["world1"]) for _ in range(run["stop"])]
    state = json.loads(json.dumps(first.state_dict()))
    second = DataCursor(n, B, seed)
    second.load_state_dict(state)
    resumed_steps += [_step_at_world_size(second, b, run["world2"]) for _ in range(run["steps"] - run["stop"])]

    for step, ((g_batch, g_ids), (r_batch, r_ids)) in enumerate(zip(golden_steps, resumed_steps, strict=True)):
        assert (g_batch.step, r_batch.step) == (step, step)
        assert (g_batch.epoch, g_batch.start) == (r_batch.epoch, r_batch.start)
        np.testing.assert_array_equal(g_ids, g_batch.sample_ids)  # ranks cover the batch in order
        np.testing.assert_array_equal(r_ids, g_ids)  # the resumed run matches, in global order

    # Within each epoch: consecutive positions of that epoch's permutation, nothing skipped or
    # repeated; a new epoch starts only when the remaining tail is shorter than B.
    prev = None
    for batch, ids in golden_steps:
        perm = epoch_permutation(n, seed, batch.epoch)
        np.testing.assert_array_equal(ids, perm[batch.start : batch.start + B])
        if prev is None:
            assert (batch.epoch, batch.start) == (0, 0)
        elif batch.epoch == prev.epoch:
            assert batch.start == prev.start + B
        else:
            assert batch.epoch == prev.epoch + 1 and batch.start == 0
            assert prev.start + 2 * B > n  # the dropped tail was too short for a step
        prev = batch
    by_epoch: dict[int, list[int]] = {}
    for batch, ids in golden_steps:
        by_epoch.setdefault(batch.epoch, []).extend(ids.tolist())
    for consumed in by_epoch.values():
        assert len(consumed) == len(set(consumed))


def test_permutation_is_seeded_per_epoch() -> None:
    a = epoch_permutation(1000, 3, 0)
    assert sorted(a.tolist()) == list(range(1000))
    np.testing.assert_array_equal(a, epoch_permutation(1000, 3, 0))
    assert not np.array_equal(a, epoch_permutation(1000, 3, 1))
    assert not np.array_equal(a, epoch_permutation(1000, 4, 0))


def test_epoch_tail_is_dropped() -> None:
    cursor = DataCursor(num_samples=10, global_batch_size=4, seed=0)
    batches = [cursor.next_global_batch() for _ in range(5)]
    assert [(b.step, b.epoch, b.start) for b in batches] == [
        (0, 0, 0),
        (1, 0, 4),
        (2, 1, 0),
        (3, 1, 4),
        (4, 2, 0),
    ]
    np.testing.assert_array_equal(batches[2].sample_ids, epoch_permutation(10, 0, 1)[:4])


def test_exact_fit_rolls_over_lazily() -> None:
    cursor = DataCursor(num_samples=8, global_batch_size=4, seed=0)
    cursor.next_global_batch()
    cursor.next_global_batch()
    assert cursor.state_dict()["next_index"] == 8 and cursor.state_dict()["epoch"] == 0
    batch = cursor.next_global_batch()
    assert (batch.epoch, batch.start) == (1, 0)


def test_batch_ids_are_read_only() -> None:
    batch = DataCursor(10, 4, 0).next_global_batch()
    with pytest.raises(ValueError):
        batch.sample_ids[0] = 1


def test_state_dict_is_plain_json() -> None:
    cursor = DataCursor(num_samples=100, global_batch_size=8, seed=5)
    for _ in range(3):
        cursor.next_global_batch()
    state = cursor.state_dict()
    assert state == {
        "epoch": 0,
        "next_index": 24,
        "step": 3,
        "num_samples": 100,
        "seed": 5,
        "global_batch_size": 8,
    }
    assert all(type(v) is int for v in state.values())
    assert json.loads(json.dumps(state)) == state


def test_changed_global_batch_size_continues_from_the_same_position() -> None:
    old = DataCursor(num_samples=50, global_batch_size=8, seed=1)
    for _ in range(2):
        old.next_global_batch()
    new = DataCursor(num_samples=50, global_batch_size=12, seed=1)
    new.load_state_dict(old.state_dict())
    batch = new.next_global_batch()
    assert (batch.step, batch.epoch, batch.start) == (2, 0, 16)
    np.testing.assert_array_equal(batch.sample_ids, epoch_permutation(50, 1, 0)[16:28])


@pytest.mark.parametrize(
    ("change", "match"),
    [({"num_samples": 99}, "num_samples"), ({"seed": 6}, "data.seed")],
)
def test_state_from_different_data_is_refused(change: dict, match: str) -> None:
    state = DataCursor(num_samples=100, global_batch_size=8, seed=5).state_dict() | change
    with pytest.raises(DataError, match=match):
        DataCursor(num_samples=100, global_batch_size=8, seed=5).load_state_dict(state)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"next_index": 101}, "corrupt"),
        ({"epoch": -1}, "corrupt"),
        ({"step": "3"}, "must be an int"),
        ({"epoch": True}, "must be an int"),
    ],
)
def test_malformed_state_is_refused(change: dict, match: str) -> None:
    cursor = DataCursor(num_samples=100, global_batch_size=8, seed=5)
    with pytest.raises(DataError, match=match):
        cursor.load_state_dict(cursor.state_dict() | change)
    state = cursor.state_dict()
    del state["next_index"]
    with pytest.raises(DataError, match="missing next_index"):
        cursor.load_state_dict(state)
    assert cursor.state_dict()["next_index"] == 0  # a refused state changes nothing


def test_batch_larger_than_data_is_refused() -> None:
    with pytest.raises(DataError, match="larger than the data"):
        DataCursor(num_samples=10, global_batch_size=11, seed=0)
    with pytest.raises(DataError):
        DataCursor(num_samples=10, global_batch_size=0, seed=0)


def test_accumulation_steps() -> None:
    assert accumulation_steps(32, 8, 1) == 4
    assert accumulation_steps(32, 8, 4) == 1
    assert accumulation_steps(48, 4, 3) == 4


def test_accumulation_steps_error_suggests_valid_choices() -> None:
    with pytest.raises(ConfigError) as info:
        accumulation_steps(32, 8, 3)
    err = info.value
    assert err.key == "train.global_batch_size"
    message = str(err)
    assert "b*dp=8*3=24" in message
    assert "data-parallel size in {1, 2, 4}" in message  # 32 / 8 = 4 micro-batches to share
    assert "multiple of 24" in message
    with pytest.raises(ConfigError, match=r"micro_batch_size in \{1, 2, 3, 4, 6, 12\}"):
        accumulation_steps(36, 8, 3)


def test_micro_batches_are_contiguous_blocks_per_rank() -> None:
    batch = DataCursor(num_samples=100, global_batch_size=24, seed=2).next_global_batch()
    b, world = 2, 3  # A = 24 / (2*3) = 4 micro-batches per rank
    per_rank = [micro_batches(batch, r, world, b) for r in range(world)]
    assert [[m.index for m in mbs] for mbs in per_rank] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for mbs in per_rank:
        for m in mbs:
            np.testing.assert_array_equal(m.sample_ids, batch.sample_ids[m.index * b : (m.index + 1) * b])
    rank1 = np.concatenate([m.sample_ids for m in per_rank[1]])
    np.testing.assert_array_equal(rank1, batch.sample_ids[8:16])


def test_micro_batches_validate_rank_and_divisibility() -> None:
    batch = DataCursor(num_samples=100, global_batch_size=24, seed=2).next_global_batch()
    with pytest.raises(DataError, match="dp_rank=3"):
        micro_batches(batch, 3, 3, 2)
    with pytest.raises(DataError):
        micro_batches(batch, -1, 3, 2)
    with pytest.raises(ConfigError):
        micro_batches(batch, 0, 5, 2)


def test_uneven_blocks_cover_every_micro_batch_once_and_differ_by_at_most_one() -> None:
    """The fixed-order reduction's blocks at a size that does not divide the step (24 / 2 = 12
    micro-batches over 5 ranks), and the refusal when there are more ranks than micro-batches."""
    batch = DataCursor(num_samples=100, global_batch_size=24, seed=2).next_global_batch()
    per_rank = [[m.index for m in micro_batches(batch, r, 5, 2, uneven=True)] for r in range(5)]
    assert sum(per_rank, []) == list(range(12))
    assert sorted(len(block) for block in per_rank) == [2, 2, 2, 3, 3]
    assert micro_steps(24, 2, 5, uneven=True) == 12 and micro_steps(24, 2, 4) == 12
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        micro_steps(24, 2, 5)  # an equal share is impossible without uneven blocks
    with pytest.raises(ConfigError, match="at most 12 ranks"):
        micro_steps(24, 2, 13, uneven=True)


# -- state read from a checkpoint is validated before use (issue #8) --------------------------
@pytest.mark.parametrize(
    ("state", "match"),
    [
        (None, "must be an object"),
        ([0, 16], "must be an object"),
        ("epoch next_index step num_samples seed global_batch_size", "must be an object"),
        ({"epoch": 0}, "missing next_index"),
    ],
)
def test_state_that_is_not_a_state_dict_is_refused(state, match) -> None:
    cursor = DataCursor(num_samples=100, global_batch_size=8, seed=5)
    with pytest.raises(DataError, match=match):
        cursor.load_state_dict(state)
    assert cursor.state_dict()["step"] == 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"step": 2**63}, "'step' must be in"),
        ({"epoch": 10**400}, "'epoch' must be in"),
        ({"next_index": 1.0}, "must be an int"),
        ({"epoch": 3, "step": 2}, "epoch <= step"),
        ({"global_batch_size": 0}, "global_batch_size >= 1"),
    ],
)
def test_out_of_range_state_is_refused_with_the_field_named(change: dict, match: str) -> None:
    cursor = DataCursor(num_samples=100, global_batch_size=8, seed=5)
    with pytest.raises(DataError, match=match):
        cursor.load_state_dict(cursor.state_dict() | change)
    with pytest.raises(DataError, match=match):
        DataCursor.check_state(cursor.state_dict() | change)


def test_check_state_accepts_every_real_state() -> None:
    cursor = DataCursor(num_samples=20, global_batch_size=8, seed=5)
    for _ in range(7):
        cursor.next_global_batch()
        DataCursor.check_state(json.loads(json.dumps(cursor.state_dict())))
    assert cursor.state_dict()["epoch"] == 3  # two batches per epoch: the epochs advanced


def test_an_epoch_too_large_for_memory_is_named_at_start() -> None:
    """Its permutation (8 bytes a sample) was a raw MemoryError (or numpy's "array is too big") at
    the first step, after the model was built."""
    for num_samples in (2**50, 2**62):
        with pytest.raises(DataError, match=r"its permutation takes 8 bytes a sample .* lower data\.mixture_samples"):
            DataCursor(num_samples, 8, 0)
