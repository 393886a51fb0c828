"""A Hugging Face ``Trainer`` run, a small Llama, with ftrain's checkpoints and resume:

    torchrun --standalone --nproc-per-node=2 examples/hf_trainer/train.py
    python examples/hf_trainer/train.py                # one process

It saves every 20 steps to runs/hf_trainer/ckpt (verified, committed last) and, run again, goes on
after the newest step that verifies (--steps 80 goes on from 60). Under node agents it also
recovers in-process (``ftrain agent --recovery live --script examples/hf_trainer/train.py ...``): a
lost worker costs the others no restart; their ``train`` runs again for the new round. The lines
marked ``# ftrain`` are all it takes (docs/hf-trainer.md shows them as a diff); the Trainer itself
writes no checkpoints.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

import ftrain  # ftrain
from ftrain.integrations.hf_trainer import FtrainTrainer  # ftrain


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt", default="runs/hf_trainer/ckpt", help="a local directory or s3://bucket/prefix")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="sequences per process and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--samples", type=int, default=4096, help="the data set's size (fewer: more epochs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/hf_trainer/out", help="the Trainer's (logs only)")
    p.add_argument("--final-weights", default="", help="write the model's state here at the end (rank 0)")
    p.add_argument("--metrics", default="", help="rank 0's metrics lines (one per step, with its loss): ftrain report")
    return p.parse_args(argv)


def build_model(seq: int) -> LlamaForCausalLM:
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


class Counting(torch.utils.data.Dataset):
    """Token sequences that count up from a random start: a pattern the model learns in a few steps."""

    def __init__(self, samples: int, seq: int, seed: int):
        starts = torch.randint(0, 256, (samples, 1), generator=torch.Generator().manual_seed(seed))
        self.tokens = (starts + torch.arange(seq)) % 256

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def train(session: ftrain.Session, args: argparse.Namespace, callbacks: Sequence[TrainerCallback]) -> None:
    """One round of training: the Trainer and what it holds are built here (under ``ftrain agent
    --recovery live`` this runs again, in the same process, for each new round)."""
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=10,
        seed=args.seed,
        save_strategy="no",  # ftrain: the Trainer writes no checkpoints of its own
        logging_steps=10,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    torch.manual_seed(args.seed)
    model = build_model(args.seq)
    data = Counting(args.samples, args.seq, args.seed)
    trainer = FtrainTrainer(session, model=model, args=targs, train_dataset=data, callbacks=list(callbacks))  # ftrain
    began = time.perf_counter()
    trainer.train()
    start, world = trainer.ftrain_resumed_step, targs.world_size
    if trainer.is_world_process_zero():
        done = f"resumed after step {start}; " if start else ""
        print(f"{done}trained steps {start + 1}..{args.steps} on {world} process(es) in "
              f"{time.perf_counter() - began:.3f}s", flush=True)  # fmt: skip
        if args.final_weights:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.final_weights)


def main(argv: list[str] | None = None, callbacks: Sequence[TrainerCallback] = ()) -> None:
    args = parse(argv)
    session = ftrain.Session(args.ckpt, interval_steps=args.save_every, metrics_path=args.metrics)  # ftrain
    session.run(lambda s: train(s, args, callbacks))  # ftrain: each round of this process (one under torchrun)


if __name__ == "__main__":
    main()
