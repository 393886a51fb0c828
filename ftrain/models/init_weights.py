"""``model.init_from`` in a job of several ranks whose model is built whole (ddp, zero1): read
once, on rank 0, and sent to the others (the layouts that give each rank part of the model read
it into the parts: :mod:`ftrain.models.init_shards`).

Rank 0 reads and checks the directory (:func:`ftrain.models.hf_weights.load_hf_weights`: every
file read once and hashed as read) into its copy of the model, then sends each tensor of the
model's state dict to the other ranks, over a gloo group (the model is still on the CPU here,
before the strategy moves and shards it). Every rank therefore starts from the same bytes — ranks
that each read the files could load different weights if a file changed between their reads —
and only rank 0's node needs the directory. Rank 0's error (a missing directory, a mismatch, a
damaged file) is raised on every rank, none is left waiting in a broadcast.

The trainer calls this only when no checkpoint step will be loaded
(:func:`ftrain.checkpointing.step_to_resume`): a resume needs neither the directory nor its read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ftrain.config import ConfigError, ModelConfig
from ftrain.models.hf_weights import KEY, load_hf_weights

log = logging.getLogger(__name__)


class InitFromNotReadError(RuntimeError):
    """``model.init_from`` was not read because a checkpoint step was to be resumed, and then no
    step was loaded (every one refused, ``checkpoint.on_no_loadable_step = "fresh"``): the model
    holds random weights, not the ones asked for. Not fatal: the refused steps are marked
    corrupt, so the next start finds none and reads ``model.init_from``."""

    def __init__(self, step: int, uri: str):
        super().__init__(
            f"model.init_from was not read at start because checkpoint step {step} under {uri} was to be "
            "resumed, but no step was loaded: training on would start from random weights, not from "
            "model.init_from. Start the job again (the refused steps are marked corrupt, so it reads "
            "model.init_from), or fix the checkpoint root"
        )


T = TypeVar("T")


def agreed(work: Callable[[], T]) -> list[T]:
    """Collective: ``work()`` on every rank, over a gloo group; each rank's result, or any rank's
    error raised on every rank (its own where it has one), none left waiting in a collective."""
    outcome: tuple[str, Any]
    error: Exception | None = None
    try:
        outcome = ("ok", work())
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        error = e
        outcome = ("error", f"{e}" if isinstance(e, ConfigError) else f"{KEY}: {type(e).__name__}: {e}")
    gathered: list[Any] = [None] * dist.get_world_size()
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        dist.all_gather_object(gathered, outcome, group=group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    for rank, (status, value) in enumerate(gathered):
        if status != "ok":
            if error is not None:
                raise error
            raise ConfigError("", f"{value} (on rank {rank})")
    return [value for _, value in gathered]


def load_initial_weights(model: nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """Collective over the default group: ``cfg.init_from`` into ``model`` on every rank, read on
    rank 0 only; returns the files read -> their sha256 (on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return load_hf_weights(model, cfg)
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        return _load_and_send(model, cfg, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _load_and_send(model: nn.Module, cfg: ModelConfig, group: dist.ProcessGroup | None) -> dict[str, str]:
    files = agreed(lambda: load_hf_weights(model, cfg) if dist.get_rank() == 0 else {})[0]
    sent: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            where = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            if where in sent:  # a tied weight: the same tensor, sent once
                continue
            sent.add(where)
            if tensor.is_contiguous():
                dist.broadcast(tensor, src=0, group=group)
            else:
                whole = tensor.contiguous()
                dist.broadcast(whole, src=0, group=group)
                tensor.copy_(whole)
    return files
