"""``model.init_from`` is read only when no checkpoint step will be loaded: a resume neither needs
the directory nor reads it; a start whose steps all turn out unloadable says so rather than
train from random weights. The trainer runs in this process, as a world of one on gloo."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

from ftrain.checkpoint.manifest import step_dir_name  # noqa: E402
from ftrain.config import Config, load_config  # noqa: E402
from ftrain.models.init_weights import InitFromNotReadError  # noqa: E402
from ftrain.testbed.jobs import TINY_CONFIG  # noqa: E402
from ftrain.train import Trainer  # noqa: E402

LLAMA = ["--model.arch=llama", "--model.n_kv_heads=2", "--model.ffn_dim=64"]


@pytest.fixture
def world_of_one() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGTERM)  # Trainer.run installs its own
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGTERM, handler)


def config(tmp_path: Path, *overrides: str) -> Config:
    path = tmp_path / "job.toml"
    path.write_text(TINY_CONFIG.replace('progress = "lines"', 'progress = "off"'))
    common = [
        *LLAMA,
        f"--model.init_from={tmp_path / 'init'}",
        f"--checkpoint.uri={tmp_path / 'ckpt'}",
        "--checkpoint.async_mode=off",
        "--checkpoint.interval=2",
        "--train.on_schedule_change=rescale",
        "--train.global_batch_size=4",
    ]
    return load_config(path, [*common, *overrides])


def run(cfg: Config) -> Trainer:
    trainer = Trainer(cfg, torch.device("cpu"), torch.float32, 0, 1, 1)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def test_a_resume_needs_no_init_from_and_a_fresh_start_after_refusals_says_so(tmp_path, world_of_one):
    cfg = config(tmp_path, "--train.steps=2")
    torch.manual_seed(11)
    hf = LlamaForCausalLM(  # the built-in llama's shapes, as a Hugging Face checkpoint
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=16,
            rope_theta=cfg.model.rope_theta,
            rms_norm_eps=cfg.model.norm_eps,
        )
    )
    hf.save_pretrained(tmp_path / "init")
    first = Trainer(cfg, torch.device("cpu"), torch.float32, 0, 1, 1)
    try:
        assert first.init_from_skipped_for == -1  # nothing to resume: init_from is read
        assert torch.equal(first.par.model.module.tok_emb.weight, hf.model.embed_tokens.weight)
        first.run()
    finally:
        first.close()
    assert (tmp_path / "ckpt" / step_dir_name(2)).is_dir()

    shutil.move(tmp_path / "init", tmp_path / "elsewhere")  # gone, as docs/models.md allows on a resume
    resumed = run(config(tmp_path, "--train.steps=4"))
    assert resumed.init_from_skipped_for == 2 and resumed.cursor.step == 4

    for step in (2, 4):  # every committed step damaged: with on_no_loadable_step=fresh, a fresh start
        for shard in (tmp_path / "ckpt" / step_dir_name(step)).glob("*.distcp"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
    fresh = config(tmp_path, "--train.steps=6", "--checkpoint.on_no_loadable_step=fresh")
    with pytest.raises(InitFromNotReadError, match=r"model.init_from was not read at start because checkpoint step 4"):
        run(fresh)
    shutil.move(tmp_path / "elsewhere", tmp_path / "init")
    again = Trainer(fresh, torch.device("cpu"), torch.float32, 0, 1, 1)  # the steps are marked corrupt now
    try:
        assert again.init_from_skipped_for == -1
        assert torch.equal(again.par.model.module.tok_emb.weight, hf.model.embed_tokens.weight)
    finally:
        again.close()
