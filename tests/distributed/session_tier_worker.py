"""Run under torchrun (4 gloo ranks): a user's loop state (a model spread over the ranks, its
optimizer, a sampler) through the memory tier as :class:`ftrain.Session` uses it
(:class:`ftrain.session_tier.SessionTierView`), for each layout named on the command line.

Beside the layouts, ``stages``: two pipeline-like stages of plain parameters (no DTensor), each
held by two ranks, which the loop says are not replicas (``Session(replicated=False)``).

Per layout: two steps trained, a snapshot taken (this rank's shards and a copy of its buddy's),
two more steps (the state moves on), then rank 1 becomes a new process (it holds no snapshot) and
every rank restores. Rank 1's shards can only come from its buddy's copy. Each rank compares what
it holds after the restore with what it held at the snapshot, bit for bit: every local shard of
the model and the optimizer, the sampler's state, and its own RNG state (each rank's differs: a
per-rank entry, rank 1's from its buddy's copy). One JSON list per rank on rank 0:
{"layout", "restored_step", "different", "tensors", "sampler_equal", "rng_equal", "rng_draw", "rank1_held"}.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import ftrain
from ftrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from ftrain.distributed import exit_without_teardown
from ftrain.model import build_model
from ftrain.parallel.parallelize import parallelize
from ftrain.parallel.strategies import compute_layout
from ftrain.recovery.memory_tier import MemoryTier
from ftrain.session_state import StateParts
from ftrain.session_tier import SessionTierView
from tests.distributed.deferred_init_worker import write_gathered

LAYOUTS = {
    "fsdp": ParallelConfig(strategy="fsdp"),
    "tp": ParallelConfig(strategy="tp"),
    "fsdp+tp": ParallelConfig(strategy="fsdp+tp", tp_size=2),
    "hsdp": ParallelConfig(strategy="hsdp", shard_size=2),
}
#: beside the layouts: pipeline-like stages of plain parameters (:class:`Stage`)
STAGES = "stages"


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _tensors(parts: StateParts) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds of the model and its optimizer (local shards), cloned."""
    out, names = {}, {}
    for name, param in parts.module.named_parameters():  # type: ignore[union-attr]
        out[f"param.{name}"] = _local(param).detach().clone()
        names[id(param)] = name
    for optimizer in parts.optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{names[id(param)]}.{key}"] = _local(value).detach().clone()
    return out


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: ftrain.ResumableSampler) -> None:
    tokens = (torch.arange(4 * 17).reshape(4, 17) + 3 * sampler.advance(0, 1)[0]) % 64
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


class Stage(torch.nn.Module):
    """One of two pipeline-like stages (ranks 0 and 2 hold stage 0, 1 and 3 stage 1): plain
    parameters, under names only that stage uses, different on each stage."""

    def __init__(self, stage: int):
        super().__init__()
        torch.manual_seed(20 + stage)
        self.stages = torch.nn.ModuleDict({f"s{stage}": torch.nn.Linear(8, 8)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        (layer,) = self.stages.values()
        return layer(torch.nn.functional.one_hot(tokens % 8, 8).float()).repeat(1, 1, 8)


def _model(name: str, rank: int, world: int) -> torch.nn.Module:
    if name == STAGES:
        return Stage(rank % 2)
    model_cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    cfg = Config(model=model_cfg, parallel=LAYOUTS[name], train=TrainConfig(global_batch_size=8, micro_batch_size=1))
    layout = compute_layout(cfg.parallel, world_size=world, rank=rank, local_world_size=2, n_head=model_cfg.n_head)
    torch.manual_seed(11)
    return parallelize(build_model(model_cfg), cfg, layout, torch.device("cpu"), torch.float32, 1).model


def check(name: str) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(name, rank, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ftrain.ResumableSampler(1000, 8, seed=3)
    state = {"model": model, "optim": optimizer, "sampler": sampler, "rng": ftrain.RNGState()}
    parts = StateParts.of(state, spread=name == STAGES)  # Session(replicated=False) for a pipeline
    assert parts.replicated is False, "a spread state is never taken for replicas"
    torch.manual_seed(1000 + rank)  # each rank's own generator: a per-rank entry of the snapshot

    tier = MemoryTier(Config(parallel=ParallelConfig(timeout_s=120), others={"agent": {"job": "session-tier"}}))
    tier.join_round(rank, world, 2, "cpu")
    view = SessionTierView(parts, torch.device("cpu"), rank, world, 1, binding=tier.binding)
    for _ in range(2):
        _train(model, optimizer, sampler)
    view.mark(2, parts, parts.user_state(2), 0.01)
    tier.maybe_snapshot(2, view, checkpointed=True)
    tier.wait_staged()
    at_snapshot, sampler_then, rng_then = _tensors(parts), sampler.state_dict(), torch.get_rng_state()
    tier.wait()
    for _ in range(2):  # the state moves on: what the restore puts back must be the snapshot's
        _train(model, optimizer, sampler)
        torch.rand(5)
    held = len(tier.snapshots)
    if rank == 1:  # a new process: its own files of the snapshot are gone, its buddy keeps a copy
        tier.snapshots = []
    restored = tier.restore(view, committed_step=-1)
    now = _tensors(parts)
    different = sorted(k for k in at_snapshot if k not in now or not torch.equal(at_snapshot[k], now[k]))
    tier.close()
    return {
        "layout": name,
        "restored_step": restored,
        "different": different,
        "tensors": len(at_snapshot),
        "sampler_equal": sampler.state_dict() == sampler_then,
        "rng_equal": torch.equal(torch.get_rng_state(), rng_then),
        "rng_draw": torch.rand(1).item(),
        "rank1_held": held if rank == 1 else -1,
    }


def main() -> None:
    dist.init_process_group("gloo")
    write_gathered([check(name) for name in sys.argv[1:]])


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
