"""A seeded synthetic token source with a known entropy floor.

:class:`MarkovSource` is a first-order Markov chain over ``vocab_size`` tokens: every token has
``branching`` distinct successors whose probabilities are drawn from a symmetric
Dirichlet(``concentration``). The first token of each sample is drawn from the chain's stationary
distribution ``pi``, so every position of every sample is distributed as ``pi`` and the lowest
expected next-token cross-entropy any model can reach is exactly

    entropy_floor_nats = sum_i pi_i * H(P_i)

at every predicted position. Training curves can therefore be judged against a real optimum.

Sample ``i`` depends only on ``(seed, i)``: its randomness comes from its own generator seeded
with ``SeedSequence([seed, SAMPLE_STREAM, i])``, never from which batch it is drawn in.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ftrain.data.errors import DataError, as_sample_ids

logger = logging.getLogger(__name__)

#: SeedSequence stream of the chain's structure (successors and their probabilities).
CHAIN_STREAM = 0x43484149  # "CHAI"
#: SeedSequence stream of per-sample token draws (distinct from the cursor's PERM_STREAM).
SAMPLE_STREAM = 0x53414D50  # "SAMP"

_STATIONARY_TOL = 1e-12  # L1 change between power-iteration steps at convergence
_VECTOR_ITERS = 4096  # sparse power-iteration steps before switching to squaring
_DENSE_MAX_VOCAB = 2048  # largest vocabulary whose dense lazy matrix is squared
_MAX_SQUARINGS = 128
_CHECK_EVERY = 32  # iterations between convergence checks


class MarkovSource:
    """A seeded first-order Markov chain; ``sample(ids)`` returns ``(len(ids), seq_len + 1)``.

    Attributes (read-only arrays): ``successors`` (vocab, branching) int64 token ids,
    ``probs`` (vocab, branching) float64 transition probabilities, ``stationary`` (vocab,)
    float64 distribution ``pi`` with ``pi @ P == pi``.
    """

    entropy_floor_nats: float

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int,
        num_samples: int,
        branching: int = 4,
        concentration: float = 0.5,
    ):
        for name, value in (
            ("vocab_size", vocab_size),
            ("seq_len", seq_len),
            ("num_samples", num_samples),
            ("branching", branching),
        ):
            if int(value) != value or value <= 0:
                raise DataError(f"MarkovSource: {name} must be a positive integer, got {value!r}")
        if branching > vocab_size:
            raise DataError(
                f"MarkovSource: branching={branching} distinct successors do not fit in "
                f"vocab_size={vocab_size}; use branching <= vocab_size"
            )
        if not concentration > 0:
            raise DataError(f"MarkovSource: concentration must be > 0, got {concentration!r}")
        if int(seed) != seed or seed < 0:
            raise DataError(f"MarkovSource: seed must be a non-negative integer, got {seed!r}")
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_samples = int(num_samples)
        self.branching = int(branching)
        self.concentration = float(concentration)

        rng = np.random.default_rng(np.random.SeedSequence([self.seed, CHAIN_STREAM]))
        self.successors = _distinct_successors(rng, self.vocab_size, self.branching)
        self.probs = _transition_probs(rng, self.vocab_size, self.branching, self.concentration)
        self.stationary = _stationary(self.successors, self.probs)
        self.entropy_floor_nats = float(self.stationary @ _row_entropy_nats(self.probs))
        # Inverse-CDF tables. Dividing by the row total makes the last entry (and any entry
        # after the last nonzero probability) exactly 1.0, so a uniform draw in [0, 1) never
        # selects a zero-probability token.
        cum = np.cumsum(self.probs, axis=1)
        self._cum_probs = cum / cum[:, -1:]
        cum_pi = np.cumsum(self.stationary)
        self._cum_pi = cum_pi / cum_pi[-1]
        for arr in (self.successors, self.probs, self.stationary, self._cum_probs, self._cum_pi):
            arr.setflags(write=False)
        logger.info(
            "synthetic Markov source: vocab=%d branching=%d concentration=%g seed=%d "
            "entropy_floor=%.6g nats (log(vocab)=%.4f)",
            self.vocab_size,
            self.branching,
            self.concentration,
            self.seed,
            self.entropy_floor_nats,
            math.log(self.vocab_size),
        )

    def __repr__(self) -> str:
        return (
            f"MarkovSource(vocab_size={self.vocab_size}, seq_len={self.seq_len}, seed={self.seed}, "
            f"num_samples={self.num_samples}, branching={self.branching}, "
            f"concentration={self.concentration}, entropy_floor_nats={self.entropy_floor_nats:.6f})"
        )

    def transition_matrix(self) -> np.ndarray:
        """The dense (vocab, vocab) transition matrix ``P`` (for tests and small vocabularies)."""
        dense = np.zeros((self.vocab_size, self.vocab_size), dtype=np.float64)
        rows = np.repeat(np.arange(self.vocab_size), self.branching)
        dense[rows, self.successors.ravel()] = self.probs.ravel()
        return dense

    def sample(self, ids: np.ndarray) -> np.ndarray:
        """Token rows for global sample ids: int64 of shape ``(len(ids), seq_len + 1)``."""
        ids = as_sample_ids(ids, self.num_samples, "MarkovSource.sample")
        n, length = len(ids), self.seq_len + 1
        uniforms = np.empty((n, length), dtype=np.float64)
        for row, sample_id in enumerate(ids.tolist()):
            seq = np.random.SeedSequence([self.seed, SAMPLE_STREAM, sample_id])
            uniforms[row] = np.random.Generator(np.random.PCG64(seq)).random(length)
        tokens = np.empty((n, length), dtype=np.int64)
        tokens[:, 0] = np.searchsorted(self._cum_pi, uniforms[:, 0], side="right")
        for pos in range(1, length):
            prev = tokens[:, pos - 1]
            # Index of the successor: how many cumulative probabilities are <= the draw.
            choice = (self._cum_probs[prev] <= uniforms[:, pos, None]).sum(axis=1)
            tokens[:, pos] = self.successors[prev, choice]
        return tokens


def _distinct_successors(rng: np.random.Generator, vocab_size: int, branching: int) -> np.ndarray:
    """``branching`` distinct tokens per row, uniformly over subsets (Floyd's algorithm, vectorised)."""
    succ = np.empty((vocab_size, branching), dtype=np.int64)
    for col, top in enumerate(range(vocab_size - branching, vocab_size)):
        pick = rng.integers(0, top + 1, size=vocab_size)
        taken = (succ[:, :col] == pick[:, None]).any(axis=1)
        succ[:, col] = np.where(taken, top, pick)
    succ.sort(axis=1)
    return succ


def _transition_probs(rng: np.random.Generator, vocab_size: int, branching: int, concentration: float) -> np.ndarray:
    probs = rng.dirichlet(np.full(branching, concentration), size=vocab_size)
    # Very low concentrations can underflow a share to exactly 0 (or leave a NaN row); keep
    # every listed successor possible and each row a distribution. The floor is computed from
    # this table, so it stays exact.
    probs = np.nan_to_num(probs, nan=0.0)
    probs = np.maximum(probs, 1e-12)
    return probs / probs.sum(axis=1, keepdims=True)


def _stationary(successors: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """A stationary distribution by power iteration on the lazy chain ``(P + I) / 2``.

    The lazy chain is aperiodic, so the iteration converges even when ``P`` is periodic; for a
    reducible chain it converges to the stationary distribution reached from uniform. A chain
    that mixes slowly (very low concentration makes it nearly deterministic) switches to
    iterating by repeated squaring of the dense lazy matrix, which takes ``2**k`` steps in
    ``k`` products, when the vocabulary is small enough for that.
    """
    vocab_size = successors.shape[0]
    flat_succ = successors.ravel()
    pi = np.full(vocab_size, 1.0 / vocab_size, dtype=np.float64)
    for it in range(1, _VECTOR_ITERS + 1):
        moved = np.bincount(flat_succ, weights=(pi[:, None] * probs).ravel(), minlength=vocab_size)
        new = 0.5 * (pi + moved)
        new /= new.sum()
        if it % _CHECK_EVERY == 0 and float(np.abs(new - pi).sum()) < _STATIONARY_TOL:
            logger.debug("stationary distribution converged after %d iterations", it)
            return new
        pi = new
    if vocab_size > _DENSE_MAX_VOCAB:
        raise DataError(
            f"MarkovSource: the chain's stationary distribution did not converge in "
            f"{_VECTOR_ITERS} iterations (it mixes too slowly); raise data.concentration or "
            f"data.branching, or change data.seed"
        )
    lazy = np.zeros((vocab_size, vocab_size), dtype=np.float64)
    lazy[np.repeat(np.arange(vocab_size), successors.shape[1]), flat_succ] = 0.5 * probs.ravel()
    lazy[np.arange(vocab_size), np.arange(vocab_size)] += 0.5
    for squarings in range(_MAX_SQUARINGS):
        new = pi @ lazy
        new /= new.sum()
        if float(np.abs(new - pi).sum()) < _STATIONARY_TOL:
            logger.debug("stationary distribution converged after %d + 2**%d iterations", _VECTOR_ITERS, squarings)
            return new
        pi = new
        lazy = lazy @ lazy
        lazy /= lazy.sum(axis=1, keepdims=True)
    raise DataError(
        f"MarkovSource: the chain's stationary distribution did not converge in 2**{_MAX_SQUARINGS} "
        f"iterations; raise data.concentration or data.branching, or change data.seed"
    )


def _row_entropy_nats(probs: np.ndarray) -> np.ndarray:
    logs = np.log(probs, where=probs > 0, out=np.zeros_like(probs))
    return -(probs * logs).sum(axis=1)
