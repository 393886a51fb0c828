"""The memory tier in a user's loop (:meth:`ftrain.Session.run` under live recovery): what a
snapshot of the loop's state holds, and how a restored one goes back into the loop's objects.

A model whose parameters are spread over the ranks (FSDP, TP, FSDP+TP, HSDP: some parameter is a
DTensor) has no rank that holds all of it, so a lost rank's shards cannot come from a live peer.
The memory tier (:mod:`ftrain.recovery.memory_tier`, the same one ``ftrain train`` uses) keeps
each rank's shards in host memory, its own and a buddy's on another node, at the step boundaries
:meth:`ftrain.Session.step` marks. :class:`SessionTierView` is what it snapshots: the module and
its optimizers in DCP's per-parameter form (as a session's checkpoint), and the loop's other
entries (scheduler, sampler, counters) encoded by :mod:`ftrain.state_codec` in the snapshot's
manifest, as they were at that boundary, so that they decode exactly and nothing is unpickled.
Each rank's own entries (its RNG states: :mod:`ftrain.session_per_rank`) are tensors of the
snapshot, so a lost rank's come back from its buddy's copy with its shards.

The tier refuses a snapshot any rank cannot take (a manifest of another writer, an entry missing
or not decoding): every rank then loads from storage.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ftrain import state_codec
from ftrain.checkpoint.config import CheckpointConfig
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.loading import writer_of
from ftrain.checkpoint.manifest import Manifest
from ftrain.config import Config, ParallelConfig
from ftrain.contract.events import EventLog
from ftrain.recovery.memory_tier import MemoryTier
from ftrain.recovery.tier_binding import Binding
from ftrain.session_per_rank import CAPACITY_KEY, capacities
from ftrain.session_state import WRITER, SessionError, StateParts, manifest_fields

if TYPE_CHECKING:
    from ftrain.session_live import Round

#: the manifest's trainer key holding the loop's other entries, encoded (name -> text)
ENCODED_KEY = "user_state_encoded"


@dataclasses.dataclass
class SessionTierView:
    """One round's state of a user's loop as the memory tier sees it (a
    :class:`~ftrain.recovery.memory_tier.TierSubject`). ``step`` and ``entries``: the last step
    boundary and the loop's other entries encoded as they were then (:meth:`mark`)."""

    parts: StateParts
    device: torch.device
    rank: int
    world_size: int
    round: int
    events: EventLog = dataclasses.field(default_factory=EventLog)
    #: what the snapshots are bound to (the tier's :class:`~ftrain.recovery.tier_binding.Binding`:
    #: the session's checkpoint root and settings): a snapshot of another binding is refused
    binding: Binding | None = None
    last_step_time_s: float = 0.0
    step: int = 0
    entries: dict[str, str] = dataclasses.field(default_factory=dict)
    _decoded: dict[str, Any] = dataclasses.field(default_factory=dict)

    def mark(self, step: int, parts: StateParts, entries: dict[str, str], step_time_s: float) -> None:
        """Step ``step`` is done: what a snapshot taken now holds."""
        self.step, self.parts, self.entries, self.last_step_time_s = step, parts, entries, step_time_s

    def tier_state(self) -> dict[str, Any]:
        return self.parts.state_dict()  # collective with per-rank entries (every rank snapshots the step)

    def tier_fields(self) -> dict[str, Any]:
        fields = manifest_fields(self.round, self.world_size, self.step, self.parts.capacities)
        capacities = fields["trainer"][CAPACITY_KEY]
        fields["trainer"] = {"step": self.step, ENCODED_KEY: dict(self.entries), CAPACITY_KEY: capacities}
        if self.binding is not None:  # its checkpoint root (the tier stamps the rest of its binding)
            fields["config"] = dict(self.binding.config)
        return fields

    def tier_target(self, manifest: Manifest) -> dict[str, Any]:
        """The load's target, once the snapshot's entries decode and fit this loop's state."""
        if writer_of(manifest) != WRITER:
            raise ManifestError(f"snapshot of step {manifest.step} was not written by a session")
        encoded = manifest.trainer.get(ENCODED_KEY)
        if not isinstance(encoded, dict) or not all(isinstance(v, str) for v in encoded.values()):
            raise ManifestError(f"snapshot of step {manifest.step}: trainer.{ENCODED_KEY} is not name -> text")
        capacities(manifest)  # ManifestError for a malformed record of the per-rank entries
        try:
            decoded = {name: state_codec.decode(text) for name, text in encoded.items()}
            self.parts.check_fits(manifest, decoded)
        except (state_codec.StateDecodeError, SessionError) as e:
            raise ManifestError(f"snapshot of step {manifest.step}: {e}") from e
        self._decoded = decoded
        return self.parts.state_dict(manifest)

    def tier_apply(self, manifest: Manifest, target: dict[str, Any]) -> None:
        self.parts.apply(manifest, self._decoded)
        self._decoded = {}


class SessionTier:
    """A session's memory tier across the rounds its process serves (:meth:`ftrain.Session.run`
    under live recovery): ``ftrain train``'s :class:`~ftrain.recovery.memory_tier.MemoryTier`, set
    up from the session's settings, joined by the rounds whose model is spread over the ranks."""

    def __init__(
        self, checkpoint_uri: str, memory_interval: int, hmac_key_env: str, timeout_s: float, job: str, memory_dir: str
    ):
        """``memory_dir``: a node's directory (a tmpfs such as ``/dev/shm``) where each rank also
        keeps its complete snapshots, so that a round whose processes are all new (every worker
        lost, none of the node's agents) restores from them instead of storage; empty: in memory."""
        checkpoint = CheckpointConfig(
            uri=checkpoint_uri, memory_interval=memory_interval, hmac_key_env=hmac_key_env, memory_dir=memory_dir
        )
        cfg = Config(
            checkpoint=checkpoint, parallel=ParallelConfig(timeout_s=timeout_s), others={"agent": {"job": job}}
        )
        self.tier = MemoryTier(cfg, memory_dir)

    @staticmethod
    def checked_interval(value: Any) -> int:
        """``Session(memory_interval=value)``, checked: SessionError naming it unless an int >= -1."""
        if not isinstance(value, int) or isinstance(value, bool) or value < -1:
            raise SessionError(
                f"Session(memory_interval={value!r}): an int >= -1 (-1: chosen from the step time; 0: off)"
            )
        return value

    def join(
        self, rnd: Round, parts: StateParts, rank: int, world_size: int, device: torch.device, events: EventLog
    ) -> None:
        """Collective (every rank of the round, at its first load): a model spread over the ranks
        takes part in the tier this round (one whole on every rank heals from a live peer)."""
        if not self.tier.enabled or parts.module is None or parts.replicated:
            return
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        self.tier.join_round(rank, world_size, local_world, device.type, events)
        view = SessionTierView(parts, device, rank, world_size, rnd.assignment.round, events, binding=self.tier.binding)
        rnd.join_tier(view, self.tier.wait_staged)

    def snapshot(self, rnd: Round | None, step: int, *, checkpointed: bool) -> None:
        """At step boundary ``step`` (every rank): a snapshot, when the tier's schedule says so."""
        if rnd is not None and rnd.tier is not None:
            self.tier.maybe_snapshot(step, rnd.tier, checkpointed=checkpointed)

    def snapshot_before_leaving(self, rnd: Round | None, step: int) -> None:
        """Every rank leaves the round after step boundary ``step`` (a node drains): this step in
        the tier, its exchange waited for (:meth:`MemoryTier.snapshot_before_leaving`)."""
        if rnd is not None and rnd.tier is not None:
            self.tier.snapshot_before_leaving(step, rnd.tier)

    def restore(
        self, rnd: Round, parts: StateParts, committed: int, newest_in_storage: Callable[[], int]
    ) -> tuple[int, int] | None:
        """Collective: the newest snapshot the round's ranks hold between them, not older than the
        newest commit any of them knows of (``committed``: this rank's), or storage lists when the
        round's assignment saw a newer one, put into ``parts``: (its step, that commit); None
        (every rank alike) when storage must be read."""
        if rnd.tier is None:  # the same on every rank: the same loop, the same model
            return None
        newest = torch.tensor([committed], dtype=torch.int64, device=rnd.tier.device)
        dist.all_reduce(newest, op=dist.ReduceOp.MAX)  # every rank chooses from the same bound
        committed = int(newest.item())
        if rnd.assignment.committed_step > committed:  # a commit none of them knows of: storage says
            committed = max(committed, newest_in_storage())
        rnd.tier.mark(-1, parts, parts.user_state(-1), 0.0)
        step = self.tier.restore(rnd.tier, committed)
        return None if step is None else (step, committed)

    def healer(
        self, rnd: Round, parts: StateParts, newest_in_storage: Callable[[], int]
    ) -> Callable[[int], tuple[int, int] | None]:
        """:meth:`restore` given the commit the ranks agreed on (the ``heal`` of
        :func:`ftrain.session_live.restore_round`)."""
        return functools.partial(self.restore, rnd, parts, newest_in_storage=newest_in_storage)

    def leave_round(self) -> None:
        """After the round's groups were aborted: a snapshot's exchange still running ends."""
        self.tier.leave_round()

    def close(self, *, job_done: bool) -> None:
        """The process serves no more rounds: its snapshots in memory go with it; those kept in
        ``memory_dir`` stay for a process that replaces it, unless the job is done."""
        self.tier.close(job_done=job_done)


__all__ = ["ENCODED_KEY", "SessionTier", "SessionTierView"]
