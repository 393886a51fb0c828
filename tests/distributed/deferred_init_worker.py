"""Run under torchrun (4 gloo ranks): ``deferred_init_worker.py ARCHS LAYOUT...``: for each arch of
ARCHS (one, or several joined by commas: one launch for them all) and each layout named on the
command line, build the model deferred, make it parallel, and compare every parameter (gathered
whole) with a whole build of the same seed; one JSON list per rank in ``$OUT`` (rank 0 writes
them), an entry per arch and layout: {"arch", "layout", "deferred", "different", "params"}."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ftrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from ftrain.distributed import exit_without_teardown, shutdown_distributed
from ftrain.model import build_model
from ftrain.models.deferred_init import is_deferred, own_name
from ftrain.parallel.parallelize import build_for, parallelize
from ftrain.parallel.strategies import compute_layout

LAYOUTS = {
    "fsdp": ParallelConfig(strategy="fsdp"),
    "zero2": ParallelConfig(strategy="zero2"),
    "hsdp": ParallelConfig(strategy="hsdp", shard_size=2),
    "tp": ParallelConfig(strategy="tp"),
    "fsdp+tp": ParallelConfig(strategy="fsdp+tp", tp_size=2),
    "pp-fsdp": ParallelConfig(strategy="fsdp", pp_size=2),
    "pp-ddp": ParallelConfig(strategy="ddp", pp_size=2),
}


def check(name: str, model_cfg: ModelConfig) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = Config(model=model_cfg, parallel=LAYOUTS[name], train=TrainConfig(global_batch_size=8, micro_batch_size=1))
    layout = compute_layout(cfg.parallel, world_size=world, rank=rank, local_world_size=world, n_head=model_cfg.n_head)
    torch.manual_seed(7)
    whole = dict(build_model(model_cfg).named_parameters())
    torch.manual_seed(7)
    model = build_for(model_cfg, layout)
    deferred = is_deferred(model)
    par = parallelize(model, cfg, layout, torch.device("cpu"), torch.float32, 8 // layout.dp_size)
    different, seen = [], 0
    for fqn, param in par.model.named_parameters():
        own = own_name(fqn)
        value = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        seen += 1
        if not torch.equal(value, whole[own].detach()):
            different.append(own)
    return {"arch": model_cfg.arch, "layout": name, "deferred": deferred, "different": different, "params": seen}


def main() -> None:
    dist.init_process_group("gloo")
    results = []
    for arch in sys.argv[1].split(","):
        model_cfg = ModelConfig(arch=arch, vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=32)
        results += [check(name, model_cfg) for name in sys.argv[2:]]
    write_gathered(results)


def write_gathered(results: list) -> None:
    """Every rank's ``results``, gathered, as one JSON list (by rank) in ``$OUT`` on rank 0; then
    this rank leaves the process group (after a barrier: see shutdown_distributed)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(os.environ["OUT"], "w") as f:
            json.dump(gathered, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
