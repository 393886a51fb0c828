"""The checkpoint process of ``async_mode = "process"``: started with the job, ended with it.

DCP starts the process that uploads process-mode saves lazily, at the first save, and keeps it
for the life of the trainer process: the first save paid its start (an interpreter, torch, a
process group of its own: ~7–23 s measured here) on the critical path, and a live worker that
moves to a new round would keep a process whose group is the old round's. :class:`SaveProcess`
starts it when the checkpoint manager is built, in the background (the training thread only
takes part in the collective that picks the process's rendezvous address), and ends it when the
manager closes (the round ends). A save waits for it only if it is not ready yet.

This reaches into DCP's private executor module (``_async_process_executor``: its module-level
process, the process class and its control messages). If that module changed shape, the
manager says so once and DCP starts the process lazily, as before.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ftrain.checkpoint.dcp_write import BACKGROUND_NICE

log = logging.getLogger(__name__)


class SaveProcess:
    """DCP's checkpoint process for the saves over ``group`` (collective: every rank builds one)."""

    def __init__(self, group: Any):
        self._proc: Any = None
        self._thread: threading.Thread | None = None
        try:
            from torch.distributed.checkpoint import _async_process_executor as executor

            self._executor = executor
            info = executor._ProcessGroupInitInfo(group)  # noqa: SLF001 - collective: the process's rendezvous
        except (ImportError, AttributeError, TypeError) as e:
            log.warning("cannot start the checkpoint process ahead (DCP starts it at the first save): %s", e)
            return
        self._thread = threading.Thread(target=self._start, args=(info,), name="ckpt-process-start", daemon=True)
        self._thread.start()

    def _start(self, info: Any) -> None:
        try:
            self._proc = self._executor._AsyncCheckpointProcess(pg_init_info=info)  # noqa: SLF001
            self._executor._CHECKPOINT_PROCESS = self._proc  # noqa: SLF001 - what async_save uses
        except Exception as e:  # noqa: BLE001 - DCP starts one at the first save instead
            log.warning("the checkpoint process did not start ahead (DCP starts it at the first save): %s", e)
            return
        try:  # its uploads compete with the training steps for the cores: the steps go first
            os.setpriority(os.PRIO_PROCESS, self._proc._save_process.pid, BACKGROUND_NICE)  # noqa: SLF001
        except (OSError, AttributeError) as e:
            log.debug("could not lower the checkpoint process's priority: %s", e)

    def ready(self) -> None:
        """Until the process is up (or failed to start: DCP then starts its own)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """End the process (after the last save finished)."""
        self.ready()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if getattr(self._executor, "_CHECKPOINT_PROCESS", None) is proc:
            self._executor._CHECKPOINT_PROCESS = None  # noqa: SLF001 - the next round's manager starts its own
        try:
            proc.__del__()  # DCP's own shutdown: a TERMINATE message, then SIGTERM if it stays
        except Exception as e:  # noqa: BLE001 - it dies with this process anyway (a daemon)
            log.debug("ending the checkpoint process: %s", e)


__all__ = ["SaveProcess"]
