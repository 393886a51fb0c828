"""How a round's workers are doing on this node, judged from their heartbeats: pure functions
of the beats, the settings and the time (the agent acts on the answers).

- :func:`exit_report`: how the round ended here, from the launcher's exit code and the workers'
  last messages.
- :func:`hung_ranks`: the local ranks to treat as hung.
- :func:`frozen_ranks`: which of them are frozen themselves (a live agent kills only those).
"""

from __future__ import annotations

from agents.heartbeat import Beat
from agents.records import FAILED, FATAL, STOPPED, SUCCEEDED, WORKER_EXIT, Report


def exit_report(
    rc: int, beats: dict[int, Beat], nproc: int, log_path: str, agent_uid: str, now: float, *, exited: str = "torchrun"
) -> Report:
    """How a round ended on this node, from torchrun's exit code and the workers' last messages.

    Success needs exit code 0 and every local rank's exit message saying it finished. A failure
    carries the newest step any worker reported and the first worker error (by local rank), or a
    stand-in naming the exit code; a worker that said its error is fatal makes the report fatal.
    """
    finished = len(beats) == nproc and all(b.finished for b in beats.values())
    if rc == 0 and finished:
        return Report(SUCCEEDED, agent_uid=agent_uid, time=now)
    if rc == 0:
        return Report(STOPPED, detail="workers stopped early (drain)", agent_uid=agent_uid, time=now)
    step = max((b.step for b in beats.values()), default=-1)
    errors = [b for _, b in sorted(beats.items()) if b.error]
    fatal = [b for b in errors if b.fatal]
    first = next(iter(fatal or errors), None)
    error = first.error if first else ""
    detail = f"{exited} exited with {rc}; log {log_path}"
    if first:
        detail += f"; local rank {first.local_rank}: {error}"
    return Report(FAILED, FATAL if fatal else WORKER_EXIT, detail[:1000], agent_uid, now, step=step, error=error)


def hung_ranks(
    beats: dict[int, Beat],
    *,
    nproc_per_node: int,
    started_at: float,
    now: float,
    hang_timeout_s: float,
    start_timeout_s: float,
) -> list[int]:
    """Local ranks that made no progress within their limit (``hang_timeout_s`` between steps,
    ``start_timeout_s`` in start-up, loads and saves, counted from ``started_at`` before the
    first beat), or that stopped saying they are alive for ``hang_timeout_s`` in any phase (a
    frozen process: no need to wait out the start timeout) — except one that sent its exit
    message: it is leaving, and torchrun's exit (which can take seconds) decides how the round
    ended. Every time is on the agent's monotonic clock."""
    hung = []
    for local_rank in range(nproc_per_node):
        beat = beats.get(local_rank)
        since = beat.received_at if beat else started_at
        limit = hang_timeout_s if beat and beat.phase == "training" else start_timeout_s
        frozen = (
            beat is not None
            and beat.finished is None
            and beat.phase != "exiting"
            and beat.alive_at > 0
            and now - beat.alive_at > hang_timeout_s
        )  # said goodbye: not frozen, leaving
        if now - since > limit or frozen:
            hung.append(local_rank)
    return hung


#: a worker's background thread says "alive" every second (``ftrain.heartbeat``) even while its
#: main thread waits in a collective; silent this long, the process itself is frozen
FROZEN_AFTER_S = 3.0


def frozen_ranks(beats: dict[int, Beat], local_ranks: list[int], *, now: float) -> list[int]:
    """Of ``local_ranks`` (hung: no step progress), those whose process stopped saying it is
    alive: the cause of the hang, not its victims (workers blocked in a collective with a frozen
    peer still send "alive"). A rank that never sent anything counts as frozen."""
    return [r for r in local_ranks if r not in beats or now - beats[r].alive_at > FROZEN_AFTER_S]
