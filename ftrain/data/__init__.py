"""Training data: sample sources, the world-size-independent cursor, and the consumption ledger.

What this package owns and what must stay true:

- A *source* maps a global sample id to one token row of ``seq_len + 1`` tokens (inputs and
  shifted targets). Sample ``i`` is a pure function of the data and ``i``: never of the world
  size, the batch it is drawn in, or the order of the ids asked for.
- The :class:`~ftrain.data.cursor.DataCursor` decides which ids each optimizer step consumes: a
  seeded permutation per epoch, walked ``global_batch_size`` ids at a time. Its checkpointed
  state is only ``(epoch, next_index, step)``, so a run resumed at any world size consumes
  exactly the remaining ids: none skipped, none repeated.
- :func:`~ftrain.data.cursor.micro_batches` splits a global batch into contiguous per-rank
  blocks of micro-batches; gradient accumulation adapts so the global batch stays fixed.
- The optional :class:`~ftrain.data.ledger.Ledger` records what each rank consumed, and
  :func:`~ftrain.data.ledger.check_exactly_once` proves it against a fresh cursor.

The package imports numpy and the standard library only (no torch): the training loop turns the
int64 arrays into tensors.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import numpy as np

from ftrain.config import ConfigError, DataConfig, ModelConfig

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad data or data state (file, sample id, cursor checkpoint); the message names the fix."""


def as_sample_ids(ids: np.ndarray | list[int], num_samples: int, where: str) -> np.ndarray:
    """``ids`` as a 1-D int64 array, each in ``[0, num_samples)``; DataError naming ``where``."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise DataError(f"{where}: sample ids must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{where}: sample ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= num_samples):
        bad = int(arr[(arr < 0) | (arr >= num_samples)][0])
        raise DataError(
            f"{where}: sample id {bad} is out of range [0, {num_samples}); ids come from a "
            f"DataCursor built with num_samples={num_samples}"
        )
    return arr


# Submodules import DataError from here, so it is defined before they are imported.
from ftrain.data.cursor import (  # noqa: E402
    PERM_STREAM,
    DataCursor,
    GlobalBatch,
    MicroBatch,
    accumulation_steps,
    micro_batches,
    micro_block,
    micro_steps,
)
from ftrain.data.ledger import Ledger, LedgerReport, check_exactly_once, read_ledger  # noqa: E402
from ftrain.data.synthetic import CHAIN_STREAM, SAMPLE_STREAM, MarkovSource  # noqa: E402
from ftrain.data.tokens import TokenFileSource, write_token_file  # noqa: E402


@runtime_checkable
class SampleSource(Protocol):
    """What the training loop needs from a data source."""

    num_samples: int
    seq_len: int
    entropy_floor_nats: float | None

    def sample(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``seq_len + 1`` int64 tokens for the given global sample ids."""
        ...


def build_source(data: DataConfig, model: ModelConfig) -> MarkovSource | TokenFileSource:
    """The source named by ``data.source``: the synthetic Markov chain or a token file."""
    if data.source == "synthetic":
        if data.branching > model.vocab_size:
            raise ConfigError(
                "data.branching",
                f"{data.branching} successors per token cannot be distinct in a vocabulary of "
                f"model.vocab_size={model.vocab_size}; set data.branching <= {model.vocab_size}",
            )
        return MarkovSource(
            vocab_size=model.vocab_size,
            seq_len=model.seq_len,
            seed=data.seed,
            num_samples=data.num_samples,
            branching=data.branching,
            concentration=data.concentration,
        )
    return TokenFileSource(data.source, model.seq_len, model.vocab_size, data.token_dtype)


__all__ = [
    "CHAIN_STREAM",
    "PERM_STREAM",
    "SAMPLE_STREAM",
    "DataCursor",
    "DataError",
    "GlobalBatch",
    "Ledger",
    "LedgerReport",
    "MarkovSource",
    "MicroBatch",
    "SampleSource",
    "TokenFileSource",
    "accumulation_steps",
    "build_source",
    "check_exactly_once",
    "micro_batches",
    "micro_block",
    "micro_steps",
    "read_ledger",
    "write_token_file",
]
