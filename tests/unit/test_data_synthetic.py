"""MarkovSource: determinism per sample id, valid chain walks, and an entropy floor that holds."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from ftrain.config import ConfigError, DataConfig, ModelConfig
from ftrain.data import PERM_STREAM, DataError, MarkovSource, build_source
from ftrain.data.synthetic import CHAIN_STREAM, SAMPLE_STREAM


@pytest.fixture(scope="module")
def source() -> MarkovSource:
    return MarkovSource(vocab_size=64, seq_len=128, seed=7, num_samples=100_000)


def test_rows_have_shape_and_dtype(source: MarkovSource) -> None:
    rows = source.sample(np.array([0, 1, 99_999]))
    assert rows.shape == (3, 129)
    assert rows.dtype == np.int64
    assert rows.min() >= 0 and rows.max() < 64


def test_sample_is_a_pure_function_of_seed_and_id(source: MarkovSource) -> None:
    alone = source.sample(np.array([5]))[0]
    in_batch = source.sample(np.array([3, 9, 5, 1]))[2]
    reversed_batch = source.sample(np.array([5, 1, 9, 3])[::-1])[3]
    rebuilt = MarkovSource(vocab_size=64, seq_len=128, seed=7, num_samples=100_000).sample(np.array([5]))[0]
    np.testing.assert_array_equal(alone, in_batch)
    np.testing.assert_array_equal(alone, reversed_batch)
    np.testing.assert_array_equal(alone, rebuilt)
    # Different ids give different rows (129 tokens from a 0.8-nat chain cannot collide by chance).
    assert not np.array_equal(alone, source.sample(np.array([6]))[0])


def test_repeated_id_in_one_batch_gives_identical_rows(source: MarkovSource) -> None:
    rows = source.sample(np.array([11, 11]))
    np.testing.assert_array_equal(rows[0], rows[1])


def test_rows_are_valid_chain_walks(source: MarkovSource) -> None:
    rows = source.sample(np.arange(500))
    dense = source.transition_matrix()
    transition_probs = dense[rows[:, :-1], rows[:, 1:]]
    assert (transition_probs > 0).all()
    # And only the listed successors carry probability.
    assert np.count_nonzero(dense, axis=1).tolist() == [source.branching] * source.vocab_size
    np.testing.assert_allclose(dense.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (source.stationary[rows[:, 0]] > 0).all()


def test_successors_are_distinct_per_token() -> None:
    src = MarkovSource(vocab_size=8, seq_len=4, seed=1, num_samples=10, branching=8)
    assert (np.sort(src.successors, axis=1) == np.arange(8)).all()
    small = MarkovSource(vocab_size=300, seq_len=4, seed=1, num_samples=10, branching=5)
    assert all(len(set(row)) == 5 for row in small.successors.tolist())


def test_stationary_distribution_is_stationary(source: MarkovSource) -> None:
    pi = source.stationary
    assert pi.dtype == np.float64
    assert abs(pi.sum() - 1.0) < 1e-12
    np.testing.assert_allclose(pi @ source.transition_matrix(), pi, rtol=0, atol=1e-11)


def test_floor_matches_its_definition_and_bounds(source: MarkovSource) -> None:
    p = source.probs
    row_entropy = -(p * np.log(p)).sum(axis=1)
    assert source.entropy_floor_nats == pytest.approx(float(source.stationary @ row_entropy), abs=1e-12)
    assert 0.0 < source.entropy_floor_nats < math.log(source.branching) < math.log(source.vocab_size)


def test_empirical_conditional_entropy_matches_floor(source: MarkovSource) -> None:
    # 1600 rows x 128 transitions = 204,800 transitions.
    rows = source.sample(np.arange(1600))
    prev, nxt = rows[:, :-1].ravel(), rows[:, 1:].ravel()
    n = prev.size
    # (a) Mean NLL of the true chain on the samples: an unbiased estimate of the floor, since
    # every position is distributed as pi. Its standard error is ~0.0017 nats here (measured by
    # batch means over rows, which also covers the within-row Markov correlation), so 0.01 nats
    # is ~6 standard errors: the test fails only on a real mismatch.
    nll = -np.log(source.transition_matrix()[prev, nxt])
    assert abs(nll.mean() - source.entropy_floor_nats) < 0.01, (nll.mean(), source.entropy_floor_nats)
    # (b) Model-free plug-in estimate H(next | prev) from transition counts: it checks the
    # sampler's frequencies, not the table. Its bias is about -(#free cells)/(2n) =
    # -(64*3)/(2*204800) ~ -5e-4 nats, well inside the same tolerance.
    counts = np.zeros((source.vocab_size, source.vocab_size))
    np.add.at(counts, (prev, nxt), 1)
    row_totals = counts.sum(axis=1, keepdims=True)
    cond = np.divide(counts, row_totals, out=np.zeros_like(counts), where=row_totals > 0)
    logs = np.log(cond, where=cond > 0, out=np.zeros_like(cond))
    plug_in = -(counts * logs).sum() / n
    assert abs(plug_in - source.entropy_floor_nats) < 0.01, (plug_in, source.entropy_floor_nats)
    # First tokens follow pi (total-variation distance of 1600 draws over 64 states).
    first = np.bincount(rows[:, 0], minlength=source.vocab_size) / len(rows)
    assert 0.5 * np.abs(first - source.stationary).sum() < 0.15


def test_different_seeds_give_different_chains() -> None:
    a = MarkovSource(vocab_size=64, seq_len=16, seed=0, num_samples=10)
    b = MarkovSource(vocab_size=64, seq_len=16, seed=1, num_samples=10)
    assert not np.array_equal(a.successors, b.successors)
    assert a.entropy_floor_nats != b.entropy_floor_nats
    assert not np.array_equal(a.sample(np.arange(4)), b.sample(np.arange(4)))


def test_lower_concentration_means_lower_floor() -> None:
    floors = [MarkovSource(64, 8, 3, 10, concentration=c).entropy_floor_nats for c in (0.1, 1.0, 100.0)]
    assert floors[0] < floors[1] < floors[2] < math.log(4)


def test_periodic_and_nearly_deterministic_chains_still_get_a_stationary_pi() -> None:
    # branching=1 is a random function: cycles, often periodic. Very low concentration makes a
    # slowly mixing chain (the squaring fallback). Both must still yield pi P = pi.
    for kwargs in ({"branching": 1}, {"branching": 2, "concentration": 0.05}):
        src = MarkovSource(vocab_size=128, seq_len=8, seed=3, num_samples=10, **kwargs)
        np.testing.assert_allclose(src.stationary @ src.transition_matrix(), src.stationary, atol=1e-10)
        assert src.entropy_floor_nats >= 0.0
    deterministic = MarkovSource(vocab_size=128, seq_len=8, seed=3, num_samples=10, branching=1)
    assert deterministic.entropy_floor_nats == 0.0


def test_stream_constants_are_distinct() -> None:
    assert len({CHAIN_STREAM, SAMPLE_STREAM, PERM_STREAM}) == 3


@pytest.mark.parametrize("bad", [[-1], [10], [0, 10], [[0]], [0.5]])
def test_out_of_range_or_malformed_ids_raise(bad: list) -> None:
    src = MarkovSource(vocab_size=16, seq_len=4, seed=0, num_samples=10)
    with pytest.raises(DataError, match="sample id"):
        src.sample(np.array(bad))


def test_empty_id_list_gives_empty_batch() -> None:
    src = MarkovSource(vocab_size=16, seq_len=4, seed=0, num_samples=10)
    assert src.sample(np.array([], dtype=np.int64)).shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"branching": 17},
        {"branching": 0},
        {"concentration": 0.0},
        {"seed": -1},
        {"num_samples": 0},
        {"seq_len": 0},
    ],
)
def test_bad_construction_raises(kwargs: dict) -> None:
    args = {"vocab_size": 16, "seq_len": 4, "seed": 0, "num_samples": 10} | kwargs
    with pytest.raises(DataError):
        MarkovSource(**args)


def test_fast_enough() -> None:
    start = time.perf_counter()
    src = MarkovSource(vocab_size=256, seq_len=128, seed=0, num_samples=10**6)
    build_s = time.perf_counter() - start
    src.sample(np.arange(64))
    start = time.perf_counter()
    src.sample(np.arange(1000, 1064))
    sample_s = time.perf_counter() - start
    # Typical: ~3 ms each. The bounds only catch work that grows with num_samples (10**6 samples
    # of 128 tokens generated up front would take tens of seconds), not a loaded machine's pauses.
    assert build_s < 2.0, build_s
    assert sample_s < 1.0, sample_s


def test_build_source_synthetic() -> None:
    data = DataConfig(seed=4, num_samples=1000, branching=3, concentration=0.7)
    model = ModelConfig(vocab_size=32, seq_len=16)
    src = build_source(data, model)
    assert isinstance(src, MarkovSource)
    assert (src.vocab_size, src.seq_len, src.seed, src.num_samples, src.branching, src.concentration) == (
        32,
        16,
        4,
        1000,
        3,
        0.7,
    )


def test_build_source_rejects_branching_above_vocab() -> None:
    with pytest.raises(ConfigError, match="data.branching") as info:
        build_source(DataConfig(branching=40), ModelConfig(vocab_size=32))
    assert info.value.key == "data.branching"
