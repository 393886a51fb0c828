"""Agent errors: one base; transient (retry with backoff) kept apart from fatal.

- :class:`EtcdUnavailableError` is the only retryable one: no endpoint answered in time.
  Its ``ambiguous`` flag says whether the request may have been applied anyway (it reached a
  server, then the reply was lost). A retried transaction after an ambiguous failure could
  report the wrong outcome, so the client never retries those itself; callers re-read.
- Everything else means retrying the same request cannot help.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error the node agent raises."""


class EtcdUnavailableError(AgentError):
    """Transient: no etcd endpoint answered (refused, timed out, reset, 503, no leader).

    ``ambiguous`` is True when the request reached a server and may have been applied.
    """

    def __init__(self, message: str, *, ambiguous: bool = False) -> None:
        super().__init__(message)
        self.ambiguous = ambiguous


class EtcdError(AgentError):
    """Fatal or protocol error from etcd: bad request, permission denied, bad credentials,
    TLS misconfiguration, an unexpected reply. ``code`` is the gRPC status code if etcd gave one."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class WatchCompactedError(EtcdError):
    """A watch asked for history etcd has compacted away: re-list, then watch again from
    the list's revision + 1. ``compact_revision`` is the oldest revision still available."""

    def __init__(self, message: str, *, compact_revision: int) -> None:
        super().__init__(message, code=11)  # gRPC OUT_OF_RANGE, what etcd uses for compaction
        self.compact_revision = compact_revision


class LeaseExpiredError(AgentError):
    """The lease is gone (expired, revoked, or never existed); anything attached to it too."""


class NodeIdTakenError(AgentError):
    """Another live agent already registered this node id."""
