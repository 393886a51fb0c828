"""A user's own FSDP2 loop that is not the shipped example (examples/own_loop), for the tests of
live recovery in users' loops: plain ``torch.nn`` modules (no ``transformers``), blocks sharded one
by one, two AdamW parameter groups, gradient accumulation over micro-batches (gradient sync only on
the last), gradient clipping, a warm-up-then-cosine ``LambdaLR``, dropout (each rank's RNG state
kept with ``ftrain.RNGState``), a persistent buffer the loop updates, a ``Stateful`` of its own
(loss statistics, the same on every rank) and ``ftrain.ResumableSampler``. What ftrain takes is the
same few lines as the example's.

    torchrun --standalone --nproc-per-node=2 tests/integration/users_loop/train.py --ckpt CKPT

``--final-weights PATH`` writes the full model state (rank 0), which also prints the statistics as a
last line, so that a run with faults can be compared with a straight one, bit for bit."""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import ftrain

VOCAB, WIDTH, DEPTH, SEQ = 64, 32, 3, 17
#: the learning rate warms up for WARMUP steps, then follows a cosine to a tenth over HORIZON
WARMUP, HORIZON = 5, 60


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.1)  # each rank's own masks: its RNG state is part of the state
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ - 1, WIDTH))
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))  # saved with the model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class LossStats:
    """Running statistics of the loss, averaged over the ranks (so the same on every rank)."""

    def __init__(self) -> None:
        self.count, self.mean, self.best = 0, 0.0, None

    def update(self, loss: float) -> None:
        self.count += 1
        self.mean += (loss - self.mean) / self.count
        self.best = loss if self.best is None else min(self.best, loss)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "best": self.best}

    def load_state_dict(self, sd: dict) -> None:
        self.count, self.mean, self.best = sd["count"], sd["mean"], sd["best"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--micro", type=int, default=2, help="micro-batches a step accumulates")
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="slows each step, so that a fault lands mid-run")
    p.add_argument("--final-weights", default="", help="write the full model state here at the end (rank 0)")
    return p.parse_args()


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2 or n == "pos"]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)

    def factor(s: int) -> float:
        if s < WARMUP:
            return (s + 1) / WARMUP
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - WARMUP) / (HORIZON - WARMUP))))

    return model, optim, torch.optim.lr_scheduler.LambdaLR(optim, factor)


def train(session: ftrain.Session, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, sched = build()
    starts = torch.randint(0, VOCAB, (2048, 1), generator=torch.Generator().manual_seed(3))
    data = (starts + torch.arange(SEQ)) % VOCAB
    sampler = ftrain.ResumableSampler(len(data), 8 * args.micro, seed=4)
    stats = LossStats()
    torch.manual_seed(1000 + rank)  # dropout's generator, each rank its own (a per-rank entry)
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "sampler": sampler,
        "stats": stats,
        "rng": ftrain.RNGState(),
    }
    start = session.load(state)
    source = session.restored.source if session.restored else ""
    print(f"rank {rank} of {world} (pid {os.getpid()}): state of step {start} from {source}", flush=True)
    for step in range(start, args.steps):
        batch = data[sampler.advance(rank, world)]
        total = torch.zeros(())
        for i, micro in enumerate(batch.chunk(args.micro)):
            model.set_requires_gradient_sync(i == args.micro - 1)
            logits = model(micro[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten()) / args.micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad()
        with torch.no_grad():
            model.tokens_seen += batch[:, :-1].numel()
        dist.all_reduce(total)
        stats.update(total.item() / world)
        if args.step_sleep_s:
            time.sleep(args.step_sleep_s)
        session.step(step + 1, state)
    session.finish(args.steps, state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        print(f"final stats {stats.state_dict()} lr {sched.get_last_lr()}", flush=True)
        if args.final_weights:
            torch.save(full, args.final_weights)


def warm_up() -> None:
    """What a spare pays before its round, alone on the CPU: the model built and a step taken."""
    model = Net()
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    torch.optim.AdamW(model.parameters()).step()
    print(f"warmed up (pid {os.getpid()})", flush=True)


def main() -> None:
    args = parse()
    session = ftrain.Session(args.ckpt, interval_steps=args.save_every)
    session.run(lambda s: train(s, args), warm_up=warm_up)


if __name__ == "__main__":
    main()
