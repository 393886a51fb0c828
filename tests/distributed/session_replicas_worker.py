"""Run under torchrun (3 gloo ranks): a user's data-parallel loop through :meth:`ftrain.Session.run`
with the replica check at every step (``replica_check_steps=1``) and the policy named on the
command line (``rollback``, ``halt``; ``straight``: no corruption, the reference run). Unless
straight, rank 2 corrupts one of its parameters once, after step 5's update: its replicas then
differ from the other two ranks'.

The loop averages gradients itself (what DDP does, without its buckets) and saves every 2 steps.
Rank 0 writes ``$OUT``: the final parameters (as lists of floats) and how many times ``train``
ran."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import ftrain
from ftrain.distributed import exit_without_teardown

STEPS = 8
CORRUPT_AFTER_STEP, CORRUPT_RANK = 5, 2
runs = 0
corrupted = False


def train(session: ftrain.Session) -> None:
    global runs, corrupted
    runs += 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    sampler = ftrain.ResumableSampler(96, 6, seed=1)
    data = torch.randn(96, 8, generator=torch.Generator().manual_seed(2))
    state = {"model": model, "optim": optim, "sampler": sampler}
    rank, world = session.rank, session.world_size
    for step in range(session.load(state) + 1, STEPS + 1):
        batch = data[sampler.advance(rank, world)]
        model(batch).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        optim.zero_grad()
        if sys.argv[1] != "straight" and step == CORRUPT_AFTER_STEP and rank == CORRUPT_RANK and not corrupted:
            corrupted = True
            with torch.no_grad():
                model[0].weight.view(-1)[3] += 0.25  # a silent corruption: finite, plausible
        session.step(step, state)
    session.finish(STEPS, state)
    if rank == 0:
        final = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
        with open(os.environ["OUT"], "w") as f:
            json.dump({"final": final, "runs": runs}, f)


if __name__ == "__main__":
    policy = "halt" if sys.argv[1] == "straight" else sys.argv[1]
    session = ftrain.Session(
        sys.argv[2],
        interval_steps=2,
        async_save=False,
        replica_check_steps=1,
        on_replica_mismatch=policy,
        verbose=False,
    )
    session.run(train)
    exit_without_teardown(0)
