"""Activation memory of the built-in Llama (``model.arch = "llama"``), for ``ftrain plan``.

:func:`ftrain.planning.memory.activations` hands the built-in Llama here; the GPT and models from
``model.factory`` keep the GPT's formula. Counted per token (``b·s`` of them), with ``h = d_model``,
``kv = n_kv_heads·head_dim`` (grouped-query attention), ``f = swiglu_dim``, ``a = n_head``, and
``e`` the bytes of a matmul input/output (4 fp32, 2 bf16), ``e_res`` of the residual stream (2 under
FSDP2's bf16, else 4), as autograd really saves them (checked tensor by tensor in
tests/unit/test_plan_llama.py, fp32, autocast and FSDP2-style bf16):

- each RMSNorm (two per block, one final): its fp32 input (``x.float()``: the input itself, or an
  fp32 copy of a bf16 one) 4h, the normalised ``h·rsqrt`` that the weight multiplies (e_res·h),
  the fp32 ``rsqrt`` (4), and its output as the next matmuls see it: e·h once (autocast casts it
  once per consuming linear: q, k, v three copies, gate and up two, the head one). Replicated
  under tensor parallelism.
- attention, flash SDPA (CPU, and CUDA's flash kernel, which takes GQA's narrower k/v as they
  are): the rotated q (h) and k (kv), v (kv), the output (h, which the o projection reads as a
  view) at e bytes, plus the fp32 logsumexp (4·a). RoPE saves nothing per token (its products
  with the cos/sin tables save only the tables, ``2·s·head_dim`` once per model). Split under TP.
- SwiGLU: the gate output (silu's input), silu's output, the up output and their product (the
  down projection's input): 4 tensors of f at e bytes. Split under TP.
- dropout > 0 only: each block's two residual-branch dropout masks (bool on CUDA, the
  activation dtype on CPU), and on CPU SDPA falls back to the math path, which saves q, k and v
  expanded to all n_head heads, the scores, the probabilities and their dropped version
  (3·a·s), and a copy of the output for the o projection (4·h + 3·a·s at e bytes, instead of the
  flash path's 2h + 2kv and logsumexp).

The logits side (b·s·V at the loss) is the GPT's: the head is the same ``nn.Linear``. Tied
embeddings change no activation; the meta-device build counts the shared weight once.
"""

from __future__ import annotations

from ftrain.config import ModelConfig
from ftrain.planning.activations import Activations


def llama_activations(
    model: ModelConfig, *, micro_batch: int, mode: str, tp: int, device: str, checkpointing: bool
) -> Activations:
    """:func:`ftrain.planning.memory.activations` for the built-in Llama (see the module docstring)."""
    b, s, h, a, L = micro_batch, model.seq_len, model.d_model, model.n_head, model.n_layer
    head_dim = h // a
    kv, f = model.kv_heads * head_dim, model.swiglu_dim
    tokens = b * s
    e = 4 if mode == "fp32" else 2  # matmul inputs/outputs
    e_res = 2 if mode == "mp" else 4  # residual stream; the normalised h*rsqrt the norm weight multiplies
    autocast = mode == "autocast"

    def norm(copies: int) -> int:  # per token: fp32 input, normalised, output as its consumers see it, rsqrt
        return (4 + e_res + (copies if autocast else 1) * e) * h + 4

    replicated = norm(3) + norm(2)  # attention norm (q, k, v), MLP norm (gate, up)
    split = 4 * f * e  # SwiGLU: gate out, silu out, up out, their product
    if model.dropout > 0 and device != "cuda":
        split += (4 * h + 3 * a * s) * e  # CPU SDPA with dropout: the math path
    else:
        split += (2 * h + 2 * kv) * e + 4 * a  # flash: q, k, v, output; fp32 logsumexp
    if model.dropout > 0:
        replicated += 2 * h * (1 if device == "cuda" else e)  # the two residual dropout masks
    per_layer = tokens * (replicated + split // tp)
    rope = 2 * s * head_dim * (2 if mode == "mp" else 4)  # cos and sin, once per model
    e_logits = 4 if mode == "fp32" else 2
    logits = tokens * model.vocab_size
    return Activations(
        layers=L * tokens * h * e_res if checkpointing else L * per_layer,
        final_norm=tokens * norm(1) + rope,
        loss_peak=logits * (e_logits + 12),
        logits_held=logits * e_logits,
        recompute=per_layer if checkpointing else 0,
    )
