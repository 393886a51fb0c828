"""The runtime's configuration: one dataclass per section it reads, composed into :class:`Config`.

The file format, overrides and errors are :mod:`ftrain.contract.config`'s; ``[checkpoint]`` is the
checkpoint service's (:mod:`ftrain.checkpoint.config`); ``[agent]`` is the node agent's
(:mod:`ftrain.agents.config`) and is kept here unvalidated (:data:`OTHER_SECTIONS`).

What must stay true: every float key is finite and every numeric key is in its range, so a value
that passes here cannot break training later; this module stays free of torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrain.checkpoint.config import CheckpointConfig
from ftrain.contract import flight, worker_env
from ftrain.contract.config import (
    ConfigError,
    at_least,
    check_floats,
    int_range,
    load_sections,
    opt,
    opt_table,
    opt_tables,
    positive,
    suggest,
)
from ftrain.models.config_match import parse_override
from ftrain.models.sizes import LLAMA_SIZES, default_ffn_dim
from ftrain.parallel.pipeline_stages import PP_SCHEDULES, check_pipeline, pipeline_degrees, stage_blocks
from ftrain.parallel.strategies import STRATEGIES
from ftrain.parallel.strategies import check_config as _check_strategy_config
from ftrain.parallel.strategies import check_parallel as _check_strategy_parallel
from ftrain.parallel.strategies import get as _strategy
from ftrain.parallel.strategies._gradient_reduce import EVERY_MICRO_BATCH, GRADIENT_REDUCE_MODES

#: the values of ``optim.lr_scaling``
LR_SCALINGS = ("none", "linear", "sqrt")
#: the values of ``model.arch``
MODEL_ARCHS = ("gpt", "llama")

#: sections of the shared config file that other processes own (the node agent's)
OTHER_SECTIONS = ("agent", "accounting")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = opt(100, "Number of optimizer steps to run.")
    global_batch_size: int = opt(
        32, "Sequences per optimizer step, fixed whatever the world size (accumulation adapts)."
    )
    micro_batch_size: int = opt(8, "Sequences per forward/backward pass on one rank.")
    seed: int = opt(0, "Seed for model initialisation and dropout.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this value (0 disables).")
    device: str = opt("auto", "auto (cuda if available, else cpu), cpu or cuda.", ("auto", "cpu", "cuda"))
    dtype: str = opt(
        "auto",
        "Parameter/compute precision: auto (bf16 mixed on GPU, fp32 on CPU), fp32 or bf16 "
        "(bf16 params and compute, fp32 gradient reduction and optimizer master state).",
        ("auto", "fp32", "bf16"),
    )
    save_final_path: str = opt("", "If set, rank 0 writes the final full model and optimizer state here (torch.save).")
    on_schedule_change: str = opt(
        "fail",
        "Resuming with another train.steps, optim.warmup_steps, optim.lr, optim.min_lr_ratio (or LR scaling) than "
        "the checkpoint was trained with: fail (say what changed), keep (the saved schedule goes on), or rescale "
        "(the new one, from the resumed step).",
        ("fail", "keep", "rescale"),
    )
    on_nonfinite: str = opt(
        "skip",
        "A non-finite loss or gradient norm: skip the optimizer step, rollback to the last verified "
        "checkpoint, or halt.",
        ("skip", "rollback", "halt"),
    )

    def __post_init__(self) -> None:
        positive("train.steps", self.steps)
        positive("train.global_batch_size", self.global_batch_size)
        positive("train.micro_batch_size", self.micro_batch_size)
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of train.micro_batch_size={self.micro_batch_size}",
            )
        check_floats("train", self)
        at_least("train.grad_clip", self.grad_clip, 0)
        int_range("train.seed", self.seed, -(2**63), 2**64 - 1)  # what torch.manual_seed accepts


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    arch: str = opt(
        "gpt",
        "Built-in model: gpt (the reference GPT: LayerNorm, learned positions, GELU MLP) or llama (RMSNorm, "
        "rotary embeddings, SwiGLU, grouped-query attention). Ignored when model.factory is set.",
        MODEL_ARCHS,
    )
    size: str = opt(
        "",
        "A named size of the llama arch (" + ", ".join(LLAMA_SIZES) + "): sets n_layer, d_model, n_head, "
        "n_kv_heads, ffn_dim and, for 1B..70B, vocab_size, rope_theta and tie_embeddings. Empty: those keys as given.",
    )
    factory: str = opt(
        "",
        'Build a user model: "pkg.module:function", called with this ModelConfig (its settings in model.args), '
        "returning an nn.Module whose forward(tokens) returns logits (or an output with .logits). Shipped: "
        '"ftrain.models.hf:causal_lm" (Hugging Face). Empty: the built-in model.arch. This imports and runs code: '
        "a config file is as trusted as code.",
    )
    args: dict[str, Any] = opt_table(
        "Settings of model.factory's model (a free table, [model.args] in the file, --model.args.NAME=VALUE on the "
        "command line): the factory reads them and names any it does not know."
    )
    init_from: str = opt(
        "",
        "Initial weights: a local Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not), "
        "read by rank 0 and sent to the others before the strategy shards the model; not read (nor needed) when "
        "checkpoint.uri holds a committed step to resume.",
    )
    override_weights_config: str = opt(
        "",
        "Comma-separated settings (rope_theta, rope_parameters, rms_norm_eps, hidden_act, sliding_window, "
        "layer_types) in which this model is meant to differ from the config its starting weights were trained "
        "with: model.init_from's config.json, or on a resume the model config the checkpoint recorded (e.g. "
        "rope_theta for a longer context). Any other difference is an error naming the setting.",
    )
    vocab_size: int = opt(256, "Vocabulary size (must exceed every token id of the data).")
    seq_len: int = opt(128, "Tokens per training sequence (context length).")
    n_layer: int = opt(4, "Transformer blocks.")
    n_head: int = opt(4, "Attention heads per block.")
    n_kv_heads: int = opt(0, "llama: key/value heads (grouped-query attention; divides n_head). 0: n_head.")
    d_model: int = opt(128, "Hidden size (a multiple of n_head).")
    mlp_ratio: int = opt(4, "gpt: MLP hidden size as a multiple of d_model.")
    ffn_dim: int = opt(0, "llama: SwiGLU hidden size. 0: 8/3 x d_model rounded up to a multiple of 64.")
    rope_theta: float = opt(500000.0, "llama: rotary embedding base.")
    norm_eps: float = opt(1e-5, "llama: RMSNorm epsilon.")
    tie_embeddings: bool = opt(False, "llama: the output head shares the token embedding's weight.")
    dropout: float = opt(0.0, "Dropout probability (0 keeps runs bitwise reproducible).")

    def __post_init__(self) -> None:
        if self.factory and ":" not in self.factory:
            raise ConfigError("model.factory", f'expected "pkg.module:function", got {self.factory!r}')
        self._apply_size()
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            positive(f"model.{name}", getattr(self, name))
        for name in ("n_kv_heads", "ffn_dim"):
            at_least(f"model.{name}", getattr(self, name), 0)
        if self.d_model % self.n_head:
            raise ConfigError("model.d_model", f"{self.d_model} is not a multiple of model.n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ConfigError("model.n_kv_heads", f"{self.n_kv_heads} does not divide model.n_head={self.n_head}")
        if self.arch == "llama" and (self.d_model // self.n_head) % 2:
            head = self.d_model // self.n_head
            raise ConfigError("model.d_model", f"rotary embeddings need an even head size; d_model / n_head = {head}")
        check_floats("model", self)
        positive("model.rope_theta", self.rope_theta)
        positive("model.norm_eps", self.norm_eps)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("model.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.args and not self.factory:
            raise ConfigError("model.args", f"is read by model.factory, which is not set (got {sorted(self.args)})")
        try:  # init_from itself is checked where it is read: a resume does not need it
            parse_override(self.override_weights_config)
        except ValueError as e:
            raise ConfigError("model.override_weights_config", str(e)) from None

    def _apply_size(self) -> None:
        if not self.size:
            return
        if self.size not in LLAMA_SIZES:
            raise ConfigError("model.size", f"unknown size {self.size!r}{suggest(self.size, LLAMA_SIZES)}")
        if self.arch != "llama" or self.factory:
            raise ConfigError("model.size", 'names a size of the built-in llama: set model.arch = "llama" (no factory)')
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, value in LLAMA_SIZES[self.size].items():
            given = getattr(self, name)
            if given != defaults[name] and given != value:
                why = f"is set by model.size={self.size!r} ({value}); remove one of the two (got {given})"
                raise ConfigError(f"model.{name}", why)
            setattr(self, name, value)

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_kv_heads``, 0 resolved to ``n_head``)."""
        return self.n_kv_heads or self.n_head

    @property
    def swiglu_dim(self) -> int:
        """The llama's SwiGLU hidden size (``ffn_dim``, 0 resolved)."""
        return self.ffn_dim or default_ffn_dim(self.d_model)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = opt(
        "synthetic",
        "synthetic (a seeded Markov chain with a known entropy floor) or the path of a flat "
        "token file (uint16/uint32 memmap, nanoGPT/Megatron layout).",
    )
    token_dtype: str = opt(
        "auto",
        "Token file element type; auto: uint16 if vocab_size <= 65536, else uint32.",
        ("auto", "uint16", "uint32"),
    )
    sources: list[dict[str, Any]] = opt_tables(
        "A weighted mixture of token files instead of data.source: [[data.sources]] tables, each with a path, a "
        "weight > 0 and optionally a token_dtype (default data.token_dtype). Megatron's blend: each source's share "
        "of the samples is its weight over the sum; a source drawn more often than it has samples repeats them, "
        "pass after pass in a seeded order (see docs/data.md)."
    )
    mixture_samples: int = opt(
        0,
        "Samples per epoch of the data.sources mixture; 0: as many as the sources hold together. Set it to "
        "train.steps x train.global_batch_size for Megatron's sizing (each source walks its own passes once).",
    )
    document_token: int = opt(
        -1,
        "Token id that `ftrain data tokenize` appends after each document (e.g. the tokenizer's end-of-text id); "
        "-1: none. Training reads it as an ordinary token: attention is not masked across documents.",
    )
    seed: int = opt(0, "Seed of the synthetic chain and of the per-epoch sample permutation.")
    num_samples: int = opt(1_000_000, "Synthetic source: sequences per epoch.")
    branching: int = opt(4, "Synthetic source: possible successors of each token.")
    concentration: float = opt(
        0.5, "Synthetic source: Dirichlet concentration of transition probabilities (lower = less entropy)."
    )
    ledger_dir: str = opt("", "If set, each data-parallel rank appends the sample ids it consumed per step here.")
    on_mixture_change: str = opt(
        "fail",
        "Resuming on other data than the checkpoint was trained on (data.sources reordered, reweighted, added, "
        "removed or rewritten; data.source, data.seed, data.mixture_samples): fail (say what changed), or new_blend "
        "(the data as configured takes over at the resumed step; no sample read so far in the epoch is read again "
        "in it).",
        ("fail", "new_blend"),
    )

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data.source", 'must be "synthetic" or a token file path')
        if self.sources and self.source != "synthetic":
            raise ConfigError(
                "data.sources",
                f"and data.source = {self.source!r} are both set: use data.sources for a mixture of token files "
                "or data.source for one file (or synthetic), not both",
            )
        if self.source != "synthetic" and not Path(self.source).is_file():
            raise ConfigError(
                "data.source",
                f'token file {self.source!r} does not exist (give a flat uint16/uint32 token file, or "synthetic")',
            )
        for i, entry in enumerate(self.sources):
            self._check_source(i, entry)
        int_range("data.mixture_samples", self.mixture_samples, 0, 2**63 - 1)
        if self.mixture_samples and not self.sources:
            raise ConfigError("data.mixture_samples", "sizes a data.sources mixture, and data.sources is empty")
        check_floats("data", self)
        positive("data.num_samples", self.num_samples)
        positive("data.branching", self.branching)
        int_range("data.seed", self.seed, 0, 2**63 - 1)  # the data cursor's permutation seed
        int_range("data.document_token", self.document_token, -1, 2**32 - 1)  # uint32 is the widest token file
        if self.concentration <= 0:
            raise ConfigError("data.concentration", f"must be > 0, got {self.concentration}")

    def _check_source(self, i: int, entry: dict[str, Any]) -> None:
        """One ``[[data.sources]]`` table: known keys, an existing file, a finite weight > 0."""
        where = f"data.sources[{i}]"
        required, allowed = ("path", "weight"), ("path", "weight", "token_dtype")
        for key in entry:
            if key not in allowed:
                raise ConfigError(
                    f"{where}.{key}", f"unknown key{suggest(key, allowed)} (a source has {', '.join(allowed)})"
                )
        for key in required:
            if key not in entry:
                raise ConfigError(
                    f"{where}.{key}",
                    'missing: each source needs a path and a weight, e.g. {path = "a.bin", weight = 1.0}',
                )
        path = entry["path"]
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.path", f"must be the path of a token file, got {path!r}")
        if not Path(path).is_file():
            raise ConfigError(f"{where}.path", f"token file {path!r} does not exist (give a flat uint16/uint32 file)")
        weight = entry["weight"]
        huge = isinstance(weight, int) and weight.bit_length() > 1000  # float() of it would overflow
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or huge or not 0 < weight < float("inf"):
            shown = "an integer of more than 1000 bits" if huge else repr(weight)[:40]
            raise ConfigError(f"{where}.weight", f"must be a finite number > 0, got {shown}")
        dtype = entry.get("token_dtype", self.token_dtype)
        choices = ("auto", "uint16", "uint32")
        if dtype not in choices:
            raise ConfigError(f"{where}.token_dtype", f"{dtype!r} is not one of {', '.join(choices)}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = opt(3e-4, "Peak learning rate (before world-size scaling).")
    min_lr_ratio: float = opt(0.1, "Cosine decay floor as a fraction of the peak.")
    warmup_steps: int = opt(10, "Linear warmup steps; cosine decay to the floor afterwards.")
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only; not biases/norms/embeddings).")
    beta1: float = opt(0.9, "AdamW beta1.")
    beta2: float = opt(0.95, "AdamW beta2.")
    eps: float = opt(1e-8, "AdamW epsilon.")
    lr_scaling: str = opt(
        "none",
        "Scale the peak LR with the data-parallel size relative to optim.base_world_size: none, linear or sqrt.",
        LR_SCALINGS,
    )
    base_world_size: int = opt(1, "Data-parallel size at which optim.lr is the peak LR as given.")

    def __post_init__(self) -> None:
        check_floats("optim", self)
        if self.lr <= 0:
            raise ConfigError("optim.lr", f"must be > 0, got {self.lr}")
        at_least("optim.weight_decay", self.weight_decay, 0)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        positive("optim.eps", self.eps)
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        positive("optim.base_world_size", self.base_world_size)

    def adamw_kwargs(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s arguments (weight decay is per parameter group: ftrain.optim.param_groups)."""
        return {"lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps}


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    strategy: str = opt("ddp", "Parallelism: " + ", ".join(STRATEGIES) + ".", STRATEGIES)
    deterministic: bool = opt(
        False,
        "Fixed-order gradient reduction: bitwise identical results at any world size "
        "(ddp only; costs world_size x gradient memory for the gather).",
    )
    tp_size: int = opt(0, "Tensor-parallel degree for tp / fsdp+tp (0: all ranks for tp, 2 for fsdp+tp).")
    shard_size: int = opt(0, "HSDP shard-group size (0: ranks per node, or 2 if that is the whole world).")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MB.")
    static_graph: bool = opt(False, "DDP static_graph (same graph every step).")
    activation_checkpointing: bool = opt(False, "Recompute each block's activations in backward.")
    gradient_reduce: str = opt(
        "auto",
        "FSDP strategies (zero2, fsdp, hsdp, fsdp+tp) under gradient accumulation: last_micro_batch reduce-scatters "
        "once per step and keeps the whole model's unsharded fp32 gradients between micro-batches (+4 bytes per "
        "parameter per rank); every_micro_batch reduce-scatters after every micro-batch into sharded gradients (one "
        "reduction per micro-batch). auto: last_micro_batch if it fits the device's memory (a CPU's always), else "
        "every_micro_batch; ftrain plan names the choice. ddp, zero1 and tp, and pipeline stages, reduce once per step "
        "whatever this says.",
        GRADIENT_REDUCE_MODES,
    )
    sequence_parallel: bool = opt(
        False,
        "tp and fsdp+tp: norms and residuals run on each rank's slice of the sequence (activations / tp_size, "
        "reduce-scatter + all-gather instead of all-reduce); the model must declare an sp_plan (the built-in llama "
        "does). Not with a pipeline.",
    )
    pp_size: int = opt(
        1,
        "Pipeline-parallel degree: the model's blocks split into stages over this many ranks (1: no pipeline); "
        "the strategy (ddp, fsdp, tp, fsdp+tp) runs inside each stage over the world size / pp_size.",
    )
    pp_schedule: str = opt(
        "1f1b",
        "Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward, one backward) or "
        "interleaved_1f1b (several model chunks per rank: a smaller bubble, more messages).",
        PP_SCHEDULES,
    )
    pp_virtual_stages: int = opt(0, "Model chunks per pipeline rank (0: 2 for interleaved_1f1b, 1 for gpipe and 1f1b).")
    pp_fallback: str = opt(
        "",
        'Pipeline degrees to fall back on, in order, for a world size parallel.pp_size does not divide (e.g. "1": '
        "no pipeline, after a node loss leaves one node of two); each must split the blocks. Empty: pp_size only.",
    )
    pp_split: str = opt(
        "",
        'The first block of every stage after the first, comma-separated (e.g. "3,6": three stages from '
        "block 0, 3 and 6); empty: blocks spread evenly. Embeddings go with the first stage, the head with the last.",
    )
    backend: str = opt(
        "auto", "Process-group backend: auto (nccl on GPU, gloo on CPU), gloo or nccl.", ("auto", "gloo", "nccl")
    )
    timeout_s: float = opt(120.0, "Collective and rendezvous timeout in seconds.")

    def __post_init__(self) -> None:
        check_floats("parallel", self)
        if self.tp_size < 0:
            raise ConfigError("parallel.tp_size", f"must be >= 0, got {self.tp_size}")
        if self.shard_size < 0:
            raise ConfigError("parallel.shard_size", f"must be >= 0, got {self.shard_size}")
        _check_strategy_parallel(self)  # strategy hook: a registered name; deterministic only where supported
        if self.sequence_parallel and not _strategy(self.strategy).needs_tp_plan:
            raise ConfigError(
                "parallel.sequence_parallel", f"needs a tensor-parallel strategy (tp or fsdp+tp), not {self.strategy}"
            )
        if self.sequence_parallel and max(pipeline_degrees(self)) > 1:
            raise ConfigError(
                "parallel.sequence_parallel", "does not run inside a pipeline stage: use parallel.pp_size = 1"
            )
        check_pipeline(self)
        if self.gradient_reduce not in GRADIENT_REDUCE_MODES:
            raise ConfigError(
                "parallel.gradient_reduce", f"{self.gradient_reduce!r} is not one of {', '.join(GRADIENT_REDUCE_MODES)}"
            )
        if self.gradient_reduce == EVERY_MICRO_BATCH and max(pipeline_degrees(self)) > 1:
            raise ConfigError(
                "parallel.gradient_reduce",
                f"{EVERY_MICRO_BATCH} does not apply inside a pipeline stage (torch's PipelineStage reduces once "
                "per step): use auto or last_micro_batch with parallel.pp_size > 1",
            )
        if self.bucket_cap_mb <= 0:
            raise ConfigError("parallel.bucket_cap_mb", f"must be > 0, got {self.bucket_cap_mb}")
        if self.timeout_s <= 0:
            raise ConfigError("parallel.timeout_s", f"must be > 0, got {self.timeout_s}")


@dataclass(kw_only=True, slots=True)
class ConsistencyConfig:
    interval: int = opt(
        0,
        "Every this many steps (and after every load), compare digests of replicated parameters and "
        "optimizer state across ranks that must hold identical copies (0: only after loads).",
    )
    on_mismatch: str = opt(
        "halt",
        "When replicas differ: warn, halt (exit non-zero) or rollback (reload the last verified checkpoint).",
        ("warn", "halt", "rollback"),
    )

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError("consistency.interval", f"must be >= 0, got {self.interval}")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    metrics_path: str = opt("", "JSON lines file written by rank 0, one line per step (empty: off).")
    progress: str = opt(
        "auto",
        "Rank-0 progress: auto (a bar on a terminal, lines otherwise), bar, lines or off.",
        ("auto", "bar", "lines", "off"),
    )
    log_every: int = opt(10, "Steps between progress lines when not drawing a bar.")
    events_path: str = opt(
        "",
        "JSON lines file of lifecycle events (ckpt_staged, ckpt_committed, ckpt_corrupt, resumed, ...) "
        "appended by every rank (empty: off).",
    )
    flight_recorder_entries: int = opt(
        flight.DEFAULT_ENTRIES,
        "Collectives each rank keeps in torch's flight recorder (gloo and NCCL), which the agents collect on "
        "a hang and `ftrain analyze` reads to name the culprit (0: off; TORCH_FR_BUFFER_SIZE, if set, wins).",
    )

    def __post_init__(self) -> None:
        positive("logging.log_every", self.log_every)
        at_least("logging.flight_recorder_entries", self.flight_recorder_entries, 0)


@dataclass(kw_only=True, slots=True)
class Config:
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    others: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    """Sections of the file that other processes own and validate (:data:`OTHER_SECTIONS`), as
    read: the worker takes only ``agent.job`` from them (:func:`worker_job_id`)."""

    def __post_init__(self) -> None:
        _check_strategy_config(self)  # strategy hook: e.g. zero1 refuses checkpoint.uri
        for pp in pipeline_degrees(self.parallel):  # ConfigError naming the key if the blocks do not split
            if pp > 1 and not self.model.factory:  # a factory's model is checked when it is built
                stage_blocks(dataclasses.replace(self.parallel, pp_size=pp, pp_fallback=""), self.model.n_layer)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "others"
        }

    def digest(self) -> str:
        """A stable hash of what is trained (recorded in checkpoints; the agent section is left
        out: how a job is supervised does not change what it computes)."""
        training = {k: v for k, v in self.to_dict().items() if k not in OTHER_SECTIONS}
        blob = json.dumps(training, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def worker_job_id(cfg: Config, environ: Any = None) -> str:
    """The job id of a worker: ``FTRAIN_JOB`` (set by the node agent) or else ``agent.job``.

    Checkpoint manifests record it and readers refuse another job's steps. With
    ``checkpoint.hmac_key_env`` set it must be known: the signature binds the job.
    """
    from ftrain.checkpoint.manifest import job_problem  # torch-free; only workers need it

    env = os.environ if environ is None else environ
    job, key = (
        (env[worker_env.JOB], worker_env.JOB)
        if env.get(worker_env.JOB)
        else (cfg.others.get("agent", {}).get("job", ""), "agent.job")
    )
    why = job_problem(job)
    if why is not None:
        raise ConfigError(key, f"job id {why}")
    if cfg.checkpoint.uri and cfg.checkpoint.hmac_key_env and not job:
        raise ConfigError(
            "checkpoint.hmac_key_env",
            "signed manifests are bound to the job id, but no job id is known: set agent.job=<job id> "
            "(or run under `ftrain agent`, which sets FTRAIN_JOB), or leave checkpoint.hmac_key_env "
            "empty",
        )
    return job


def sections() -> dict[str, type]:
    """The sections the runtime owns and validates, in file order."""
    defaults = Config()
    return {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(Config) if f.name != "others"}


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Config:
    """The runtime's view of a config file: its sections validated, the node agent's kept as read.

    ``ftrain agent`` validates the whole file (:func:`ftrain.cli.config.load_job_config`) before it
    starts any worker, so a worker does not need the agent's code to accept the file.
    """
    typed, raw = load_sections(sections(), path, overrides, opaque=OTHER_SECTIONS)
    return Config(**typed, others=raw)
