"""An agent's local view of its job: the keys it follows, fed by a watch, decoded once per change.

The old way, one range read of the whole job on every tick of every agent, costs O(N) per agent
per tick and O(N²) across a job of N nodes (and ~1 ms per record to decode). A view instead:

- **lists once, then follows**: a feed reads its key range once (at a revision R) and then
  applies the watch's events from R + 1 (:class:`ftrain.agents.etcd_watch.Watcher` resumes across
  lost streams without losing or repeating an event). A compacted or failed watch makes the feed
  list again (the next :meth:`JobView.snapshot`); so does nothing else.
- **decodes each record once**, when its key changes (:func:`ftrain.agents.records.decode`), and
  assembles a :class:`~ftrain.agents.records.JobState` only when something changed since the last
  one (:meth:`JobState.assemble` of the decoded records equals a fresh parse of the same keys).
- **follows what this agent needs**: every agent follows :attr:`JobKeys.member_range` (the
  leader, the round, the round records, the nodes, the signals: a key per node that changes
  when the membership does); :attr:`JobKeys.leader_range` (every node's status and every round's
  per-node keys: they change all the time) only while :meth:`JobView.follow_leader_keys` says
  so (the leader; a follower while it judges a hang).
- **says when it cannot be trusted**: :meth:`JobView.snapshot` raises
  :class:`~ftrain.agents.errors.EtcdUnavailableError` while a feed cannot list, or its watch has
  been down for ``down_after_s`` (etcd unreachable): the agent then acts on no round, exactly as
  when a read failed before.

Events arrive on the watch threads and are queued; only the agent's thread (calling
:meth:`JobView.snapshot`) applies them, so the view needs no lock. What must stay true: a
snapshot reflects every event of its feeds up to their revisions and nothing else (the property
test compares it with a fresh read at the same revision), and two feeds never share a key.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from ftrain.agents.errors import EtcdUnavailableError
from ftrain.agents.etcd import KeyValue
from ftrain.agents.etcd_watch import WatchEvent
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.jobstore import Feed, JobStore
from ftrain.agents.records import Decoded, JobState, decode

log = logging.getLogger(__name__)


class _RangeFeed:
    """One key range: its decoded records, kept up to date from a watch."""

    def __init__(
        self,
        store: JobStore,
        keys: JobKeys,
        bounds: tuple[str, str],
        *,
        wakes: Callable[[str], bool],
        wake: Callable[[], None],
        progress_timeout_s: float,
    ):
        self.store, self.keys, self.bounds = store, keys, bounds
        self.wakes, self.wake, self.progress_timeout_s = wakes, wake, progress_timeout_s
        self.records: dict[str, Decoded] = {}
        self.revision = 0
        self.loaded = False
        self.lists = 0  #: range reads so far (the first one and every re-list)
        self._keys: list[str] | None = None  #: the keys in order (None: to sort, after a key came or went)
        self._pending: collections.deque[tuple[int, WatchEvent]] = collections.deque()
        self._broken: tuple[int, Exception] | None = None  #: (generation, why): list again
        self._generation = 0  #: bumped by each list; events of an older watch are dropped
        self._watch: Feed | None = None

    def load(self) -> None:
        """List the range and follow it from there (raises :class:`EtcdUnavailableError`)."""
        self._close_watch()
        listing = self.store.list_range(*self.bounds)
        self.lists += 1
        old = self.records
        self.records = {kv.key: self._decode(kv, old.get(kv.key)) for kv in listing.kvs}
        self._keys, self.revision, self.loaded = None, listing.revision, True
        generation = self._generation
        self._watch = self.store.watch_range(
            *self.bounds,
            start_revision=listing.revision + 1,
            on_event=lambda event: self._queue(generation, event),
            on_error=lambda error: self._fail(generation, error),
            progress_timeout_s=self.progress_timeout_s,
        )

    def apply(self) -> bool:
        """Apply the queued events; True if a record changed."""
        if self._broken is not None and self._broken[0] == self._generation:
            why = self._broken[1]
            log.info("job view of %s: %s; listing it again", self.bounds[0], why)
            self.loaded = False
            self.load()
            return True
        changed = False
        while self._pending:
            generation, event = self._pending.popleft()
            if generation != self._generation:
                continue
            self.revision = max(self.revision, event.mod_revision)
            if event.type == "delete":
                if self.records.pop(event.key, None) is not None:
                    changed, self._keys = True, None
                continue
            kv = KeyValue(event.key, event.value, event.create_revision, event.mod_revision, event.version, event.lease)
            old = self.records.get(event.key)
            if old is None:
                self._keys = None
            self.records[event.key] = self._decode(kv, old)
            changed = True
        return changed

    def in_order(self) -> list[Decoded]:
        if self._keys is None:
            self._keys = sorted(self.records)
        return [self.records[k] for k in self._keys]

    def down_s(self) -> float:
        return self._watch.down_s() if self._watch is not None else float("inf")

    def close(self) -> None:
        self._close_watch()
        self.records, self._keys, self.loaded = {}, None, False

    # -- internals ---------------------------------------------------------------------------
    def _decode(self, kv: KeyValue, old: Decoded | None) -> Decoded:
        if old is not None and old.kv.mod_revision == kv.mod_revision and old.kv.key == kv.key:
            return old  # the same write: decoded already
        return decode(self.keys, kv)

    def _queue(self, generation: int, event: WatchEvent) -> None:  # a watch thread
        self._pending.append((generation, event))
        if self.wakes(event.key):
            self.wake()

    def _fail(self, generation: int, error: Exception) -> None:  # a watch thread
        if isinstance(error, EtcdUnavailableError):
            return  # a lost stream: the watch resumes where it was by itself
        self._broken = (generation, error)
        self.wake()

    def _close_watch(self) -> None:
        self._generation += 1
        self._pending.clear()
        self._broken = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None


class JobView:
    """The job as this agent follows it (see the module docstring). ``wake`` is called from the
    watch threads when a change may call for a decision (anything but a node's status)."""

    def __init__(
        self,
        store: JobStore,
        keys: JobKeys,
        *,
        wake: Callable[[], None],
        progress_timeout_s: float,
        down_after_s: float = 1.0,
    ):
        self.keys, self.down_after_s = keys, down_after_s
        status_prefix = keys.leader_range[0]
        self._member = _RangeFeed(
            store, keys, keys.member_range, wakes=lambda key: True, wake=wake, progress_timeout_s=progress_timeout_s
        )
        self._leader = _RangeFeed(
            store,
            keys,
            keys.leader_range,
            wakes=lambda key: not key.startswith(status_prefix),  # a status is read at the next tick
            wake=wake,
            progress_timeout_s=progress_timeout_s,
        )
        self.following_leader_keys = False
        self._state: JobState | None = None  #: the last snapshot (None: something changed since)

    def follow_leader_keys(self, on: bool) -> None:
        """Follow (or stop following) every node's status and every round's per-node keys."""
        if on == self.following_leader_keys:
            return
        self.following_leader_keys = on
        self._state = None
        if not on:
            self._leader.close()

    def snapshot(self) -> JobState:
        """The job as of the events received so far. Raises :class:`EtcdUnavailableError` while
        it cannot be trusted (a feed cannot list, or its watch has been down for
        ``down_after_s``: etcd unreachable), nothing on what is in etcd (unreadable records are
        in ``problems``)."""
        feeds = [self._member, self._leader] if self.following_leader_keys else [self._member]
        for feed in feeds:
            if not feed.loaded:
                feed.load()
                self._state = None
            elif feed.apply():
                self._state = None
        if any(feed.down_s() >= self.down_after_s for feed in feeds):
            raise EtcdUnavailableError(
                f"the watch on the job's keys has been down for {max(f.down_s() for f in feeds):.1f} s"
            )
        if self._state is None:
            records = [r for feed in feeds for r in feed.in_order()]  # the member range sorts first
            self._state = JobState.assemble(records, max(feed.revision for feed in feeds))
        return self._state

    def revisions(self) -> tuple[int, int]:
        """The revision each feed has applied events up to: (member keys, leader keys; 0 if not followed)."""
        return self._member.revision, self._leader.revision if self.following_leader_keys else 0

    def lists(self) -> int:
        """Range reads made so far (the first of each feed and every re-list)."""
        return self._member.lists + self._leader.lists

    def close(self) -> None:
        self._member.close()
        self._leader.close()


__all__ = ["JobView"]
