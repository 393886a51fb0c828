"""Copies of the state for DCP to save, in host memory, with one stager kept for a whole job.

A save copies the state first (staging), then uploads the copy in the background while training
goes on. Keeping one stager lets each copy reuse the buffers of the one before (pinned host
memory on GPUs), where the torch release allows it: how DCP's ``DefaultStager`` behaves differs
between the torch releases ftrain runs on, and this module hides that.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


@functools.cache
def stager_reusable() -> bool:
    """Whether this torch's ``DefaultStager`` copies more than once (2.13 does; 2.11 closes its
    copier after each copy). Asked of torch once, with a tiny state."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"t": torch.zeros(1), "d": {"l": [1]}})
    except Exception:  # noqa: BLE001 - 2.11: KeyError from the closed copier; any failure means no
        return False
    finally:
        stager.close()
    return True


class KeptStager(DefaultStager):
    """DCP's stager, kept from one save to the next. torch 2.13 keeps the buffers of its copy for
    the next one; torch 2.11's stager closes its copier after every copy (buffers included), and
    a second copy then fails with ``KeyError: <class 'type'>`` (every save after a process's
    first, seen on the H200). On such a torch (:func:`stager_reusable`) each copy gets a new
    copier, as a new stager would. DCP's own ``close()`` after an upload is ignored (the next save
    stages again); :meth:`release` is the real one."""

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        if not stager_reusable():
            self._state_dict_stager = StateDictStager(  # noqa: SLF001 - the one DefaultStager makes
                pin_memory=self._config.use_pinned_memory, share_memory=self._config.use_shared_memory
            )
        return super().stage(state_dict, **kwargs)

    def close(self) -> None:
        return None  # DCP's call after an upload: the next save copies with this stager again

    def release(self) -> None:
        """Free the buffers and the staging thread (the stager is not used again)."""
        super().close()


def new_stager(device_type: str, *, asynchronous: bool = True, shared: bool = False) -> KeptStager:
    """DCP's stager for state on ``device_type``, for every save of a job (never stage again
    before the previous copy was uploaded). ``asynchronous``: the copy runs in the background
    (wait for it before the state changes); ``shared``: into shared memory (for the checkpoint
    process). On CUDA: pinned buffers and non-blocking copies; on a CPU plain copies (those need
    an accelerator)."""
    cuda = device_type == "cuda"
    return KeptStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=shared, use_async_staging=asynchronous, use_non_blocking_copy=cuda
        )
    )


__all__ = ["KeptStager", "new_stager", "stager_reusable"]
