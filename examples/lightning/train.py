"""A Lightning Fabric training loop (a small MLP under DDP) with ftrain's checkpoints:

    torchrun --standalone --nproc-per-node=2 examples/lightning/train.py

It saves every 20 steps to runs/lightning/ckpt (verified, committed last) and, run again, resumes
from the newest step that verifies, at any number of processes (--steps 80 goes on from 60).
Under node agents it recovers in-process too (``ftrain agent --recovery live --script
examples/lightning/train.py ...``): ``train`` runs again for each new round, with a Fabric built
for that round's process group. The lines marked ``# ftrain`` are all it takes (docs/lightning.md).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import ftrain  # ftrain
from ftrain.integrations.lightning import session_fabric, session_state  # ftrain


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt", default="runs/lightning/ckpt", help="a local directory or s3://bucket/prefix")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="global batch size (samples per step)")
    p.add_argument("--width", type=int, default=512, help="the MLP's hidden width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="ddp", help="Fabric's strategy (ddp; auto on one process)")
    p.add_argument("--final-weights", default="", help="write the model's state_dict here at the end (rank 0)")
    p.add_argument("--metrics", default="", help="rank 0's metrics lines, with the loss (what `ftrain report` reads)")
    return p.parse_args(argv)


def build_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def dataset(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a smooth target of them: a function the model fits in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=g)
    w = torch.randn(32, 1, generator=g) / 4
    return x, torch.sin(x @ w) + 0.5 * (x[:, :1] * x[:, 1:2])


def train(session: ftrain.Session, args: argparse.Namespace) -> None:
    """One round of training: the Fabric and everything that depends on the world size are built here."""
    fabric = session_fabric(session, strategy=args.strategy)  # ftrain: a Fabric on this round's process group
    rank, world = fabric.global_rank, fabric.world_size
    torch.manual_seed(args.seed)
    module = build_model(args.width)
    optim = torch.optim.AdamW(module.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    model, optimizer = fabric.setup(module, optim)
    x, y = dataset(4096, args.seed)
    sampler = ftrain.ResumableSampler(len(x), args.batch, seed=args.seed)  # ftrain
    state = session_state(model, optimizer, sched=sched, sampler=sampler)  # ftrain: the unwrapped model, optimizer
    start = session.load(state)  # ftrain: 0, or the step it goes on from (a live peer's, or a checkpoint's)
    source = session.restored.source if session.restored else ""  # live_peer, memory, storage or fresh
    print(f"rank {rank} of {world} (pid {os.getpid()}): state of step {start} from {source}", flush=True)
    if rank == 0:
        done = f"resumed after step {start}; " if start else ""
        print(f"{done}training steps {start + 1}..{args.steps} on {world} process(es)", flush=True)
    began = time.perf_counter()
    for step in range(start, args.steps):
        idx = sampler.advance(rank, world)  # this rank's share of the step's global batch
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        fabric.backward(loss)
        optimizer.step()
        sched.step()
        optimizer.zero_grad()
        # ftrain: heartbeat, a metrics line, a save every --save-every steps, a new round
        session.step(step + 1, state, metrics={"loss": loss.detach()})
        if rank == 0 and ((step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    session.finish(args.steps, state)  # ftrain: the last step saved and committed
    if rank == 0:
        print(f"done: {args.steps - start} steps in {time.perf_counter() - began:.3f}s", flush=True)
        if args.final_weights:
            torch.save(state["model"].state_dict(), args.final_weights)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    session = ftrain.Session(args.ckpt, interval_steps=args.save_every, metrics_path=args.metrics)  # ftrain
    session.run(lambda s: train(s, args))  # ftrain: each round of this process (one under torchrun)


if __name__ == "__main__":
    main()
