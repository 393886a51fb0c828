"""Configuration: one dataclass per component, a TOML file, dotted CLI overrides.

Precedence is CLI > file > defaults. Every key is typed and documented (the ``help`` metadata
feeds ``ftrain config --reference`` and the README). Bad input fails at start with a
:class:`ConfigError` that names the key and, where it helps, the file and the fix.

What must stay true: every float key is finite (TOML's ``nan``/``inf`` are refused, whether from
the file, an override or a dataclass built in code) and every numeric key is in its range, so a
value that passes here cannot break training later. The checkpoint retention defaults equal
``checkpoint.retention.Retention``'s (a test checks it; this module stays free of torch).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ftrain.strategies import STRATEGIES
from ftrain.strategies import check_config as _check_strategy_config
from ftrain.strategies import check_parallel as _check_strategy_parallel


class ConfigError(ValueError):
    """A configuration problem, reported with the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = _opt(100, "Number of optimizer steps to run.")
    global_batch_size: int = _opt(
        32, "Sequences per optimizer step, fixed whatever the world size (accumulation adapts)."
    )
    micro_batch_size: int = _opt(8, "Sequences per forward/backward pass on one rank.")
    seed: int = _opt(0, "Seed for model initialisation and dropout.")
    grad_clip: float = _opt(1.0, "Clip the global gradient norm to this value (0 disables).")
    device: str = _opt("auto", "auto (cuda if available, else cpu), cpu or cuda.", ("auto", "cpu", "cuda"))
    dtype: str = _opt(
        "auto",
        "Parameter/compute precision: auto (bf16 mixed on GPU, fp32 on CPU), fp32 or bf16 "
        "(bf16 params and compute, fp32 gradient reduction and optimizer master state).",
        ("auto", "fp32", "bf16"),
    )
    save_final_path: str = _opt(
        "", "If set, rank 0 writes the final full model and optimizer state here (torch.save)."
    )
    on_nonfinite: str = _opt(
        "skip", "A non-finite loss or gradient norm: skip the optimizer step, rollback to the last verified "
        "checkpoint, or halt.", ("skip", "rollback", "halt"),
    )

    def __post_init__(self) -> None:
        _positive("train.steps", self.steps)
        _positive("train.global_batch_size", self.global_batch_size)
        _positive("train.micro_batch_size", self.micro_batch_size)
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of train.micro_batch_size="
                f"{self.micro_batch_size}",
            )
        _check_floats("train", self)
        _at_least("train.grad_clip", self.grad_clip, 0)
        _int_range("train.seed", self.seed, -(2**63), 2**64 - 1)  # what torch.manual_seed accepts


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    factory: str = _opt(
        "",
        'Build a user model: "pkg.module:function", called with this ModelConfig, returning an '
        "nn.Module whose forward(tokens) returns logits. Empty: the built-in GPT. This imports and runs code: "
        "a config file is as trusted as code.",
    )
    vocab_size: int = _opt(256, "Vocabulary size (must exceed every token id of the data).")
    seq_len: int = _opt(128, "Tokens per training sequence (context length).")
    n_layer: int = _opt(4, "Transformer blocks.")
    n_head: int = _opt(4, "Attention heads per block.")
    d_model: int = _opt(128, "Hidden size (a multiple of n_head).")
    mlp_ratio: int = _opt(4, "MLP hidden size as a multiple of d_model.")
    dropout: float = _opt(0.0, "Dropout probability (0 keeps runs bitwise reproducible).")

    def __post_init__(self) -> None:
        if self.factory and ":" not in self.factory:
            raise ConfigError("model.factory", f'expected "pkg.module:function", got {self.factory!r}')
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            _positive(f"model.{name}", getattr(self, name))
        if self.d_model % self.n_head:
            raise ConfigError(
                "model.d_model", f"{self.d_model} is not a multiple of model.n_head={self.n_head}"
            )
        _check_floats("model", self)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("model.dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = _opt(
        "synthetic",
        "synthetic (a seeded Markov chain with a known entropy floor) or the path of a flat "
        "token file (uint16/uint32 memmap, nanoGPT/Megatron layout).",
    )
    token_dtype: str = _opt(
        "auto", "Token file element type; auto: uint16 if vocab_size <= 65536, else uint32.",
        ("auto", "uint16", "uint32"),
    )
    seed: int = _opt(0, "Seed of the synthetic chain and of the per-epoch sample permutation.")
    num_samples: int = _opt(1_000_000, "Synthetic source: sequences per epoch.")
    branching: int = _opt(4, "Synthetic source: possible successors of each token.")
    concentration: float = _opt(
        0.5, "Synthetic source: Dirichlet concentration of transition probabilities (lower = less entropy)."
    )
    ledger_dir: str = _opt(
        "", "If set, each data-parallel rank appends the sample ids it consumed per step here."
    )

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data.source", 'must be "synthetic" or a token file path')
        if self.source != "synthetic" and not Path(self.source).is_file():
            raise ConfigError(
                "data.source",
                f"token file {self.source!r} does not exist (give a flat uint16/uint32 token "
                'file, or "synthetic")',
            )
        _check_floats("data", self)
        _positive("data.num_samples", self.num_samples)
        _positive("data.branching", self.branching)
        _int_range("data.seed", self.seed, 0, 2**63 - 1)  # the data cursor's permutation seed
        if self.concentration <= 0:
            raise ConfigError("data.concentration", f"must be > 0, got {self.concentration}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = _opt(3e-4, "Peak learning rate (before world-size scaling).")
    min_lr_ratio: float = _opt(0.1, "Cosine decay floor as a fraction of the peak.")
    warmup_steps: int = _opt(10, "Linear warmup steps; cosine decay to the floor afterwards.")
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only; not biases/norms/embeddings).")
    beta1: float = _opt(0.9, "AdamW beta1.")
    beta2: float = _opt(0.95, "AdamW beta2.")
    eps: float = _opt(1e-8, "AdamW epsilon.")
    lr_scaling: str = _opt(
        "none",
        "Scale the peak LR with the data-parallel size relative to optim.base_world_size: "
        "none, linear or sqrt.",
        ("none", "linear", "sqrt"),
    )
    base_world_size: int = _opt(1, "Data-parallel size at which optim.lr is the peak LR as given.")

    def __post_init__(self) -> None:
        _check_floats("optim", self)
        if self.lr <= 0:
            raise ConfigError("optim.lr", f"must be > 0, got {self.lr}")
        _at_least("optim.weight_decay", self.weight_decay, 0)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        _positive("optim.eps", self.eps)
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _positive("optim.base_world_size", self.base_world_size)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    strategy: str = _opt("ddp", "Parallelism: " + ", ".join(STRATEGIES) + ".", STRATEGIES)
    deterministic: bool = _opt(
        False,
        "Fixed-order gradient reduction: bitwise identical results at any world size "
        "(ddp only; costs world_size x gradient memory for the gather).",
    )
    tp_size: int = _opt(0, "Tensor-parallel degree for tp / fsdp+tp (0: all ranks for tp, 2 for fsdp+tp).")
    shard_size: int = _opt(0, "HSDP shard-group size (0: ranks per node, or 2 if that is the whole world).")
    bucket_cap_mb: float = _opt(25.0, "DDP gradient bucket size in MB.")
    static_graph: bool = _opt(False, "DDP static_graph (same graph every step).")
    activation_checkpointing: bool = _opt(False, "Recompute each block's activations in backward.")
    backend: str = _opt("auto", "Process-group backend: auto (nccl on GPU, gloo on CPU), gloo or nccl.",
                        ("auto", "gloo", "nccl"))
    timeout_s: float = _opt(120.0, "Collective and rendezvous timeout in seconds.")

    def __post_init__(self) -> None:
        _check_floats("parallel", self)
        if self.tp_size < 0:
            raise ConfigError("parallel.tp_size", f"must be >= 0, got {self.tp_size}")
        if self.shard_size < 0:
            raise ConfigError("parallel.shard_size", f"must be >= 0, got {self.shard_size}")
        _check_strategy_parallel(self)  # strategy hook: a registered name; deterministic only where supported
        if self.bucket_cap_mb <= 0:
            raise ConfigError("parallel.bucket_cap_mb", f"must be > 0, got {self.bucket_cap_mb}")
        if self.timeout_s <= 0:
            raise ConfigError("parallel.timeout_s", f"must be > 0, got {self.timeout_s}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    uri: str = _opt(
        "", "This job's checkpoint root: a path, file://, s3://bucket/prefix or any fsspec URL (empty: no "
        "checkpoints). Step directories go directly under it, so give every job its own, e.g. "
        "s3://bucket/ckpt/<job>; a step of another job found here is refused."
    )
    interval: int = _opt(100, "Save every this many steps (0: only the final save).")
    async_mode: str = _opt(
        "thread", "off (blocking saves), thread or process (training blocks only for staging).",
        ("off", "thread", "process"),
    )
    when_busy: str = _opt(
        "wait", "When a save is due while the previous one still uploads: wait for it, or skip this one.",
        ("wait", "skip"),
    )
    digest: str = _opt("xxh3_128", "Per-file digest recorded in the manifest.", ("xxh3_128", "crc32c"))
    hmac_key_env: str = _opt(
        "", "Name of an environment variable holding a key: manifests are signed and checked with HMAC-SHA256, "
        "bound to the job id (FTRAIN_JOB, set by the node agent, or agent.job), which must then be known."
    )
    resume: bool = _opt(True, "Load the newest verified checkpoint under checkpoint.uri at start.")
    load_step: int = _opt(-1, "Load exactly this step (fails if it is not committed and verified); -1: newest.")
    on_no_loadable_step: str = _opt(
        "fail", "Step directories with manifests exist but none loads (wrong HMAC key or job, all corrupt): fail "
        "with the list of steps and why each was refused, or start fresh from step 0 (the old step directories "
        "are replaced as the new run saves).", ("fail", "fresh"),
    )
    max_failed_commits: int = _opt(
        3, "Consecutive failed checkpoint commits after which training stops instead of running unprotected. "
        "0: never stop."
    )
    final_save: bool = _opt(True, "Save synchronously at the end of training and on a graceful stop (SIGTERM).")
    keep_last: int = _opt(3, "Retention: keep the newest N committed steps.")
    keep_every: int = _opt(0, "Retention: also keep every step divisible by this (0: off).")
    gc_grace_s: float = _opt(600.0, "Retention: uncommitted step directories older than this are removed.")
    endpoint_url: str = _opt("", "S3 endpoint URL (default: AWS_ENDPOINT_URL); credentials come from AWS_*.")
    region: str = _opt("", "S3 region (default: AWS_REGION).")

    def __post_init__(self) -> None:
        _check_floats("checkpoint", self)
        if self.interval < 0:
            raise ConfigError("checkpoint.interval", f"must be >= 0, got {self.interval}")
        if self.keep_last < 1:
            raise ConfigError("checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ConfigError("checkpoint.keep_every", f"must be >= 0, got {self.keep_every}")
        _at_least("checkpoint.gc_grace_s", self.gc_grace_s, 0)
        _at_least("checkpoint.load_step", self.load_step, -1)
        _at_least("checkpoint.max_failed_commits", self.max_failed_commits, 0)
        if self.hmac_key_env and not os.environ.get(self.hmac_key_env):
            raise ConfigError("checkpoint.hmac_key_env",
                              f"environment variable {self.hmac_key_env} is not set (or empty): export the key there, "
                              "or leave checkpoint.hmac_key_env empty for unsigned manifests")


@dataclass(kw_only=True, slots=True)
class ConsistencyConfig:
    interval: int = _opt(
        0, "Every this many steps (and after every load), compare digests of replicated parameters and "
        "optimizer state across ranks that must hold identical copies (0: only after loads)."
    )
    on_mismatch: str = _opt(
        "halt", "When replicas differ: warn, halt (exit non-zero) or rollback (reload the last verified checkpoint).",
        ("warn", "halt", "rollback"),
    )

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError("consistency.interval", f"must be >= 0, got {self.interval}")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    metrics_path: str = _opt("", "JSON lines file written by rank 0, one line per step (empty: off).")
    progress: str = _opt(
        "auto", "Rank-0 progress: auto (a bar on a terminal, lines otherwise), bar, lines or off.",
        ("auto", "bar", "lines", "off"),
    )
    log_every: int = _opt(10, "Steps between progress lines when not drawing a bar.")
    events_path: str = _opt(
        "", "JSON lines file of lifecycle events (ckpt_staged, ckpt_committed, ckpt_corrupt, resumed, ...) "
        "appended by every rank (empty: off)."
    )

    def __post_init__(self) -> None:
        _positive("logging.log_every", self.log_every)


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Read by ``ftrain agent`` (its command-line options override these); workers ignore it."""
    etcd: str = _opt("", "etcd client URLs, comma-separated (http://host:port,...).")
    job: str = _opt("", "Job id: the agents of one job share it (and its keys in etcd).")
    nnodes: str = _opt("1:1", "MIN:MAX nodes (or N): rounds need at least MIN live agents and take at most MAX.")
    nproc_per_node: int = _opt(1, "Workers per node.")
    node_id: str = _opt("", "This agent's node id (default: the host name); unique among live agents.")
    host: str = _opt("127.0.0.1", "Address the other nodes reach this one at (rendezvous when it is node rank 0).")
    lease_ttl_s: int = _opt(5, "etcd lease TTL: a node whose agent is silent this long is lost (min 2).")
    settle_s: float = _opt(2.0, "Membership must be quiet this long before a round forms (last call for joiners).")
    hang_timeout_s: float = _opt(120.0, "No heartbeat from a training worker for this long: dump stacks, restart.")
    start_timeout_s: float = _opt(
        300.0, "Limit for start-up, checkpoint loads and saves (no step heartbeat), and for all members to start.")
    max_restarts: int = _opt(10, "Failures (worker exit, hang, start timeout) allowed within restart_window_s.")
    restart_window_s: float = _opt(3600.0, "Window of the restart budget.")
    backoff_initial_s: float = _opt(1.0, "Wait before the 2nd restart in the window; doubles after each failure.")
    backoff_max_s: float = _opt(30.0, "Longest wait between restarts.")
    deterministic_failures: int = _opt(
        3, "The workers failed with the same error at the same step this many times in a row: stop the job "
        "with that error instead of spending the restart budget (0: never).")
    scale_up: str = _opt(
        "checkpoint", "Nodes that join a running job enter at the next committed checkpoint, or immediately.",
        ("checkpoint", "immediate"),
    )
    metrics_port: int = _opt(-1, "Prometheus metrics port (0: any free port, -1: off).")
    run_dir: str = _opt("", "Worker logs and stack dumps (default: a new temporary directory).")

    def __post_init__(self) -> None:
        _check_floats("agent", self)
        parse_nnodes(self.nnodes, "agent.nnodes")
        _positive("agent.nproc_per_node", self.nproc_per_node)
        if self.lease_ttl_s < 2:
            raise ConfigError("agent.lease_ttl_s", f"must be >= 2 (etcd's minimum lease), got {self.lease_ttl_s}")
        _at_least("agent.settle_s", self.settle_s, 0)
        for name in ("hang_timeout_s", "start_timeout_s", "restart_window_s"):
            _positive(f"agent.{name}", getattr(self, name))
        _at_least("agent.max_restarts", self.max_restarts, 0)
        _at_least("agent.deterministic_failures", self.deterministic_failures, 0)
        _at_least("agent.backoff_initial_s", self.backoff_initial_s, 0)
        _at_least("agent.backoff_max_s", self.backoff_max_s, self.backoff_initial_s)
        _int_range("agent.metrics_port", self.metrics_port, -1, 65535)


def parse_nnodes(text: str, key: str = "--nnodes") -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max)."""
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(key, f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise ConfigError(key, f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


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
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        _check_strategy_config(self)  # strategy hook: e.g. zero1 refuses checkpoint.uri

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A stable hash of what is trained (recorded in checkpoints; the agent section is left
        out: how a job is supervised does not change what it computes)."""
        training = {k: v for k, v in self.to_dict().items() if k != "agent"}
        blob = json.dumps(training, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _positive(key: str, value: int | float) -> None:
    if not value > 0:  # "not >" so that NaN fails too
        raise ConfigError(key, f"must be > 0, got {value}")


def _at_least(key: str, value: int | float, minimum: int | float) -> None:
    if not value >= minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")


def _int_range(key: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(key, f"must be in [{low}, {high}], got {value}")


def _check_floats(section: str, obj: Any) -> None:
    """Every float field of ``obj`` is finite (a section built in code skips _check_type)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "float" and not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ConfigError(f"{section}.{f.name}", f"must be a finite number, got {value!r}")


def worker_job_id(cfg: Config, environ: Any = None) -> str:
    """The job id of a worker: ``FTRAIN_JOB`` (set by the node agent) or else ``agent.job``.

    Checkpoint manifests record it and readers refuse another job's steps. With
    ``checkpoint.hmac_key_env`` set it must be known: the signature binds the job.
    """
    from checkpoint.manifest import job_problem  # torch-free; only workers need it

    env = os.environ if environ is None else environ
    job, key = (env["FTRAIN_JOB"], "FTRAIN_JOB") if env.get("FTRAIN_JOB") else (cfg.agent.job, "agent.job")
    why = job_problem(job)
    if why is not None:
        raise ConfigError(key, f"job id {why}")
    if cfg.checkpoint.uri and cfg.checkpoint.hmac_key_env and not job:
        raise ConfigError("checkpoint.hmac_key_env",
                          "signed manifests are bound to the job id, but no job id is known: set agent.job=<job id> "
                          "(or run under `ftrain agent`, which sets FTRAIN_JOB), or leave checkpoint.hmac_key_env "
                          "empty")
    return job


def _suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _check_type(key: str, f: dataclasses.Field, value: Any) -> Any:
    expected = _TYPES[f.type]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (expected is int and isinstance(value, bool)) or not isinstance(value, expected):
        raise ConfigError(key, f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
    if expected is float and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(choices)}")
    return value


def _parse_override(arg: str) -> tuple[str, str]:
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError("", f"bad override {arg!r}: expected --section.key=value")
    key, _, raw = arg[2:].partition("=")
    if key.count(".") != 1:
        raise ConfigError(key, f"bad override {arg!r}: expected --section.key=value")
    return key, raw


def _coerce_raw(f: dataclasses.Field, raw: str) -> Any:
    """Turn an override's text into a value of the field's type (TOML syntax, strings bare)."""
    if f.type == "str":
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # reported as a type error naming the key


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Config:
    """Resolve defaults < TOML file < ``--section.key=value`` overrides into a validated Config."""
    values: dict[str, dict[str, Any]] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        try:
            with open(path, "rb") as fh:
                values = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError("", f"config file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("", f"{path}: invalid TOML: {e}") from None
    known = sections()
    resolved: dict[str, dict[str, Any]] = {}
    for section, body in values.items():
        if section not in known:
            raise ConfigError(section, f"unknown section in {origin}{_suggest(section, known)}")
        if not isinstance(body, dict):
            raise ConfigError(section, f"expected a [{section}] table in {origin}")
        fields = {f.name: f for f in dataclasses.fields(known[section])}
        for name, value in body.items():
            key = f"{section}.{name}"
            if name not in fields:
                raise ConfigError(key, f"unknown key in {origin}{_suggest(name, fields)}")
            resolved.setdefault(section, {})[name] = _check_type(key, fields[name], value)
    for arg in overrides:
        key, raw = _parse_override(arg)
        section, name = key.split(".")
        if section not in known:
            raise ConfigError(key, f"unknown section {section!r}{_suggest(section, known)}")
        fields = {f.name: f for f in dataclasses.fields(known[section])}
        if name not in fields:
            raise ConfigError(key, f"unknown key{_suggest(name, fields)}")
        resolved.setdefault(section, {})[name] = _check_type(key, fields[name], _coerce_raw(fields[name], raw))
    return Config(**{s: cls(**resolved.get(s, {})) for s, cls in known.items()})


def reference_markdown() -> str:
    """The configuration reference (every key, type, default and meaning) as Markdown."""
    lines = []
    for section, cls in sections().items():
        lines += [f"### `[{section}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            t = f.type
            default = json.dumps(f.default)
            help_ = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{section}.{f.name}` | {t} | `{default}` | {help_} |")
        lines.append("")
    return "\n".join(lines)
