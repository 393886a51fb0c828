"""Which run a memory-tier snapshot belongs to, and whether this run may resume from it.

Snapshots kept in ``checkpoint.memory_dir`` outlive the processes that wrote them, and a job that
ends any other way than normally leaves them behind. A later run of the same job id — another
seed or learning rate, another checkpoint root, or the same configuration started anew — must
never resume from them: its storage says where it starts, not a leftover in host memory. So the
manifest of every snapshot records what it is bound to (:class:`Binding`), and a worker takes a
snapshot only when all of it equals its own (:func:`binding_problem`):

- the **run id**: which launch of the job wrote it. ``FTRAIN_RUN_ID`` when the launcher sets it;
  else, under an ``ftrain agent``, the job's incarnation in etcd (the cluster id and the create
  revision of the job's round key: :meth:`ftrain.agent_link.fence.EtcdRoundFence.incarnation`), the same for
  every round and restart of the job and new when the job is started anew; else torchrun's
  ``TORCHELASTIC_RUN_ID`` (``torchrun --standalone`` draws a fresh uuid per launch and keeps it
  across its own ``--max-restarts``; torchrun without ``--rdzv-id`` says ``none``, which is no
  id). A worker that knows none of these cannot tell this run's snapshots from another's: the
  on-disk tier stays off (:func:`resolve_run_id` says why, and how to give one);
- the **config hash** (:meth:`ftrain.config.Config.digest`, what is trained);
- the **checkpoint root** (``checkpoint.uri``).

What must stay true: a snapshot whose binding differs in any of the three is skipped and
reported (naming what differs), never loaded; the ranks of a round use one run id, agreed
(:func:`agree_run_id`), so they all take or all skip the same snapshot. Pure functions here,
except :func:`resolve_run_id`, which may ask etcd once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ftrain.checkpoint.errors import CheckpointError
from ftrain.checkpoint.manifest import Manifest
from ftrain.config import OTHER_SECTIONS
from ftrain.contract.worker_env import RUN_ID, WorkerEnv

log = logging.getLogger(__name__)

TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"
#: what torchrun puts in TORCHELASTIC_RUN_ID when it was given no --rdzv-id: no run id at all
TORCHRUN_NO_ID = "none"
#: differing config keys named in a message at most
MAX_NAMED_KEYS = 6
NO_RUN_ID_FIX = (
    f"set {RUN_ID} to an id of this launch (one that changes when the job is started anew), or launch with "
    "`torchrun --standalone` or `torchrun --rdzv-id=<id of this launch>`, or under `ftrain agent`"
)


@dataclass(frozen=True, slots=True)
class Binding:
    """What a snapshot is bound to (see the module doc)."""

    run_id: str
    config_hash: str
    root: str
    config: Mapping[str, Any]  #: the resolved config (to name the keys that differ)


def resolve_run_id(
    environ: Mapping[str, str] | None = None,
    incarnation: Callable[[], str] | None = None,
    *,
    ask_etcd: bool = True,
) -> tuple[str, str]:
    """This launch's run id and where it came from, or ``("", why none)`` (see the module doc).
    ``incarnation``: asks etcd for the job's incarnation (default: through the worker's fence,
    when its agent gave it one). ``ask_etcd=False``: a rank that leaves that question to another
    (one read per round, not one per rank: 32,768 at a restart of 4,096 nodes of 8) learns
    nothing from etcd and falls back on nothing else either, so that it never names another id."""
    env = os.environ if environ is None else environ
    worker = WorkerEnv.from_env(env)
    if worker.run_id:
        return worker.run_id, RUN_ID
    if not ask_etcd and incarnation is None and worker.etcd and worker.fence_key:
        return "", "rank 0 reads the job's incarnation from etcd"
    if incarnation is None and worker.etcd and worker.fence_key:
        from ftrain.agent_link.fence import from_env

        fence = from_env()
        incarnation = fence.incarnation if fence is not None else None
    if incarnation is not None:
        try:
            return incarnation(), "the job's round key in etcd"
        except CheckpointError as e:
            return "", f"the job's incarnation could not be read from etcd ({e})"
    torchrun = env.get(TORCHRUN_RUN_ID, "")
    if torchrun and torchrun != TORCHRUN_NO_ID:
        return torchrun, TORCHRUN_RUN_ID
    if torchrun == TORCHRUN_NO_ID:
        return "", f"torchrun was given no --rdzv-id ({TORCHRUN_RUN_ID}={TORCHRUN_NO_ID})"
    return "", "no launcher gave this worker a run id"


def agree_run_id(ids: list[str]) -> tuple[str, str]:
    """Pure: the round's run id from every rank's (by rank; "" where a rank could not learn it),
    or ``("", why)`` when no rank knows one or ranks know different ones."""
    known = sorted({i for i in ids if i})
    if len(known) == 1:
        return known[0], ""
    if not known:
        return "", "no rank knows the run id"
    return "", f"the ranks name different run ids ({', '.join(repr(k[:60]) for k in known[:4])})"


def binding_of(cfg_dict: Mapping[str, Any], config_hash: str, run_id: str) -> Binding:
    checkpoint = cfg_dict.get("checkpoint")
    root = checkpoint.get("uri", "") if isinstance(checkpoint, Mapping) else ""
    return Binding(run_id, config_hash, root if isinstance(root, str) else "", cfg_dict)


def binding_problem(manifest: Manifest, ours: Binding) -> str:
    """Pure: why the snapshot of ``manifest`` is not this run's ("" if it is): what differs."""
    theirs = binding_of(manifest.config, manifest.config_hash, manifest.run_id)
    problems = []
    if theirs.run_id != ours.run_id:
        problems.append(f"another run (run id {theirs.run_id[:80]!r}, this run {ours.run_id[:80]!r})")
    if theirs.root != ours.root:
        problems.append(f"another checkpoint root (checkpoint.uri {theirs.root[:200]!r}, now {ours.root[:200]!r})")
    if theirs.config_hash != ours.config_hash:
        keys = config_differences(theirs.config, ours.config)
        problems.append(
            f"another config (hash {theirs.config_hash[:40]!r}, now {ours.config_hash!r}"
            + (f": {'; '.join(keys)}" if keys else "")
            + ")"
        )
    return ", ".join(problems)


def config_differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """Pure: ``key: theirs -> ours`` for the dotted keys whose values differ (at most
    :data:`MAX_NAMED_KEYS`, then how many more)."""
    a, b = _flat(_trained(theirs)), _flat(_trained(ours))
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING))
    named = [f"{k}: {_short(a.get(k, _MISSING))} -> {_short(b.get(k, _MISSING))}" for k in keys[:MAX_NAMED_KEYS]]
    if len(keys) > MAX_NAMED_KEYS:
        named.append(f"{len(keys) - MAX_NAMED_KEYS} more")
    return named


class _Missing:
    def __repr__(self) -> str:
        return "(unset)"


_MISSING = _Missing()


def _trained(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sections the config hash covers (how a job is supervised is left out of it)."""
    return {k: v for k, v in config.items() if k not in OTHER_SECTIONS}


def _flat(obj: Mapping[str, Any], prefix: str = "", depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth < 8:
            out.update(_flat(value, f"{name}.", depth + 1))
        else:
            out[name] = value
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "Binding",
    "NO_RUN_ID_FIX",
    "agree_run_id",
    "binding_of",
    "binding_problem",
    "config_differences",
    "resolve_run_id",
]
