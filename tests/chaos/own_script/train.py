"""A user's own training loop in miniature, for the chaos tests of script jobs: a tiny linear model
under DDP (gloo), its data drawn through ftrain.ResumableSampler, saved by ftrain.Session.

``--drop-sample ID`` (or ``OWN_SCRIPT_DROP_SAMPLE=ID`` in its environment) makes its data pipeline
lose that sample (a filter bug): the sampler's global batches come without it, so the steps train
on one sample less and the ledger shows it missing."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ftrain


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="slows each step, so that a fault lands mid-run")
    dropped = int(os.environ.get("OWN_SCRIPT_DROP_SAMPLE", "-1"))
    p.add_argument("--drop-sample", type=int, default=dropped, help="lose this sample id from every batch holding it")
    return p.parse_args()


def drop(sampler: ftrain.ResumableSampler, sample_id: int) -> None:
    """The bug under test: every global batch the sampler hands out comes without ``sample_id``."""
    draw = sampler.cursor.next_global_batch

    def without() -> object:
        batch = draw()
        return dataclasses.replace(batch, sample_ids=batch.sample_ids[batch.sample_ids != sample_id])

    sampler.cursor.next_global_batch = without  # type: ignore[method-assign]


def train(session: ftrain.Session, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    targets = inputs.sum(dim=1, keepdim=True)
    sampler = ftrain.ResumableSampler(len(inputs), global_batch_size=8, seed=2)
    if args.drop_sample >= 0:
        drop(sampler, args.drop_sample)
    state = {"model": model, "optim": optim, "sampler": sampler}
    start = session.load(state)
    for step in range(start, args.steps):
        ids = sampler.advance(rank, world)
        loss = torch.nn.functional.mse_loss(model(inputs[ids]), targets[ids])
        loss.backward()
        optim.step()
        optim.zero_grad()
        time.sleep(args.step_sleep_s)  # the workload's pace (faults land mid-run), not synchronisation
        session.step(step + 1, state)
    session.finish(args.steps, state)


def main() -> None:
    args = parse()
    session = ftrain.Session(args.ckpt, interval_steps=args.save_every, verbose=False)
    session.run(lambda s: train(s, args))


if __name__ == "__main__":
    main()
