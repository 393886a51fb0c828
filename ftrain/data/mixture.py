"""A weighted mixture of token files (``[[data.sources]]``): Megatron's blend, as one sample source.

The mixture is a source of ``N`` global ids (``data.mixture_samples``, 0: the sources' samples
together), and the :class:`~ftrain.data.cursor.DataCursor` walks them like any other source's:
its seeded per-epoch permutation, its ``(epoch, next_index)`` state, its resume at any world size.
The :class:`BlendIndex` maps each id to one sample of one source:

- **Which source.** Source ``k`` owns the contiguous block ``[offset_k, offset_k + count_k)`` of
  ids, ``count_k`` its share ``weight_k / sum(weights)`` of ``N`` rounded by largest remainder
  (the counts sum to ``N``; each is within 1 of its exact share). The cursor's permutation
  interleaves the blocks, so the ids of any stretch of training are a uniform draw without
  replacement from the epoch: a source's realised share over ``m`` samples is hypergeometric
  around its weight, its variance at most the binomial ``p(1-p)/m``. (Megatron interleaves the
  sources greedily because its sampler reads the blend in order; this cursor never does.)
- **Which sample.** Draw ``j`` of source ``k`` (``j = id - offset_k``) is in pass
  ``q = j // n_k`` over the source's ``n_k`` samples. A full pass takes every sample once
  (sample ``j mod n_k``); the last, partial pass of ``r = count_k mod n_k`` draws takes a
  seeded random subset of ``r`` distinct samples. So in one mixture epoch a source whose share
  equals its size is read exactly once; an upsampled one (``count_k > n_k``) ``floor`` or
  ``ceil(count_k / n_k)`` times per sample; a downsampled one (``count_k < n_k``) a seeded
  subset, the same in every epoch (the blend is fixed): raise ``data.mixture_samples`` so that
  its share covers it.

What must stay true: :meth:`BlendIndex.decode` is a pure function of the sources' sample counts,
the weights, ``data.seed`` and ``N`` -- never of the world size or of which ids are asked
together -- so a ledger of global ids decodes, after the fact, to the ``(source, sample)`` pairs
that training read (:func:`~ftrain.data.ledger.check_exactly_once` with ``sources=``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ftrain.config import ConfigError, DataConfig
from ftrain.data.errors import DataError, as_sample_ids
from ftrain.data.tokens import TokenFileSource

logger = logging.getLogger(__name__)

#: SeedSequence stream of the partial passes' subsets (distinct from the cursor's and the chain's).
MIX_STREAM = 0x4D495820  # "MIX "


@dataclass(frozen=True)
class SourceSpec:
    """One ``[[data.sources]]`` table, checked by :class:`~ftrain.config.DataConfig`."""

    path: str
    weight: float
    token_dtype: str = "auto"


def source_specs(data: DataConfig) -> list[SourceSpec]:
    """The ``[[data.sources]]`` tables as specs (a source's ``token_dtype`` defaults to ``data.token_dtype``)."""
    return [
        SourceSpec(str(s["path"]), float(s["weight"]), str(s.get("token_dtype", data.token_dtype)))
        for s in data.sources
    ]


def blend_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Each source's draws out of ``total``: ``weight / sum`` of it, rounded by largest remainder
    (ties to the earlier source), so that they sum to ``total`` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not w.size or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"blend weights must be finite numbers > 0, got {list(weights)}")
    w = w / w.max()  # huge weights do not overflow the sum
    share = w / w.sum() * total
    counts = np.floor(share).astype(np.int64)
    short = int(total - counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:short]] += 1
    return counts


class BlendIndex:
    """Global id -> (source index, sample index of that source); see the module's docstring."""

    def __init__(self, source_samples: Sequence[int], weights: Sequence[float], total: int, seed: int):
        if len(source_samples) != len(weights) or not len(weights):
            raise DataError(f"a blend needs one weight per source, got {len(weights)} for {len(source_samples)}")
        if any(int(n) < 1 for n in source_samples):
            raise DataError(f"every blended source needs at least one sample, got {list(source_samples)}")
        self.source_samples = np.asarray(source_samples, dtype=np.int64)
        self.total = int(total)
        self.seed = int(seed)
        self.counts = blend_counts(weights, self.total)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.full_passes = self.counts // self.source_samples
        #: source -> the sorted sample indices its last, partial pass draws
        self._partial = [self._partial_pass(k) for k in range(len(self.counts))]

    def _partial_pass(self, k: int) -> np.ndarray:
        n, rest = int(self.source_samples[k]), int(self.counts[k] % self.source_samples[k])
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, MIX_STREAM, k]))
        picked = rng.choice(n, size=rest, replace=False, shuffle=False) if rest else np.empty(0, np.int64)
        out = np.sort(picked).astype(np.int64)  # sorted: the reads of a pass go forward in the file
        out.setflags(write=False)
        return out

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, sample)`` int64 arrays for global ids in ``[0, total)``."""
        ids = as_sample_ids(ids, self.total, "data.sources blend")
        source = np.searchsorted(self.offsets, ids, side="right") - 1
        draw = ids - self.offsets[source]
        n = self.source_samples[source]
        sample = draw % n
        partial = draw // n >= self.full_passes[source]
        for k in np.unique(source[partial]).tolist():
            rows = partial & (source == k)
            sample[rows] = self._partial[k][sample[rows]]
        return source.astype(np.int64), sample.astype(np.int64)


class MixtureSource:
    """A :class:`BlendIndex` over :class:`~ftrain.data.tokens.TokenFileSource` files; ``sample(ids)``
    returns ``(len(ids), seq_len + 1)`` int64 rows, each read from the source its id decodes to."""

    #: Real text has no known optimum.
    entropy_floor_nats: float | None = None

    def __init__(self, specs: Sequence[SourceSpec], seq_len: int, vocab_size: int, seed: int, num_samples: int = 0):
        if not specs:
            raise ConfigError("data.sources", "a mixture needs at least one [[data.sources]] table")
        self.specs = tuple(specs)
        self.sources = [
            TokenFileSource(s.path, seq_len, vocab_size, s.token_dtype, dtype_key=f"data.sources[{k}].token_dtype")
            for k, s in enumerate(self.specs)
        ]
        self.seq_len = int(seq_len)
        sizes = [s.num_samples for s in self.sources]
        self.num_samples = int(num_samples) or sum(sizes)
        self.blend = BlendIndex(sizes, [s.weight for s in self.specs], self.num_samples, seed)
        for k, (spec, count) in enumerate(zip(self.specs, self.blend.counts.tolist(), strict=True)):
            if count == 0:
                raise ConfigError(
                    f"data.sources[{k}].weight",
                    f"{spec.weight:g} gives {spec.path!r} no sample of the mixture's {self.num_samples} per epoch; "
                    "raise its weight or data.mixture_samples",
                )
            logger.info(
                "data source %d %s: weight %g, %d of %d samples per epoch (%.3g passes over its %d)",
                k,
                spec.path,
                spec.weight,
                count,
                self.num_samples,
                count / sizes[k],
                sizes[k],
            )

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.path!r}: {c}" for s, c in zip(self.specs, self.blend.counts.tolist(), strict=True))
        return f"MixtureSource(num_samples={self.num_samples}, seq_len={self.seq_len}, draws={{{parts}}})"

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.specs)

    @property
    def source_samples(self) -> tuple[int, ...]:
        return tuple(s.num_samples for s in self.sources)

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, sample)`` of each global id (:meth:`BlendIndex.decode`)."""
        return self.blend.decode(ids)

    def sample(self, ids: np.ndarray) -> np.ndarray:
        """Token rows for global sample ids: int64 of shape ``(len(ids), seq_len + 1)``."""
        source, index = self.blend.decode(ids)
        rows = np.empty((len(source), self.seq_len + 1), dtype=np.int64)
        for k in np.unique(source).tolist():
            at = source == k
            rows[at] = self.sources[k].sample(index[at])
        return rows
