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
- A mixture of token files (``[[data.sources]]``, :mod:`ftrain.data.mixture`) is one more
  source: a fixed blend index maps each global id to ``(source, sample)``, so the cursor, the
  resume and the ledger work on it unchanged.
- The data's identity (:mod:`ftrain.data.identity`: sources by content, weights, order, seed)
  rides in the cursor's checkpoint: a resume on other data is refused, or, with
  ``data.on_mixture_change = "new_blend"``, goes on without re-reading what this epoch read.
- A token file carries a record beside it (:mod:`ftrain.data.token_record`: dtype, token count,
  vocabulary), checked when it is opened.
- The optional :class:`~ftrain.data.ledger.Ledger` records what each rank consumed, and
  :func:`~ftrain.data.ledger.check_exactly_once` proves it against a fresh cursor (and, given a
  mixture, that every sample of every source was read as often as its share says).
- ``ftrain data tokenize`` (:mod:`ftrain.data.tokenize`, imported only by that command) writes
  token files from text with a Hugging Face tokenizer.

The package imports numpy, xxhash and the standard library only (no torch): the training loop turns the
int64 arrays into tensors.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import numpy as np

from ftrain.config import ConfigError, DataConfig, ModelConfig
from ftrain.data.cursor import (
    PERM_STREAM,
    DataCursor,
    GlobalBatch,
    MicroBatch,
    accumulation_steps,
    micro_batches,
    micro_block,
    micro_steps,
)
from ftrain.data.errors import DataError, as_sample_ids
from ftrain.data.identity import DataChangeError, data_digest, identity_of
from ftrain.data.ledger import Ledger, LedgerReport, SourceCoverage, check_exactly_once, read_ledger
from ftrain.data.mixture import BlendIndex, MixtureSource, SourceSpec, source_specs
from ftrain.data.synthetic import CHAIN_STREAM, SAMPLE_STREAM, MarkovSource
from ftrain.data.tokens import TokenFileSource, write_token_file

logger = logging.getLogger(__name__)


@runtime_checkable
class SampleSource(Protocol):
    """What the training loop needs from a data source."""

    num_samples: int
    seq_len: int
    entropy_floor_nats: float | None

    def sample(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``seq_len + 1`` int64 tokens for the given global sample ids."""
        ...


#: the sources :func:`build_source` builds (each a :class:`SampleSource`)
Source = MarkovSource | TokenFileSource | MixtureSource


def build_source(data: DataConfig, model: ModelConfig) -> Source:
    """The source the config names: a ``data.sources`` mixture, else ``data.source`` (the synthetic
    Markov chain or a token file)."""
    if data.document_token >= model.vocab_size:
        raise ConfigError(
            "data.document_token",
            f"{data.document_token} is not a token of model.vocab_size={model.vocab_size}; set model.vocab_size "
            "to the tokenizer's vocabulary size",
        )
    if data.sources:
        return MixtureSource(source_specs(data), model.seq_len, model.vocab_size, data.seed, data.mixture_samples)
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
    "BlendIndex",
    "DataChangeError",
    "DataCursor",
    "DataError",
    "GlobalBatch",
    "Ledger",
    "LedgerReport",
    "MarkovSource",
    "MicroBatch",
    "MixtureSource",
    "SampleSource",
    "Source",
    "SourceCoverage",
    "SourceSpec",
    "TokenFileSource",
    "accumulation_steps",
    "as_sample_ids",
    "build_source",
    "check_exactly_once",
    "data_digest",
    "identity_of",
    "micro_batches",
    "micro_block",
    "micro_steps",
    "read_ledger",
    "source_specs",
    "write_token_file",
]
