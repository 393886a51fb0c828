"""The ``[checkpoint]`` section of the config file: the checkpoint service's settings.

These are the service's only defaults: :class:`ftrain.checkpoint.manager.CheckpointManager`,
:class:`ftrain.checkpoint.retention.Retention` and ``ftrain ckpt gc`` take theirs from here.
Standard library only, so that torch-free processes (the node agent) can validate a config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ftrain.contract.config import ConfigError, at_least, check_floats, opt

ON_NO_LOADABLE_STEP = ("fail", "fresh")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    uri: str = opt(
        "",
        "This job's checkpoint root: a path, file://, s3://bucket/prefix or any fsspec URL (empty: no "
        "checkpoints). Step directories go directly under it, so give every job its own, e.g. "
        "s3://bucket/ckpt/<job>; a step of another job found here is refused.",
    )
    interval: int = opt(100, "Save every this many steps (0: only the final save).")
    async_mode: str = opt(
        "thread",
        "off (blocking saves), thread or process (training blocks only for staging).",
        ("off", "thread", "process"),
    )
    when_busy: str = opt(
        "wait",
        "When a save is due while the previous one still uploads: wait for it, or skip this one.",
        ("wait", "skip"),
    )
    digest: str = opt("xxh3_128", "Per-file digest recorded in the manifest.", ("xxh3_128", "crc32c"))
    hmac_key_env: str = opt(
        "",
        "Name of an environment variable holding a key: manifests are signed and checked with HMAC-SHA256, "
        "bound to the job id (FTRAIN_JOB, set by the node agent, or agent.job), which must then be known. The "
        "memory tier's snapshots (checkpoint.memory_dir) are signed and checked with it too; without a key a "
        "worker warns at start that this user's other processes (and root) could plant a snapshot there.",
    )
    resume: bool = opt(True, "Load the newest verified checkpoint under checkpoint.uri at start.")
    load_step: int = opt(-1, "Load exactly this step (fails if it is not committed and verified); -1: newest.")
    on_no_loadable_step: str = opt(
        "fail",
        "Step directories with manifests exist but none loads (wrong HMAC key or job, all corrupt): fail "
        "with the list of steps and why each was refused, or start fresh from step 0 (the old step directories "
        "are replaced as the new run saves).",
        ON_NO_LOADABLE_STEP,
    )
    max_failed_commits: int = opt(
        3,
        "Consecutive failed checkpoint commits after which training stops instead of running unprotected. "
        "0: never stop.",
    )
    final_save: bool = opt(True, "Save synchronously at the end of training and on a graceful stop (SIGTERM).")
    keep_last: int = opt(3, "Retention: keep the newest N committed steps.")
    keep_every: int = opt(0, "Retention: also keep every step divisible by this (0: off).")
    gc_grace_s: float = opt(600.0, "Retention: uncommitted step directories older than this are removed.")
    memory_interval: int = opt(
        -1,
        "Live recovery, strategies that keep no full replica (fsdp, zero2, tp, hsdp): every this many steps each "
        "rank's shards are copied into host memory, its own and a buddy's on another node, so that a lost rank "
        "heals from a peer's memory instead of storage. -1: as often as a snapshot blocks training for at most "
        "2% of the step time (measured); 0: off.",
    )
    memory_dir: str = opt(
        "",
        "A node-local directory in host memory (a tmpfs such as /dev/shm) where the memory tier "
        "(checkpoint.memory_interval) keeps its snapshots, so that they outlive the worker processes: restarted "
        "workers (agent.recovery=restart), and under live recovery a round whose every worker is new, load the "
        "newest snapshot their nodes and their buddies kept before they read storage. Set, it keeps snapshots for "
        "every strategy, ddp included. Empty: snapshots live in the worker processes (live recovery, strategies "
        "without a full replica only). <memory_dir>/ftrain-tier-<job> and everything below it are created "
        "0700 with files 0600; one that another user owns or can write turns the on-disk tier off (said once). A "
        "snapshot is resumed only by the run that took it (run id: FTRAIN_RUN_ID, the agent's job incarnation or "
        "torchrun's run id; the same config hash and checkpoint.uri); another run's are skipped and named.",
    )
    local_cache_dir: str = opt(
        "",
        "A node-local directory where each node keeps a copy of the files it wrote of the newest committed step; "
        "a load (a restart, an in-process fallback) reads them from there before storage, each block checked "
        "against the manifest in storage. Its directories are created 0700 (one another user owns or can write "
        "turns the cache off, said once); files are never written through a link. Empty: off.",
    )
    endpoint_url: str = opt("", "S3 endpoint URL (default: AWS_ENDPOINT_URL); credentials come from AWS_*.")
    region: str = opt("", "S3 region (default: AWS_REGION).")

    def __post_init__(self) -> None:
        check_floats("checkpoint", self)
        if self.interval < 0:
            raise ConfigError("checkpoint.interval", f"must be >= 0, got {self.interval}")
        if self.keep_last < 1:
            raise ConfigError("checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ConfigError("checkpoint.keep_every", f"must be >= 0, got {self.keep_every}")
        at_least("checkpoint.gc_grace_s", self.gc_grace_s, 0)
        at_least("checkpoint.load_step", self.load_step, -1)
        at_least("checkpoint.max_failed_commits", self.max_failed_commits, 0)
        at_least("checkpoint.memory_interval", self.memory_interval, -1)
        if self.hmac_key_env and not os.environ.get(self.hmac_key_env):
            raise ConfigError(
                "checkpoint.hmac_key_env",
                f"environment variable {self.hmac_key_env} is not set (or empty): export the key there, "
                "or leave checkpoint.hmac_key_env empty for unsigned manifests",
            )


DEFAULTS = CheckpointConfig()
"""Every default in one instance (its ``hmac_key_env`` is empty, so building it reads no environment)."""
