"""A plain PyTorch training loop, a small Hugging Face Llama under FSDP2, with ftrain's checkpoints:

    torchrun --standalone --nproc-per-node=2 examples/own_loop/train.py

It saves every 20 steps to runs/own_loop/ckpt (verified, committed last) and, run again, resumes
from the newest step that verifies, at any number of processes (--steps 80 goes on from 60).
Under node agents it also recovers in-process (``ftrain agent --recovery live --script
examples/own_loop/train.py ...``): a lost worker or node costs no restart of the others, whose
``train`` runs again for the new round. The lines marked ``# ftrain`` are all it takes
(docs/library.md shows them as a diff).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

import ftrain  # ftrain


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt", default="runs/own_loop/ckpt", help="a local directory or s3://bucket/prefix")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch size (sequences per step)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp", help="how the model is spread over ranks")
    p.add_argument("--memory-dir", default="", help="a node's tmpfs (/dev/shm) keeping the memory tier's snapshots")
    p.add_argument("--final-weights", default="", help="write the full model state here at the end (rank 0)")
    p.add_argument("--metrics", default="", help="rank 0's metrics lines, with the loss (what `ftrain report` reads)")
    return p.parse_args(argv)


def llama(seq: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def build_model(seq: int, parallel: str) -> torch.nn.Module:
    model = llama(seq)
    if parallel == "ddp":
        return DistributedDataParallel(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def dataset(samples: int, seq: int, seed: int) -> torch.Tensor:
    """Token sequences that count up from a random start: a pattern the model learns in a few steps."""
    starts = torch.randint(0, 256, (samples, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(seq)) % 256


def train(session: ftrain.Session, args: argparse.Namespace) -> None:
    """One round of training: everything that depends on the world size is built here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build_model(args.seq, args.parallel)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    data = dataset(4096, args.seq, args.seed)
    sampler = ftrain.ResumableSampler(len(data), args.batch, seed=args.seed)  # ftrain
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler}  # ftrain
    start = session.load(state)  # ftrain: 0, or the step it goes on from (a live peer's, or a checkpoint's)
    source = session.restored.source if session.restored else ""  # live_peer, memory, storage or fresh
    print(f"rank {rank} of {world} (pid {os.getpid()}): state of step {start} from {source}", flush=True)
    if rank == 0:
        done = f"resumed after step {start}; " if start else ""
        print(f"{done}training steps {start + 1}..{args.steps} on {world} process(es)", flush=True)
    began = time.perf_counter()
    for step in range(start, args.steps):
        batch = data[sampler.advance(rank, world)]  # this rank's share of the step's global batch
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        # ftrain: heartbeat, a metrics line, a save every --save-every steps, a new round
        session.step(step + 1, state, metrics={"loss": loss.detach()})
        if rank == 0 and ((step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    session.finish(args.steps, state)  # ftrain: the last step saved and committed
    if rank == 0:
        print(f"done: {args.steps - start} steps in {time.perf_counter() - began:.3f}s", flush=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and args.final_weights:
        torch.save(full, args.final_weights)


def warm_up(seq: int) -> None:
    """What a spare pays before it is given a round (live recovery): the imports, the model built
    and a step taken, alone on the CPU. Nothing is kept; its first round then starts warm."""
    model = llama(seq)
    batch = torch.zeros(1, seq, dtype=torch.long)
    model(input_ids=batch, labels=batch).loss.backward()
    torch.optim.AdamW(model.parameters()).step()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    session = ftrain.Session(  # ftrain
        args.ckpt, interval_steps=args.save_every, memory_dir=args.memory_dir, metrics_path=args.metrics
    )
    # ftrain: each round of this process (one under torchrun); a spare warms up before its first
    session.run(lambda s: train(s, args), warm_up=lambda: warm_up(args.seq))


if __name__ == "__main__":
    main()
