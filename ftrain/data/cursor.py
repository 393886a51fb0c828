"""The world-size-independent data cursor.

Samples are addressed by global id. Epoch ``e`` visits the ids in the order of a seeded
permutation ``perm_e`` (a pure function of ``(seed, e)``); each optimizer step takes the next
``global_batch_size`` (B) positions of it. The cursor's whole state is ``(epoch, next_index)``
plus the step counter, so a checkpoint taken at any world size resumes at any other and consumes
exactly the remaining samples: none skipped, none repeated.

Epoch tail: when fewer than B positions are left in an epoch, they are dropped and the step
starts the next epoch at position 0. Every step is therefore a full global batch, and at most
``B - 1`` samples per epoch (the same ones at every world size) go unseen in that epoch.

Splitting a step across ranks: with micro-batch ``b`` and ``dp`` data-parallel ranks, each rank
runs ``A = B / (b * dp)`` accumulation micro-steps. The global batch is cut into ``B / b``
micro-batches in order, and rank ``r`` takes the contiguous block ``[r*A, (r+1)*A)``; a
fixed-order gradient reduction then sums each rank's block in order, which is what makes it
world-size independent.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ftrain.config import ConfigError
from ftrain.data.errors import DataError

logger = logging.getLogger(__name__)

#: SeedSequence stream of the per-epoch permutations (distinct from the synthetic streams).
PERM_STREAM = 0x5045524D  # "PERM"

_STATE_KEYS = ("epoch", "next_index", "step", "num_samples", "seed", "global_batch_size")
#: Largest value any cursor state field may hold (int64, what numpy and torch index with).
_MAX_STATE_INT = 2**63 - 1


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """The B sample ids of one optimizer step, in global order (a read-only array).

    ``start`` is the position in epoch ``epoch``'s permutation of the first id.
    """

    step: int
    epoch: int
    start: int
    sample_ids: np.ndarray


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One micro-batch of a step; ``index`` is its global position within the step (0..B/b-1)."""

    index: int
    sample_ids: np.ndarray


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits sample ids (a pure function of its arguments)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, PERM_STREAM, epoch]))
    return rng.permutation(num_samples)


class DataCursor:
    """Hands out global batches; ``state_dict()`` is all a checkpoint needs to resume exactly."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        _require_int("num_samples", num_samples, minimum=1)
        _require_int("global_batch_size", global_batch_size, minimum=1)
        _require_int("seed", seed, minimum=0)
        if global_batch_size > num_samples:
            raise DataError(
                f"train.global_batch_size={global_batch_size} is larger than the data "
                f"({num_samples} samples per epoch); lower the batch size or use more data"
            )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.next_index = 0
        self.step = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"DataCursor(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"seed={self.seed}, epoch={self.epoch}, next_index={self.next_index}, step={self.step})"
        )

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:  # only the current epoch's permutation is kept
            self._perm = epoch_permutation(self.num_samples, self.seed, self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def next_global_batch(self) -> GlobalBatch:
        """The next step's B sample ids; rolls over to the next epoch when the tail is short."""
        if self.next_index + self.global_batch_size > self.num_samples:
            dropped = self.num_samples - self.next_index
            self.epoch += 1
            self.next_index = 0
            logger.debug("data epoch %d starts at step %d (%d tail samples dropped)", self.epoch, self.step, dropped)
        start = self.next_index
        ids = self._permutation()[start : start + self.global_batch_size].copy()
        ids.setflags(write=False)
        batch = GlobalBatch(step=self.step, epoch=self.epoch, start=start, sample_ids=ids)
        self.next_index += self.global_batch_size
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Plain ints, JSON-serialisable."""
        return {
            "epoch": self.epoch,
            "next_index": self.next_index,
            "step": self.step,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
        }

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise DataError unless ``state`` has the shape of a :meth:`state_dict`: a dict with every
        key, each a plain int in range, and self-consistent (epoch <= step: each step starts at
        most one epoch; next_index <= num_samples). Extra keys are ignored. It comes from storage,
        so nothing else about it is trusted."""
        if not isinstance(state, dict):
            raise DataError(
                f"data cursor state must be an object (a DataCursor.state_dict()), got {type(state).__name__}"
            )
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"data cursor state is missing {', '.join(missing)}; it is not a DataCursor.state_dict()")
        for key in _STATE_KEYS:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise DataError(
                    f"data cursor state {key!r} must be an int, got {type(value).__name__} {str(value)[:80]}"
                )
            if not 0 <= value <= _MAX_STATE_INT:
                raise DataError(f"data cursor state is corrupt: {key!r} must be in [0, 2**63), got {str(value)[:80]}")
        epoch, next_index, step = int(state["epoch"]), int(state["next_index"]), int(state["step"])
        num_samples, batch = int(state["num_samples"]), int(state["global_batch_size"])
        if num_samples < 1 or batch < 1 or next_index > num_samples or epoch > step:
            raise DataError(
                f"data cursor state is corrupt: epoch={epoch}, next_index={next_index}, step={step}, "
                f"num_samples={num_samples}, global_batch_size={batch} (need num_samples >= 1, "
                f"global_batch_size >= 1, next_index <= num_samples, epoch <= step)"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; the data (num_samples, seed) must be the same.

        ``state`` is checked by :meth:`check_state` first; DataError names what is wrong.
        """
        self.check_state(state)
        if int(state["num_samples"]) != self.num_samples:
            raise DataError(
                f"data cursor checkpoint was taken with num_samples={state['num_samples']} but the "
                f"data now has {self.num_samples}: the data changed under the checkpoint; restore "
                f"the original data (data.source / data.num_samples) or start a fresh run"
            )
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"data cursor checkpoint was taken with data.seed={state['seed']} but the run uses "
                f"data.seed={self.seed}: the sample order would change; restore data.seed="
                f"{state['seed']} or start a fresh run"
            )
        epoch, next_index, step = int(state["epoch"]), int(state["next_index"]), int(state["step"])
        if int(state["global_batch_size"]) != self.global_batch_size:
            logger.info(
                "data cursor: global batch size changed %d -> %d; continuing from epoch %d index %d",
                state["global_batch_size"],
                self.global_batch_size,
                epoch,
                next_index,
            )
        self.epoch, self.next_index, self.step = epoch, next_index, step


def accumulation_steps(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-steps per rank, ``A = B / (b * dp)``; ConfigError naming valid choices if not whole."""
    _require_int("global_batch_size", global_batch_size, minimum=1)
    _require_int("micro_batch_size", micro_batch_size, minimum=1)
    _require_int("dp_size", dp_size, minimum=1)
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step == 0:
        return global_batch_size // per_step
    hints = []
    if global_batch_size % micro_batch_size == 0:
        sizes = _divisors(global_batch_size // micro_batch_size)
        hints.append(f"a data-parallel size in {_short(sizes)} with train.micro_batch_size={micro_batch_size}")
    if global_batch_size % dp_size == 0:
        micro = _divisors(global_batch_size // dp_size)
        hints.append(f"train.micro_batch_size in {_short(micro)} at data-parallel size {dp_size}")
    nearest = per_step * max(1, round(global_batch_size / per_step))
    hints.append(f"train.global_batch_size a multiple of {per_step} (e.g. {nearest})")
    raise ConfigError(
        "train.global_batch_size",
        f"{global_batch_size} is not divisible by train.micro_batch_size * data-parallel size "
        f"(b*dp={micro_batch_size}*{dp_size}={per_step}); choose " + ", or ".join(hints),
    )


def micro_steps(global_batch_size: int, micro_batch_size: int, dp_size: int, *, uneven: bool = False) -> int:
    """Micro-batches per optimizer step over all data-parallel ranks, ``M = B / b``.

    Each rank takes an equal share ``A = M / dp`` (:func:`accumulation_steps`: ConfigError when dp
    does not divide M) — unless ``uneven``: the fixed-order reduction (``parallel.deterministic``)
    sums every micro-batch alike, whichever rank holds it, so it takes blocks that differ by one
    (:func:`micro_block`) and runs at any data-parallel size up to M."""
    if not uneven:
        return accumulation_steps(global_batch_size, micro_batch_size, dp_size) * dp_size
    _require_int("global_batch_size", global_batch_size, minimum=1)
    _require_int("micro_batch_size", micro_batch_size, minimum=1)
    _require_int("dp_size", dp_size, minimum=1)
    if global_batch_size % micro_batch_size:
        raise ConfigError(
            "train.global_batch_size",
            f"{global_batch_size} is not a multiple of train.micro_batch_size={micro_batch_size}",
        )
    total = global_batch_size // micro_batch_size
    if dp_size > total:
        raise ConfigError(
            "train.global_batch_size",
            f"{global_batch_size} sequences in micro-batches of {micro_batch_size} give {total} micro-batches "
            f"per step, fewer than the {dp_size} data-parallel ranks (each needs one): use at most {total} "
            "ranks, a larger train.global_batch_size or a smaller train.micro_batch_size",
        )
    return total


def micro_block(total_micro: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Rank ``dp_rank``'s contiguous block ``[lo, hi)`` of a step's ``total_micro`` micro-batches:
    ``[r*M//dp, (r+1)*M//dp)`` — ``A = M/dp`` each when dp divides M, else sizes differing by one."""
    _require_int("dp_rank", dp_rank, minimum=0)
    if dp_rank >= dp_size:
        raise DataError(f"dp_rank={dp_rank} is out of range for data-parallel size {dp_size}")
    return dp_rank * total_micro // dp_size, (dp_rank + 1) * total_micro // dp_size


def micro_batches(
    batch: GlobalBatch, dp_rank: int, dp_size: int, micro_batch_size: int, *, uneven: bool = False
) -> list[MicroBatch]:
    """Rank ``dp_rank``'s micro-batches: its contiguous global block (:func:`micro_block`)."""
    total = micro_steps(len(batch.sample_ids), micro_batch_size, dp_size, uneven=uneven)
    lo, hi = micro_block(total, dp_rank, dp_size)
    b = micro_batch_size
    return [MicroBatch(index=m, sample_ids=batch.sample_ids[m * b : (m + 1) * b]) for m in range(lo, hi)]


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _short(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return "{" + shown + (", ..." if len(values) > limit else "") + "}"
