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

The data's identity (:mod:`ftrain.data.identity`: sources, sizes, contents, weights, order, seed)
rides along in the state: ``blends``, the identities the run has read, each from its first step.
A resume whose data differ is refused (:class:`~ftrain.data.identity.DataChangeError`) unless
``data.on_mixture_change = "new_blend"``: then the new blend takes over at the resumed step, in
the same epoch, walking its own permutation of the epoch *without* every sample that the earlier
blends of this epoch read (``segments``: which blend, how many positions of its order). Those are
recomputed from the identities alone (no file is read), so each sample is still read at most once
per epoch (as often as its share says, for an upsampled source); the next epoch is the new
blend's, whole. A state without ``blends`` (an older ftrain's) loads with a warning.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ftrain.config import ConfigError
from ftrain.data.errors import DataError
from ftrain.data.identity import (
    ON_CHANGE,
    DataChangeError,
    blend_of,
    check_identity,
    content_key,
    data_digest,
    describe_changes,
)

logger = logging.getLogger(__name__)

#: SeedSequence stream of the per-epoch permutations (distinct from the synthetic streams).
PERM_STREAM = 0x5045524D  # "PERM"

_STATE_KEYS = ("epoch", "next_index", "step", "num_samples", "seed", "global_batch_size")
#: Largest value any cursor state field may hold (int64, what numpy and torch index with).
_MAX_STATE_INT = 2**63 - 1
#: Most blends a cursor state may list (a run changes its data a handful of times, if ever).
MAX_BLENDS = 1000


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
    try:
        return rng.permutation(num_samples)
    except (MemoryError, ValueError) as e:  # numpy: "array is too big" beyond what it can address
        raise DataError(_too_big(num_samples, f"it cannot be allocated ({e})")) from e


def _too_big(num_samples: int, why: str) -> str:
    return (
        f"an epoch of {num_samples:,} samples: its permutation takes 8 bytes a sample "
        f"({8 * num_samples / 2**30:,.1f} GiB) and {why}; lower data.mixture_samples (a mixture) or "
        "data.num_samples (synthetic)"
    )


def _check_permutation_fits(num_samples: int) -> None:
    """DataError at start, rather than a MemoryError at the first step, for an epoch whose
    permutation cannot fit this machine's memory."""
    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not every system says
        return
    if 8 * num_samples > memory_bytes > 0:
        raise DataError(_too_big(num_samples, f"this machine has {memory_bytes / 2**30:,.1f} GiB of memory"))


class DataCursor:
    """Hands out global batches; ``state_dict()`` is all a checkpoint needs to resume exactly."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        seed: int,
        *,
        data: dict[str, Any] | None = None,
        on_change: str = "fail",
    ):
        """``data``: the identity of the data (:func:`~ftrain.data.identity.identity_of`), recorded
        in :meth:`state_dict` and checked by :meth:`load_state_dict` (None: neither);
        ``on_change``: ``data.on_mixture_change``."""
        _require_int("num_samples", num_samples, minimum=1)
        _require_int("global_batch_size", global_batch_size, minimum=1)
        _require_int("seed", seed, minimum=0)
        if global_batch_size > num_samples:
            raise DataError(
                f"train.global_batch_size={global_batch_size} is larger than the data "
                f"({num_samples} samples per epoch); lower the batch size or use more data"
            )
        _check_permutation_fits(num_samples)
        if on_change not in ON_CHANGE:
            raise ConfigError("data.on_mixture_change", f"must be one of {', '.join(ON_CHANGE)}, got {on_change!r}")
        if data is not None:
            check_identity(data, "data identity")
            if (data["num_samples"], data["seed"]) != (num_samples, seed):
                raise DataError(
                    f"data identity of {data['num_samples']} samples, seed {data['seed']}, for a cursor of "
                    f"{num_samples} samples, seed {seed}"
                )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.on_change = on_change
        self.epoch = 0
        self.next_index = 0
        self.step = 0
        #: the data identities this run has read, oldest first, each with its first step
        self.blends: list[dict[str, Any]] = [{"step": 0, "data": data}] if data is not None else []
        #: earlier blends of the current epoch: ``{"blend": index in blends, "consumed": positions read}``
        self.segments: list[dict[str, int]] = []
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"DataCursor(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"seed={self.seed}, epoch={self.epoch}, next_index={self.next_index}, step={self.step})"
        )

    @property
    def data_digest(self) -> str:
        """:func:`~ftrain.data.identity.data_digest` of the data read now ("" if unknown)."""
        return data_digest(self.blends[-1]["data"]) if self.blends else ""

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:  # only the current epoch's order is kept
            if self.segments:
                self._perm = blend_order(self.blends, self.segments, self.epoch)
            else:
                self._perm = epoch_permutation(self.num_samples, self.seed, self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def next_global_batch(self) -> GlobalBatch:
        """The next step's B sample ids; rolls over to the next epoch when the tail is short."""
        order = self._permutation()
        if self.next_index + self.global_batch_size > len(order):
            dropped = len(order) - self.next_index
            self.epoch += 1
            self.next_index = 0
            self.segments = []  # a new epoch is the current blend's, whole
            order = self._permutation()
            logger.debug("data epoch %d starts at step %d (%d tail samples dropped)", self.epoch, self.step, dropped)
        start = self.next_index
        ids = order[start : start + self.global_batch_size].copy()
        ids.setflags(write=False)
        batch = GlobalBatch(step=self.step, epoch=self.epoch, start=start, sample_ids=ids)
        self.next_index += self.global_batch_size
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: plain ints, and the data's ``blends`` and ``segments`` where the cursor
        knows its data (their identities are shared, never modified)."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "next_index": self.next_index,
            "step": self.step,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
        }
        if self.blends:
            state["blends"] = [dict(b) for b in self.blends]
            state["segments"] = [dict(s) for s in self.segments]
        return state

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
        _check_blends(state, step)

    def changes_from(self, state: dict[str, Any]) -> list[str]:
        """What differs between the data ``state`` (a checked :meth:`state_dict`) was taken on and
        this cursor's, by config key; empty when either does not know its data."""
        saved = state.get("blends") or []
        if not saved or not self.blends:
            return []
        old, new = saved[-1]["data"], self.blends[-1]["data"]
        return [] if old == new else describe_changes(old, new)

    def check_resume(self, state: Any) -> list[str]:
        """Whether this cursor may resume from ``state`` (before anything else is loaded): raises
        DataError if ``state`` is malformed, :class:`~ftrain.data.identity.DataChangeError` if its
        data differ and ``data.on_mixture_change=fail``; returns the changes (empty: none)."""
        self.check_state(state)
        changes = self.changes_from(state)
        if changes and self.on_change == "fail":
            raise DataChangeError(int(state["step"]), changes)
        if changes:
            old, new = state["blends"][-1]["data"], self.blends[-1]["data"]
            if old["seq_len"] != new["seq_len"]:
                raise DataChangeError(
                    int(state["step"]),
                    [
                        *changes,
                        "data.on_mixture_change=new_blend cannot carry what was read across another "
                        "model.seq_len (every sample is another window of the files)",
                    ],
                )
        return changes

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the data must be the same (or ``data.on_mixture_change =
        "new_blend"``: see the module doc).

        ``state`` is checked by :meth:`check_state` first; DataError names what is wrong.
        """
        changes = self.check_resume(state)
        epoch, next_index, step = int(state["epoch"]), int(state["next_index"]), int(state["step"])
        saved: list[dict[str, Any]] = state.get("blends") or []
        segments = [{"blend": int(s["blend"]), "consumed": int(s["consumed"])} for s in state.get("segments") or []]
        if not self.blends or not saved:
            self._check_size_and_seed(state)
            if self.blends:
                logger.warning(
                    "data cursor: the checkpoint of step %d records no data identity (an older ftrain's): it "
                    "cannot be checked that data.sources / data.source are what it was trained on; recording "
                    "them from this step on",
                    step,
                )
                self.blends = [{"step": step, "data": self.blends[-1]["data"]}]
            segments = []
        elif not changes:  # the same data (perhaps at other paths): the history goes on
            self.blends = [*saved[:-1], {"step": int(saved[-1]["step"]), "data": self.blends[-1]["data"]}]
        else:
            logger.warning(
                "data.on_mixture_change=new_blend: the data changed under the checkpoint of step %d (%s); the new "
                "blend takes over in epoch %d without the %d samples this epoch read so far",
                step,
                "; ".join(changes),
                epoch,
                sum(s["consumed"] for s in segments) + next_index,
            )
            self.blends = [*saved, {"step": step, "data": self.blends[-1]["data"]}]
            segments = [*segments, {"blend": len(saved) - 1, "consumed": next_index}]
            next_index = 0
        if int(state["global_batch_size"]) != self.global_batch_size:
            logger.info(
                "data cursor: global batch size changed %d -> %d; continuing from epoch %d index %d",
                state["global_batch_size"],
                self.global_batch_size,
                epoch,
                next_index,
            )
        self.epoch, self.next_index, self.step = epoch, next_index, step
        self.segments = segments
        self._perm_epoch = -1  # the order of this epoch may differ (segments)

    def _check_size_and_seed(self, state: dict[str, Any]) -> None:
        """Without identities: at least the epoch size and the seed must be the same."""
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


def _check_blends(state: dict[str, Any], step: int) -> None:
    """The ``blends`` and ``segments`` of a cursor state (from storage), where it has them."""
    if "blends" not in state and not state.get("segments"):
        return
    blends, segments = state.get("blends"), state.get("segments", [])
    if not isinstance(blends, list) or not 1 <= len(blends) <= MAX_BLENDS:
        raise DataError(f"data cursor state: blends must be a list of 1 to {MAX_BLENDS} entries")
    previous = 0
    for i, blend in enumerate(blends):
        if not isinstance(blend, dict) or set(blend) != {"step", "data"}:
            raise DataError(f"data cursor state: blends[{i}] must be an object of step and data")
        first = blend["step"]
        if isinstance(first, bool) or not isinstance(first, int) or not previous <= first <= step:
            raise DataError(f"data cursor state: blends[{i}].step must be an int in [{previous}, {step}]")
        previous = first
        check_identity(blend["data"], f"data cursor state: blends[{i}].data")
    last = blends[-1]["data"]
    if (last["num_samples"], last["seed"]) != (state["num_samples"], state["seed"]):
        raise DataError("data cursor state: its last blend is not of its num_samples and seed")
    if not isinstance(segments, list) or len(segments) >= len(blends):
        raise DataError("data cursor state: segments must be a list shorter than blends")
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or set(seg) != {"blend", "consumed"}:
            raise DataError(f"data cursor state: segments[{i}] must be an object of blend and consumed")
        k, consumed = seg["blend"], seg["consumed"]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(blends) - 1:
            raise DataError(f"data cursor state: segments[{i}].blend must index an earlier blend")
        limit = blends[k]["data"]["num_samples"]
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= limit:
            raise DataError(f"data cursor state: segments[{i}].consumed must be an int in [0, {limit}]")


def blend_order(blends: list[dict[str, Any]], segments: list[dict[str, int]], epoch: int) -> np.ndarray:
    """The order of epoch ``epoch`` under the last of ``blends``: its permutation of the epoch without
    the ids whose samples the ``segments`` (earlier blends of the epoch) read. Each segment's own
    order is the same rule applied to the segments before it, so all of it follows from the
    identities (no file is read)."""
    read: dict[str, np.ndarray] = {}  # content key -> which samples of that source were read
    for seg in segments:
        identity = blends[seg["blend"]]["data"]
        order = _unread_order(identity, epoch, read)
        _mark_read(identity, order[: seg["consumed"]], read)
    return _unread_order(blends[-1]["data"], epoch, read)


def _unread_order(identity: dict[str, Any], epoch: int, read: dict[str, np.ndarray]) -> np.ndarray:
    perm = epoch_permutation(int(identity["num_samples"]), int(identity["seed"]), epoch)
    if not read:
        return perm
    source, sample = blend_of(identity).decode(perm)
    keep = np.ones(perm.size, dtype=bool)
    for k, entry in enumerate(identity["sources"]):
        done = read.get(content_key(entry, identity["seq_len"]))
        if done is not None:
            rows = source == k
            keep[rows] = ~done[sample[rows]]
    return perm[keep]


def _mark_read(identity: dict[str, Any], ids: np.ndarray, read: dict[str, np.ndarray]) -> None:
    source, sample = blend_of(identity).decode(ids)
    for k, entry in enumerate(identity["sources"]):
        done = read.setdefault(content_key(entry, identity["seq_len"]), np.zeros(int(entry["num_samples"]), bool))
        done[sample[source == k]] = True


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
