"""The memory model of ``ftrain plan``: what one rank holds under one parallel strategy.

Everything here is a pure function of the configuration and of a model built on the meta device
(no memory, works for ``model.factory`` models too):

- :func:`model_stats` reads parameter shapes, AdamW groups, FSDP units (the blocks and the
  root) and the tensor-parallel split of ``tp_plan()`` from a meta-device build;
- :func:`estimate_with` gives one strategy's per-rank bytes as a :class:`MemoryEstimate`, from
  the activations it is handed (:func:`activations` without a pipeline; a pipeline rank's own
  in :mod:`ftrain.planning.stages`).

:mod:`ftrain.planning.plan` picks the estimate for a layout and the strategy to recommend;
:mod:`ftrain.planning.plan_report` renders what ``ftrain plan`` prints.

What the numbers model (our implementation, not the textbook; see ``textbook_model_state_bytes``):

- Model states. Parameters are fp32 on every strategy (bf16 is autocast for ddp/zero1/tp and an
  FSDP2 ``MixedPrecisionPolicy`` that keeps fp32 shards), gradients fp32, AdamW ``m, v`` fp32:
  16 bytes per parameter a rank holds. ddp 16Ψ; zero1 8Ψ + 8·(largest ZeroRedundancyOptimizer
  partition) (DDP keeps fp32 params and grads replicated; the textbook 4Ψ + 12Ψ/N assumes fp16
  params/grads beside fp32 master shards); zero2, fsdp, hsdp 16·(padded dim-0 shard), i.e.
  16Ψ/N; tp 16·(local split + replicated); fsdp+tp the TP-local tensors sharded over dp.
- The backward peak is the larger of two moments: backward starting at the loss (all
  activations and the loss's own buffers) and the last block's backward starting (FSDP2 has
  gathered the root again, with its gradient, and the current and prefetched blocks, the
  all-gather buffer, the block's unsharded gradient and its fp32 reduce-scatter input). In
  torch 2.13 FSDP2 reshards the root after forward when ``reshard_after_forward=True`` is
  passed, as shard_model does. zero2 keeps every unit unsharded from its forward on. DDP's
  buckets are its gradients (``gradient_as_bucket_view=True``) and persist; every other
  strategy frees gradients at ``zero_grad(set_to_none=True)`` and re-creates them during
  backward as activations are freed, so they are not in the backward peak.
- Gradient accumulation (global batch > micro batch x dp) costs memory in our implementation:
  DDP's ``no_sync`` micro-batches accumulate into fresh gradients beside the buckets (+4Ψ,
  measured). FSDP2 follows ``parallel.gradient_reduce``: ``last_micro_batch``
  (``set_requires_gradient_sync(False)`` until the last micro-batch) keeps unsharded fp32
  gradients of the whole (TP-local) model between micro-batches (+4Ψ: sharding no longer
  saves gradient memory); ``every_micro_batch`` reduce-scatters each micro-batch and keeps only
  the gradient shards (+4Ψ/N); ``auto`` is the first when its running peak fits the target's
  memory (:attr:`Target.memory_bytes`; a CPU plan, like a CPU run, treats memory as fitting),
  else the second (:func:`~ftrain.parallel.strategies._gradient_reduce.choose_gradient_reduce`).
  bf16 autocast (ddp, zero1, tp) keeps a bf16 copy of every ``nn.Linear`` parameter until
  backward has used it (+2 bytes per such parameter).
- Optimizer step: AdamW's foreach path (CUDA, plain tensors: ddp, zero1) allocates
  ``sqrt(v)`` for a whole parameter group (4 bytes per local parameter); the per-tensor path
  (CPU, and DTensor parameters: FSDP2, TP) two temporaries of the largest parameter. The
  fixed-order reduction (``parallel.deterministic``) gathers world_size flattened gradients.
- Start-up: ddp and zero1 build the full fp32 model (4Ψ) and move it to the device. Every other
  layout (and any pipeline) builds it on the meta device and makes each parameter whole once to
  copy this rank's part to the device (:mod:`ftrain.models.deferred_init`): the local part plus
  the largest parameter.
- Activations (built-in GPT; models from ``model.factory`` are assumed GPT-like with the
  configured sizes; the Llama's: :mod:`ftrain.planning.llama_activations`): Korthikanti et al.
  2022 count s·b·h·(34 + 5·a·s/h) bytes per layer for 2-byte activations with dropout masks and
  a materialised a·s² attention. ``F.scaled_dot_product_attention`` (flash/memory-efficient on
  CUDA, the flash kernel on CPU) saves q, k, v, its output and a logsumexp instead of the a·s²
  scores, and with dropout = 0 no masks are saved, which leaves 4 + 2·mlp_ratio + 4 = 16 saved
  s·b·h tensors per layer (verified by counting saved tensors: tests/unit/test_plan.py). Of
  those, the norm inputs/outputs (4) are replicated under TP and the rest (12) split. Bytes per
  element follow the precision: fp32 4; FSDP2 bf16 2; autocast keeps the residual stream and
  norm inputs fp32 and casts the norm output once per consuming linear (q, k, v: three copies).
  CPU SDPA with dropout > 0 falls back to the math path, which does store 3·a·s² values per
  layer. Plus the final norm, and the logits: b·s·V in the compute dtype held by the loop, fp32
  log-softmax output, its gradient and the gradient of the logits (~12 more bytes per logit) at
  the start of backward. Activation checkpointing keeps each block's input and recomputes one
  block at a time.
- Overhead: CPU peak RSS has a baseline a tiny run already pays (:data:`CPU_BASELINE_BYTES`,
  measured) plus the data cursor's epoch permutation. On CUDA the metric
  ``torch.cuda.max_memory_allocated`` leaves out the CUDA context, cuBLAS workspaces and NCCL
  buffers, which still take device memory (:data:`CUDA_RUNTIME_BYTES`, an assumption: no GPU
  was available to measure it) and so count towards "fits". Allocator fragmentation is not
  modelled: leave headroom. On CPU the estimate is live memory, which peak RSS matches with
  MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 (within ~2-3% for ddp, zero1, zero2, fsdp,
  tp, checkpointing, on a 34M-parameter GPT: bench/plan_vs_measured.py); glibc's defaults added
  10% (ddp) to 50% (fsdp) of fragmentation there.

**Size.** Over 600 lines because the model is one piece of arithmetic whose terms depend on each
other (the wrapper, the shard count, accumulation and its gradient reduction mode, the phases'
peaks); this docstring, which says what each term models, is a quarter of it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from ftrain.config import Config, ConfigError, ModelConfig, OptimConfig
from ftrain.model import build_model
from ftrain.models.layout import block_list, tp_plan_of
from ftrain.optim import param_groups
from ftrain.parallel import strategies
from ftrain.parallel.strategies import Layout, Strategy, Wrapper, compute_layout
from ftrain.parallel.strategies._gradient_reduce import EVERY_MICRO_BATCH, LAST_MICRO_BATCH, choose_gradient_reduce
from ftrain.planning.activations import Activations
from ftrain.planning.llama_activations import llama_activations

GiB = 2**30

#: Peak RSS of an ftrain CPU worker before the model counts: `ftrain train` of the tiny GPT
#: (0.14M parameters, `bench/plan_vs_measured.py --smoke`) on 2 gloo ranks, less its ~5 MB of
#: model, optimizer state and activations (torch 2.13.0+cpu, numpy 2.4, Python 3.11). It is not
#: one number: the process's anonymous memory is ~146 MB after `import torch` every time, but the
#: resident pages of torch's shared libraries (file-backed, counted in RSS) depend on what else maps
#: them. Measured 2026-12-03 on the same packages: 341 MB on a quiet machine (`import torch`:
#: 223 MB, 64 MB of library pages) and 428 MB while a test suite ran from the same venv (`import
#: torch`: 282 MB, 136 MB of library pages shared with its processes); 2026-12-02: 401 MB. The
#: constant sits between (within 12% of both ends for the smoke bench's tiny model);
#: bench/pipeline.py measures the machine's own beside its comparison.
CPU_BASELINE_BYTES = 385 * 10**6

#: Device memory a CUDA rank uses outside torch's allocator: the CUDA context (lazy module
#: loading), cuBLAS/cuDNN workspaces and NCCL buffers. NOT measured here (no GPU on the dev
#: machines): 0.5-1.5 GiB per rank is the usual range on H100-class GPUs; re-measure as
#: nvidia-smi's per-process figure minus torch.cuda.memory_reserved().
CUDA_RUNTIME_BYTES = 1 * GiB

#: Device memory assumed when none is given and this machine has no GPU (an 80 GB H100/A100).
DEFAULT_DEVICE_MEMORY_BYTES = 80 * GiB

#: Above this fraction of device memory a fitting plan is reported as tight.
TIGHT_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter as the strategies see it."""

    name: str
    shape: tuple[int, ...]
    group: int
    """AdamW parameter group (0 decay, 1 no decay): ZeRO-1 partitions group by group."""
    unit: int
    """FSDP unit: the index of its transformer block, or -1 for the root module."""
    tp_dim: int | None
    """Dimension split by tensor parallelism (0 colwise, 1 rowwise weight), None if replicated."""
    autocast_copy: bool
    """An ``nn.Linear`` parameter, of which bf16 autocast keeps a cast copy until backward."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ModelStats:
    """What the estimate needs from the model, read from a meta-device build."""

    params: tuple[ParamInfo, ...]
    num_blocks: int
    has_tp_plan: bool
    name: str = "model"

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True, slots=True)
class Target:
    """Where the plan is for: device type and training precision."""

    device: str  # "cuda" or "cpu"
    dtype: str  # "bf16" or "fp32"
    memory_bytes: int | None = None
    """The device's memory, which ``parallel.gradient_reduce=auto`` is judged against on CUDA
    (None: not judged, ``last_micro_batch``)."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-rank memory of one strategy, in bytes."""

    strategy: str
    world_size: int
    dp_size: int
    tp_size: int
    shard_size: int
    """Ranks one parameter is sharded over (1: replicated)."""
    params_bytes: int
    grads_bytes: int
    """Gradients as the optimizer step sees them."""
    optimizer_bytes: int
    grads_in_backward_bytes: int
    """Gradients already allocated when backward starts (DDP buckets; 0 where they are freed)."""
    activation_bytes: int
    """Activations when backward starts at the loss."""
    transient_bytes: int
    """What the backward peak adds to params + optimizer + grads_in_backward + activations:
    unsharded FSDP units and buffers, autocast weight copies, accumulated unsharded gradients."""
    step_transient_bytes: int
    """Extra at the optimizer step or gradient reduction, when activations are gone."""
    init_bytes: int
    """Start-up peak: the full fp32 model before it is sharded or split."""
    overhead_bytes: int
    textbook_model_state_bytes: int
    notes: tuple[str, ...] = ()
    pp_size: int = 1
    """Pipeline ranks (1: no pipeline); the fields above are then pipeline rank ``pp_rank``'s."""
    pp_rank: int = 0
    stages: tuple[int, ...] = ()
    """The pipeline stages this rank runs (empty without a pipeline)."""
    bubble_fraction: float = 0.0
    """The schedule's idle fraction of every rank's step (``ftrain.parallel.pipeline_schedule.simulate``)."""
    in_flight: int = 0
    """(micro-batch, stage) activation sets this rank holds at its schedule's peak."""
    gradient_reduce: str = ""
    """FSDP strategies: the ``parallel.gradient_reduce`` mode counted (``auto`` resolved; a
    pipeline stage's is ``last_micro_batch``, torch's); empty for the others."""

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def phase(self) -> str:
        """Which phase sets the peak: "backward", "step" or "init"."""
        peaks = self._peaks()
        return max(peaks, key=lambda phase: peaks[phase])

    @property
    def total_bytes(self) -> int:
        return self.overhead_bytes + max(self._peaks().values())

    @property
    def running_bytes(self) -> int:
        """The total without the start-up peak: what a meta-device initialisation would need."""
        return self.overhead_bytes + max(v for k, v in self._peaks().items() if k != "init")

    def _peaks(self) -> dict[str, int]:
        return {
            "backward": self.params_bytes
            + self.optimizer_bytes
            + self.grads_in_backward_bytes
            + self.activation_bytes
            + self.transient_bytes,
            "step": self.model_state_bytes + self.step_transient_bytes,
            "init": self.init_bytes,
        }

    def fits(self, device_memory_bytes: int) -> bool:
        return self.total_bytes <= device_memory_bytes


@dataclass(frozen=True, slots=True)
class Skipped:
    strategy: str
    reason: str


# --------------------------------------------------------------------------------------------
# The model, from a meta-device build.


def model_stats(model_cfg: ModelConfig, optim_cfg: OptimConfig | None = None) -> ModelStats:
    """Build the configured model on the meta device and read what the estimate needs."""
    try:
        with torch.device("meta"):
            model = build_model(model_cfg)
    except ConfigError:
        raise
    except Exception as e:  # a user factory that cannot run on the meta device
        raise ConfigError("model.factory", f"cannot build the model on the meta device to count parameters: {e}") from e
    return stats_of(model, optim_cfg or OptimConfig())


def stats_of(model: nn.Module, optim_cfg: OptimConfig) -> ModelStats:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {id(p): g for g, group in enumerate(param_groups(model, optim_cfg)) for p in group["params"]}
    blocks = block_list(model)
    unit = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    tp_dim: dict[int, int] = {}
    plan = tp_plan_of(model)
    if plan is not None:
        for fqn, style in plan.items():
            module = model.get_submodule(fqn)
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if weight is not None:
                tp_dim[id(weight)] = 0 if style == "colwise" else 1
            if bias is not None and style == "colwise":
                tp_dim[id(bias)] = 0  # a rowwise bias stays replicated
    linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    params = tuple(
        ParamInfo(
            name=names[id(p)],
            shape=tuple(p.shape),
            group=groups.get(id(p), 0),
            unit=unit.get(id(p), -1),
            tp_dim=tp_dim.get(id(p)),
            autocast_copy=id(p) in linear,
        )
        for p in model.parameters()
        if p.requires_grad
    )
    return ModelStats(params, len(blocks), plan is not None, type(model).__name__)


# --------------------------------------------------------------------------------------------
# Shard arithmetic.


def _tp_local_shape(p: ParamInfo, tp: int) -> tuple[int, ...]:
    if p.tp_dim is None or tp == 1:
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = -(-shape[p.tp_dim] // tp)  # DTensor Shard: the first ranks get the ceiling
    return tuple(shape)


def _fsdp_local_numel(shape: tuple[int, ...], n: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the shard count: every rank holds ceil(d0/n) rows."""
    if not shape:
        return 1
    return -(-shape[0] // n) * math.prod(shape[1:])


def textbook_model_state_bytes(strategy: str, num_params: int, *, shard: int, tp_split: int = 0, tp: int = 1) -> int:
    """Mixed-precision Adam model states per rank as in the ZeRO paper (16 bytes per parameter:
    2 fp16 params + 2 fp16 grads + 12 fp32 master, m, v), for comparison with ours."""
    return strategies.get(strategy).textbook_model_state_bytes(num_params, shard=shard, tp_split=tp_split, tp=tp)


# --------------------------------------------------------------------------------------------
# Activations.


def precision_mode(strategy: Strategy, target: Target) -> str:
    if target.dtype == "fp32":
        return "fp32"
    return "mp" if strategy.wrapper is Wrapper.FSDP else "autocast"


def activations(
    model: ModelConfig, *, micro_batch: int, mode: str, tp: int, device: str, checkpointing: bool
) -> Activations:
    """Activation memory of the built-in GPT (the module docstring), or Llama (its own module).

    ``mode`` is "fp32", "mp" (FSDP2 bf16: everything bf16) or "autocast" (bf16 matmuls, fp32
    residual stream and norms)."""
    if model.arch == "llama" and not model.factory:
        return llama_activations(
            model, micro_batch=micro_batch, mode=mode, tp=tp, device=device, checkpointing=checkpointing
        )
    b, s, h, a, L = micro_batch, model.seq_len, model.d_model, model.n_head, model.n_layer
    r = model.mlp_ratio
    sbh = s * b * h
    e = 4 if mode == "fp32" else 2  # matmul inputs/outputs
    e_res = 2 if mode == "mp" else 4  # residual stream and norm inputs
    # Replicated under TP: the 2 norm inputs (e_res) and the norm outputs feeding q/k/v and fc
    # (autocast casts the first once per consumer: q, k and v).
    norm_out_copies = 4 if mode == "autocast" else 2
    replicated = sbh * (2 * e_res + norm_out_copies * e)
    # Split under TP: q, k, v, the attention output, the fc output and the GELU output.
    split = sbh * e * (3 + 1 + 2 * r)
    norm_stats = 2 * 2 * b * s * 4  # LayerNorm mean and rstd, fp32
    lse = a * s * b * 4  # SDPA logsumexp, fp32, split with the heads
    if model.dropout > 0:
        if device == "cuda":
            replicated += 2 * sbh  # two bool masks; flash/efficient SDPA keeps only a seed
        else:
            replicated += 2 * sbh * e  # CPU dropout masks are stored in the activation dtype
            split += 3 * a * s * s * b * e  # CPU SDPA with dropout: math path (scores, mask, probs)
    per_layer = replicated + norm_stats + (split + lse) // tp
    e_logits = 4 if mode == "fp32" else 2
    logits = b * s * model.vocab_size
    return Activations(
        layers=L * sbh * e_res if checkpointing else L * per_layer,
        final_norm=sbh * (e_res + e) + b * s * 8,
        loss_peak=logits * (e_logits + 12),
        logits_held=logits * e_logits,
        recompute=per_layer if checkpointing else 0,
    )


def activation_bytes(
    model: ModelConfig, *, micro_batch: int, mode: str, tp: int, device: str, checkpointing: bool
) -> int:
    """Activation memory at the start of backward (peak A of :class:`Activations`)."""
    return activations(
        model, micro_batch=micro_batch, mode=mode, tp=tp, device=device, checkpointing=checkpointing
    ).at_loss_backward


# --------------------------------------------------------------------------------------------
# One strategy.


def resolve_target(cfg: Config) -> Target:
    """The device and precision the plan is for. ``train.device=auto`` plans for GPUs (the
    point of planning); ``--train.device=cpu`` plans a CPU run. ``auto`` precision is bf16 on
    GPUs and fp32 on CPU, as ``ftrain train`` chooses."""
    device = "cpu" if cfg.train.device == "cpu" else "cuda"
    dtype = cfg.train.dtype if cfg.train.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    return Target(device, dtype)


def layout_for(cfg: Config, strategy: str, *, world_size: int, gpus_per_node: int, rank: int = 0) -> Layout:
    """Rank ``rank``'s layout for ``strategy`` (rank 0: the first pipeline stage's); ConfigError
    (naming the key) if it cannot run at this size."""
    parallel = dataclasses.replace(
        cfg.parallel,
        strategy=strategy,
        deterministic=cfg.parallel.deterministic and strategies.get(strategy).supports_deterministic,
    )
    n_head = cfg.model.n_head if not cfg.model.factory else None
    return compute_layout(
        parallel, world_size=world_size, rank=rank, local_world_size=min(gpus_per_node, world_size), n_head=n_head
    )


def overhead_bytes(cfg: Config, target: Target) -> int:
    if target.device == "cuda":
        return CUDA_RUNTIME_BYTES
    return CPU_BASELINE_BYTES + 8 * cfg.data.num_samples  # + the cursor's int64 epoch permutation


@dataclass(frozen=True, slots=True)
class StageTerms:
    """What one pipeline rank changes in :func:`estimate_with` (``ftrain.planning.plan_pipeline`` computes it)."""

    buffer_bytes: int
    """torch's P2P buffers: held from the first step on, through backward and the step."""
    pp_size: int
    pp_rank: int
    stages: tuple[int, ...]
    bubble_fraction: float
    in_flight: int


def accumulation_steps(cfg: Config, layout: Layout) -> int:
    """Micro-batches per data-parallel rank and step."""
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.dp_size))


def estimate_with(
    stats: ModelStats, cfg: Config, layout: Layout, target: Target, acts: Activations, stage: StageTerms | None = None
) -> MemoryEstimate:
    """:func:`estimate` for these parameters (``stats``: a pipeline rank's alone) and activations.

    FSDP strategies count the gradients of ``parallel.gradient_reduce``'s mode, ``auto`` resolved:
    ``last_micro_batch`` if its running peak fits ``target.memory_bytes`` on CUDA (or memory is not
    judged: no memory given, a CPU), else ``every_micro_batch``; the estimate names the mode.

    With ``stage`` (a pipeline rank, as ``ftrain.parallel.pipeline`` builds it): FSDP2 keeps its
    units and their fp32 gradients unsharded from each micro-batch's backward until the step
    (torch's ``PipelineStage`` sets ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)`` for every backward), whatever the accumulation; ddp
    has no DDP wrapper (no buckets: gradients accumulate in ``p.grad``, and one flat copy of them
    is all-reduced after the schedule); the P2P buffers come on top of backward and step."""
    strategy = strategies.get(layout.strategy)
    if strategy.wrapper is not Wrapper.FSDP:
        return _estimate(stats, cfg, layout, target, acts, stage, reduce="")
    if stage is not None:  # torch's PipelineStage reduces once per step, after the schedule
        return _estimate(stats, cfg, layout, target, acts, stage, reduce=LAST_MICRO_BATCH)
    setting = cfg.parallel.gradient_reduce
    if setting != "auto":
        return _estimate(stats, cfg, layout, target, acts, stage, reduce=setting)
    last = _estimate(stats, cfg, layout, target, acts, stage, reduce=LAST_MICRO_BATCH)
    judged = target.device == "cuda" and target.memory_bytes is not None
    mode = choose_gradient_reduce(
        "auto",
        accum_steps=accumulation_steps(cfg, layout),
        last_bytes=last.running_bytes if judged else None,
        memory_bytes=target.memory_bytes if judged else None,
    )
    return last if mode == LAST_MICRO_BATCH else _estimate(stats, cfg, layout, target, acts, stage, reduce=mode)


def _estimate(
    stats: ModelStats,
    cfg: Config,
    layout: Layout,
    target: Target,
    acts: Activations,
    stage: StageTerms | None,
    *,
    reduce: str,
) -> MemoryEstimate:
    """:func:`estimate_with` for one gradient reduction mode (``reduce``: "" for non-FSDP strategies)."""
    strategy = strategies.get(layout.strategy)
    s, ddp, fsdp = strategy.name, strategy.wrapper is Wrapper.DDP, strategy.wrapper is Wrapper.FSDP
    psi = stats.num_params
    tp = layout.tp_size
    shard = strategy.shard_count(layout)
    mode = precision_mode(strategy, target)
    e = 4 if target.dtype == "fp32" else 2  # compute dtype
    accum = accumulation_steps(cfg, layout)
    notes: list[str] = []

    def tp_local(p: ParamInfo) -> int:
        return math.prod(_tp_local_shape(p, tp))

    def stored(p: ParamInfo) -> int:  # what this rank keeps of p between steps
        return _fsdp_local_numel(_tp_local_shape(p, tp), shard) if fsdp else tp_local(p)

    local = sum(stored(p) for p in stats.params)
    params = 4 * local
    grads = 4 * local  # shaped like the parameters this rank holds
    opt_local = strategy.optimizer_numel(stats, layout, local)
    optimizer = 8 * opt_local
    # DDP's buckets are the gradients and live for the whole run; everywhere else gradients are
    # freed by zero_grad(set_to_none=True) and come back during backward as activations go.
    buckets = ddp and stage is None  # in a pipeline stage ddp is plain gradients and one flat all-reduce
    grads_in_backward = grads if buckets and not layout.deterministic else 0
    pipelined_fsdp = fsdp and stage is not None

    # Extras present through forward and backward (A), and at the last block's backward (B).
    extra_a = 0
    if mode == "autocast":
        extra_a += 2 * sum(tp_local(p) for p in stats.params if p.autocast_copy)
    unsharded = sum(tp_local(p) for p in stats.params)
    if accum > 1 or pipelined_fsdp:
        if buckets and not layout.deterministic:
            # zero_grad(set_to_none=True) detaches the gradients from DDP's buckets; no_sync
            # micro-batches then accumulate into fresh tensors beside the buckets (measured).
            extra_a += 4 * psi
            notes.append(
                f"{s}: {accum} accumulation steps: no_sync micro-batches accumulate into fresh "
                f"gradients beside DDP's buckets, {gib(4 * psi)} per rank"
            )
        elif fsdp and reduce == EVERY_MICRO_BATCH and not pipelined_fsdp:
            extra_a += 4 * local  # every micro-batch reduce-scatters into the gradient shards
            notes.append(
                f"{s}: {accum} accumulation steps, gradient_reduce={EVERY_MICRO_BATCH}: a reduce-scatter per "
                f"micro-batch, sharded gradients held between micro-batches ({gib(4 * local)} per rank; "
                f"{LAST_MICRO_BATCH} would hold {gib(4 * unsharded)})"
            )
        elif fsdp:
            extra_a += 4 * unsharded  # no-sync micro-batches accumulate unsharded fp32 gradients
            notes.append(
                f"{s}: in a pipeline stage torch keeps FSDP2 units and their fp32 gradients unsharded from the "
                "first backward to the step (set_reshard_after_backward(False), set_requires_gradient_sync(False)): "
                f"{4 + e} bytes per parameter of the rank's stages, in backward extra"
                if pipelined_fsdp
                else f"{s}: {accum} accumulation steps, gradient_reduce={LAST_MICRO_BATCH}: FSDP2 keeps unsharded "
                f"fp32 gradients between micro-batches (set_requires_gradient_sync(False)), {gib(4 * unsharded)} "
                f"per rank ({EVERY_MICRO_BATCH} would hold {gib(4 * local)}, a reduce-scatter per micro-batch)"
            )
        elif layout.deterministic:
            extra_a += 4 * psi * accum.bit_length()  # the streaming tree's partial sums
        else:
            extra_a += 4 * local  # p.grad accumulates
    buffers = stage.buffer_bytes if stage is not None else 0
    extra_a += buffers
    extra_b = extra_a
    if fsdp:
        root = sum(tp_local(p) for p in stats.params if p.unit == -1)
        block = max((sum(tp_local(p) for p in stats.params if p.unit == i) for i in range(stats.num_blocks)), default=0)
        grad_work = block * (e + 4)  # a block's unsharded gradient and fp32 reduce-scatter input
        if not strategy.reshard_after_forward or pipelined_fsdp:
            # ZeRO-2: every unit stays unsharded from its forward on (a pipeline stage: from its backward on).
            extra_a += e * unsharded
            extra_b = extra_a + e * root + grad_work
        else:
            # The root is gathered again when backward reaches the head and, with its unsharded
            # gradient, stays until backward ends; the current and prefetched blocks and the
            # all-gather buffer are unsharded, and the current block's gradient reduced.
            extra_b += 2 * e * root + 3 * e * block + grad_work
    peak = max(acts.at_loss_backward + extra_a, acts.at_last_block_backward + extra_b)
    transient = peak - acts.at_loss_backward

    # Optimizer step (activations gone, the loop still references the last logits).
    if target.device == "cuda" and ddp:
        step = 4 * opt_local  # foreach AdamW: sqrt(v) for the whole group at once
    else:
        step = 8 * max((stored(p) for p in stats.params), default=0)  # per-tensor AdamW temporaries
    if layout.deterministic:
        from ftrain.parallel.deterministic import cover  # the reduction's own tree

        total_micro = accum * layout.dp_size
        max_nodes = max(len(cover(0, total_micro, r * accum, (r + 1) * accum)) for r in range(layout.dp_size))
        step = max(step, 4 * psi * (layout.dp_size * max_nodes + max_nodes + 1))
        notes.append(
            f"ddp deterministic: the fixed-order reduction gathers {layout.dp_size}x{max_nodes} "
            "flattened fp32 gradients"
        )
    if stage is not None and ddp and layout.dp_size > 1:
        step = max(step, 4 * local)  # the stage's gradients flattened for its one all-reduce
    step += acts.logits_held + buffers

    # Start-up (ftrain.parallel.parallelize.build_for): where a rank holds part of the model, it is
    # built on the meta device and each parameter made whole once, on the CPU then on the device,
    # to copy this rank's part out; ddp and zero1 build the full fp32 model (plus DDP's buckets).
    if strategies.shards_model(layout):
        init = 4 * local + 4 * max((p.numel for p in stats.params), default=0)
    else:
        init = 4 * psi + (4 * psi if ddp else 4 * local)

    tp_split = sum(p.numel for p in stats.params if p.tp_dim is not None)
    textbook = strategy.textbook_model_state_bytes(psi, shard=shard, tp_split=tp_split, tp=tp)
    out = MemoryEstimate(
        strategy=s,
        world_size=layout.world_size,
        dp_size=layout.dp_size,
        tp_size=tp,
        shard_size=shard,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=optimizer,
        grads_in_backward_bytes=grads_in_backward,
        activation_bytes=acts.at_loss_backward,
        transient_bytes=transient,
        step_transient_bytes=step,
        init_bytes=init,
        overhead_bytes=overhead_bytes(cfg, target),
        textbook_model_state_bytes=textbook,
        notes=tuple(notes),
        gradient_reduce=reduce,
    )
    if stage is None:
        return out
    return dataclasses.replace(
        out,
        pp_size=stage.pp_size,
        pp_rank=stage.pp_rank,
        stages=stage.stages,
        bubble_fraction=stage.bubble_fraction,
        in_flight=stage.in_flight,
    )


def changed(cfg: Config, section: str, **changes) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


# --------------------------------------------------------------------------------------------
# The report.


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"
