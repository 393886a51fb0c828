"""The plain PyTorch loop bench/models.py sets beside ``ftrain train``: the same model class
(``ftrain.models.llama.Llama``), batch, token shapes and optimizer, none of ftrain's runtime.

    torchrun --standalone --nproc-per-node=2 bench/lib/models_plain.py --model JSON --strategy ddp|fsdp|tp
        --global-batch 4 --micro-batch 2 --steps 10 --out result.json

- ddp: ``DistributedDataParallel(model)`` (``gradient_as_bucket_view=True``, ``no_sync`` for all
  but the last micro-batch);
- fsdp: FSDP2 ``fully_shard`` on each block, then on the root;
- tp: ``parallelize_module`` over every rank, q/k/v/gate/up colwise, o/down rowwise (the rest
  replicated); every rank runs the whole batch.

Each step: ``global_batch / (micro_batch x dp)`` micro-batches of random tokens (``seq_len + 1``
ids: inputs and shifted targets), cross-entropy in fp32, gradient clipping to 1.0, AdamW (weight
decay on matrices but the embedding, as ftrain's groups), ``zero_grad(set_to_none=True)``, the
loss read back. Rank 0 writes each step's end time (``time.time()``), its own step time, its
loss, and every rank's peak RSS to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if not (p.dim() >= 2 and id(p) not in embeddings)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ for replicated tensors beside TP's DTensors (it refuses the mix)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    squares = []
    for kind in (True, False):
        part = [g for g in grads if isinstance(g, DTensor) == kind]
        if part:
            norm = torch.nn.utils.get_total_norm(part)
            squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = float(torch.stack(squares).sum().sqrt())
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    p.add_argument("--strategy", choices=("ddp", "fsdp", "tp"), required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from ftrain.config import ModelConfig
    from ftrain.distributed import shutdown_distributed
    from ftrain.models.llama import Llama

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(**json.loads(args.model))
    torch.manual_seed(0)
    model: nn.Module = Llama(cfg)
    dp, dp_rank = (1, 0) if args.strategy == "tp" else (world, rank)
    if args.strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        if args.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan: dict = {}
            for i in range(cfg.n_layer):
                plan |= {
                    f"blocks.{i}.{n}": ColwiseParallel() for n in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
                }
                plan |= {f"blocks.{i}.{n}": RowwiseParallel() for n in ("attn.o", "mlp.down")}
            model = parallelize_module(model, mesh, plan)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    accum = max(1, args.global_batch // (args.micro_batch * dp))
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    pool = torch.randint(0, cfg.vocab_size, (16, accum, args.micro_batch, cfg.seq_len + 1), generator=gen)

    ends, step_s, losses = [], [], []
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = torch.zeros(())
        for i in range(accum):
            tokens = pool[step % len(pool), i]
            last = i == accum - 1
            if args.strategy == "fsdp":
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            sync = model.no_sync() if args.strategy == "ddp" and not last else contextlib.nullcontext()  # type: ignore[operator]
            with sync:
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                (loss / accum).backward()
            total += loss.detach() / accum
        _grad_norm(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        step_s.append(time.perf_counter() - t0)
        ends.append(time.time())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks: list = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        result = {"end_times": ends, "step_time_s": step_s, "losses": losses, "peak_rss_per_rank": peaks}
        with open(args.out, "w") as f:
            json.dump(result, f)
    shutdown_distributed()  # a barrier first: a rank that destroys its group early can abort its peer


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
