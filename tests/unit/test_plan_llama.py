"""ftrain plan for the built-in Llama: parameter counts from the meta build (Llama 3's published
8B and 70B), the activation formula against the tensors autograd saves, and the plan for 8B and
70B on 80 GiB devices against a hand calculation written out here."""

from __future__ import annotations

import time

import pytest

from ftrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from ftrain.model import build_model, count_parameters
from ftrain.planning.memory import CUDA_RUNTIME_BYTES, GiB, Target, activations, layout_for, model_stats
from ftrain.planning.plan import estimate, estimate_all
from ftrain.planning.plan_report import plan_report
from tests.unit.saved_activations import saved_bytes

GPU_BF16 = Target("cuda", "bf16")

#: Llama 3's shapes (ftrain/models/sizes.py), written out again: V, h, L, n_head, n_kv_heads, ffn
LLAMA3 = {"8B": (128256, 4096, 32, 32, 8, 14336), "70B": (128256, 8192, 80, 64, 8, 28672)}


def _params_by_formula(size: str) -> int:
    V, h, L, a, kv_heads, f = LLAMA3[size]
    kv = kv_heads * (h // a)  # k and v are n_kv_heads * head_dim wide (GQA)
    attention = h * h + h * kv + h * kv + h * h  # q, k, v, o (no biases)
    swiglu = 3 * h * f  # gate, up, down
    norms = 2 * h  # attention and MLP RMSNorm weights
    return V * h + L * (attention + swiglu + norms) + h + h * V  # embedding, blocks, final norm, head (untied)


@pytest.mark.parametrize("size,published", [("8B", 8_030_261_248), ("70B", 70_553_706_496)])
def test_meta_build_counts_llama3s_published_parameters_fast(size, published):
    assert _params_by_formula(size) == published
    start = time.perf_counter()
    stats = model_stats(ModelConfig(arch="llama", size=size))
    elapsed = time.perf_counter() - start
    assert stats.num_params == published and stats.num_blocks == LLAMA3[size][2]
    assert elapsed < 10, f"building {size} on the meta device took {elapsed:.1f}s"  # ~0.2 s for 70B here


def test_tied_embeddings_are_counted_once():
    # Llama 3.2 1B: 16 layers, d 2048, 32 heads, 8 kv heads, ffn 8192, head tied to the embedding
    V, h, L, kv, f = 128256, 2048, 16, 8 * 64, 8192
    assert model_stats(ModelConfig(arch="llama", size="1B")).num_params == 1_235_814_400
    assert V * h + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h == 1_235_814_400


def test_small_llama_meta_count_equals_the_real_model():
    cfg = ModelConfig(arch="llama", vocab_size=100, seq_len=16, n_layer=2, n_head=4, n_kv_heads=2, d_model=32)
    assert model_stats(cfg).num_params == count_parameters(build_model(cfg))


# ---------------------------------------------------------------------------------------------
# Activations, checked against the tensors autograd really saves (CPU).


@pytest.mark.parametrize("mode,dropout", [("fp32", 0.0), ("autocast", 0.0), ("mp", 0.0), ("fp32", 0.1)])
def test_llama_activation_formula_matches_saved_tensors(mode, dropout):
    # GQA (2 kv heads of 4) and an ffn_dim that is no multiple of d_model: every width differs
    shape = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_dim=96)
    cfg = ModelConfig(arch="llama", dropout=dropout, **shape)
    predicted = activations(cfg, micro_batch=3, mode=mode, tp=1, device="cpu", checkpointing=False).saved_bytes
    assert predicted == saved_bytes(cfg, 3, mode)


def test_gpt_and_factory_models_keep_the_gpt_formula():
    kw = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=64)
    gpt = activations(ModelConfig(**kw), micro_batch=2, mode="fp32", tp=1, device="cpu", checkpointing=False)
    factory = ModelConfig(arch="llama", factory="pkg.mod:make", **kw)
    assert activations(factory, micro_batch=2, mode="fp32", tp=1, device="cpu", checkpointing=False) == gpt
    llama = activations(
        ModelConfig(arch="llama", **kw), micro_batch=2, mode="fp32", tp=1, device="cpu", checkpointing=False
    )
    assert llama != gpt


# ---------------------------------------------------------------------------------------------
# The plan for 8B and 70B on 80 GiB GPUs, by hand.


def _llama3(size: str, world: int, checkpointing: bool) -> Config:
    return Config(
        model=ModelConfig(arch="llama", size=size, seq_len=8192),
        train=TrainConfig(micro_batch_size=1, global_batch_size=world),  # one micro-batch per rank: no accumulation
        parallel=ParallelConfig(strategy="fsdp", activation_checkpointing=checkpointing),
    )


@pytest.mark.parametrize(
    "size,world,checkpointing,fits",
    [
        ("8B", 8, False, True),  # 75 GiB, tight: 63 GiB of activations for 8192 tokens
        ("8B", 8, True, True),  # 35 GiB (before meta-device start-up, its full fp32 model (30 GiB) set the peak)
        ("8B", 64, True, True),  # 31 GiB
        ("70B", 8, True, False),  # 16 B x 70.6B / 8 = 131 GiB of model states
        ("70B", 64, True, True),  # 16.4 GiB of states, 46 GiB running (a full build at start-up needed 263 GiB)
        ("70B", 64, False, False),  # 257 GiB of activations without checkpointing
    ],
)
def test_fsdp_plan_for_llama3_on_80gib_is_the_hand_calculation(size, world, checkpointing, fits):
    cfg = _llama3(size, world, checkpointing)
    V, h, L, a, kv_heads, f = LLAMA3[size]
    hd, kv = h // a, kv_heads * (h // a)
    psi = _params_by_formula(size)
    b, s = 1, 8192
    tokens = b * s
    N = world  # FSDP shards every parameter over all ranks; each dim 0 (V, h, kv, f) divides 64: no padding

    # Model states: fp32 master parameters, fp32 gradients, AdamW m and v, each a 1/N shard.
    params, grads, moments = 4 * psi // N, 4 * psi // N, 8 * psi // N
    # Activations under FSDP2's bf16 (e = 2 for matmuls and the residual stream), per token:
    e = 2
    norm = (4 + e + e) * h + 4  # fp32 copy of the input, normalised (bf16), output (bf16), fp32 rsqrt
    attention = (2 * h + 2 * kv) * e + 4 * a  # flash SDPA: rotated q, k (GQA: kv wide), v, output; fp32 lse
    swiglu = 4 * f * e  # gate out, silu(gate), up out, their product
    per_layer = tokens * (2 * norm + attention + swiglu)
    final_norm = tokens * norm + 2 * s * hd * e  # and the RoPE cos/sin tables, once
    logits = tokens * V
    layers = L * tokens * h * e if checkpointing else L * per_layer  # checkpointing: each block's input
    recompute = per_layer if checkpointing else 0  # one block recomputed in its backward
    act_a = layers + final_norm + logits * (e + 12)  # backward starting at the loss
    act_b = layers + recompute + logits * e  # the last block's backward starting
    # FSDP2 at the last block's backward: the root (embedding, final norm, head) gathered again with
    # its gradient, the current and prefetched blocks and the all-gather buffer, the block's gradient
    # (bf16) and its fp32 reduce-scatter input.
    root, block = V * h + h + h * V, 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    extra_b = 2 * e * root + 3 * e * block + block * (e + 4)
    backward = params + moments + max(act_a, act_b + extra_b)  # gradients are freed by zero_grad
    step = params + grads + moments + 8 * (V * h // N) + logits * e  # AdamW's per-tensor temporaries
    init = 4 * psi // N + 4 * V * h  # built on meta: the shard, and the largest parameter made whole once
    total = CUDA_RUNTIME_BYTES + max(backward, step, init)

    stats = model_stats(cfg.model, cfg.optim)
    assert stats.num_params == psi
    e_ = estimate(stats, cfg, layout_for(cfg, "fsdp", world_size=world, gpus_per_node=8), GPU_BF16)
    assert (e_.params_bytes, e_.grads_bytes, e_.optimizer_bytes) == (params, grads, moments)
    assert e_.activation_bytes == act_a
    assert e_.total_bytes == total
    assert e_.running_bytes == CUDA_RUNTIME_BYTES + max(backward, step)
    assert e_.fits(80 * GiB) == fits


def test_plan_report_for_8b_names_the_llama_and_recommends_a_fitting_strategy():
    cfg = _llama3("8B", 8, True)
    report = plan_report(cfg, world_size=8, device_memory_bytes=80 * GiB, gpus_per_node=8)
    assert report.startswith("ftrain plan: Llama with 8030.26M parameters")
    assert "recommended: " in report
    estimates, skipped = estimate_all(
        model_stats(cfg.model, cfg.optim), cfg, world_size=8, gpus_per_node=8, target=GPU_BF16
    )
    assert skipped == [] and {e.strategy for e in estimates} >= {"ddp", "fsdp", "tp", "fsdp+tp"}


def test_tp_beyond_the_kv_heads_is_skipped():
    cfg = Config(
        model=ModelConfig(arch="llama", vocab_size=256, n_layer=2, n_head=8, n_kv_heads=2, d_model=64),
        parallel=ParallelConfig(tp_size=4),
    )
    _, skipped = estimate_all(model_stats(cfg.model), cfg, world_size=4, gpus_per_node=4, target=GPU_BF16)
    assert any(s.strategy == "tp" and "n_kv_heads=2" in s.reason for s in skipped)
