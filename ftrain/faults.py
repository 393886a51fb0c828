"""Fault-injection points inside a worker, armed only through ``FTRAIN_FAULT_*`` variables.

The chaos suite and tests use them to create faults that cannot be made from outside the
process; unset, every hook is a no-op.

- ``FTRAIN_FAULT_BITFLIP="STEP:RANK[:ROUND][,STEP:RANK[:ROUND]...]"``: silent data corruption. After the
  optimizer update of each STEP, rank RANK flips one bit of one element of its first parameter
  (``FTRAIN_FAULT_BITFLIP_IN=param``, the default) or of that parameter's first AdamW moment
  (``exp_avg``): the highest mantissa bit of the element in the middle of its local tensor, so the
  value stays finite and nothing raises. Each listed step fires once per process.
- ``FTRAIN_FAULT_REQUESTS_DIR=DIR``: faults at a time chosen from outside (the chaos kinds
  ``bit_flip`` and ``worker_stuck``): a file ``DIR/<pid>`` makes that process act after its next
  optimizer update, and is removed. Its content says what: ``param`` or ``exp_avg`` flips a bit
  as above; ``stuck`` stops the training thread there for good, outside any collective, while
  the process stays alive and its other threads (the "alive" datagrams among them) run on: a
  rank stuck in its own code (a deadlocked data loader, a lock never released), which no
  collective timeout reaches and whose peers wait for it in their next collective.
- ``FTRAIN_FAULT_SIGKILL="STEP:RANK"``: after step STEP (and any checkpoint it started), rank
  RANK sends itself SIGKILL — a real crash at a known point.
- ``FTRAIN_FAULT_SIGKILL_IN_COLLECTIVE="STEP:RANK"``: at step STEP, rank RANK starts the step's
  last collective before the optimizer update (the all-gather of the losses) and sends itself
  SIGKILL while it is in flight: its peers may or may not complete that collective, and so may or
  may not apply the update (live recovery must resolve either without mixing steps).
- ``FTRAIN_FAULT_SIGSTOP_IN_COLLECTIVE="STEP:RANK"``: the same, with SIGSTOP: a rank frozen inside
  a collective (a hang its flight record and its peers' must pin on it).
- ``FTRAIN_FAULT_SKIP_COLLECTIVE="STEP:RANK"``: at step STEP, rank RANK skips the all-gather of the
  losses (taking its own for everyone's): its next collective pairs with the one its peers wait in
  (a desync; gloo hangs on the mismatched ops).
- ``FTRAIN_FAULT_NAN="STEP:RANK"``: rank RANK's loss at step STEP becomes NaN.

Each spec may end in ``:ROUND``: the fault then fires only in that round (``FTRAIN_ROUND``), so
that a replacement process that replays the step in a later round does not replay the fault.
- ``FTRAIN_FAULT_STEP_SLEEP_S=S``: every step takes S seconds longer (a slow worker), so
  outside observers can act between steps.
- ``FTRAIN_FAULT_PAUSE_AFTER_FENCE="STEP:RANK"``: the save of step STEP, on rank RANK (the
  coordinator: 0), stops its process with SIGSTOP right after the commit's fence check, before
  the manifest is written (a worker frozen at the worst moment); whoever continues it (SIGCONT)
  decides when, e.g. after a newer round formed.
- ``FTRAIN_FAULT_PAUSE_BEFORE_CLEAR="STEP:RANK"``: the save of step STEP, on rank RANK (the
  coordinator: 0), stops its process with SIGSTOP after it inspected the step directory and
  before its fenced removal of what an earlier save left there (or of its unfinished uploads):
  a writer that resumes after a newer round formed must remove nothing.
- ``FTRAIN_FAULT_PAUSE_BEFORE_GC="STEP:RANK"``: the retention on rank RANK (the one that runs
  it: 0) stops its process with SIGSTOP after it planned and before its fenced removal of step
  STEP's directory (or of its commit record): a retention that resumes after a newer round formed
  must remove nothing.
- ``FTRAIN_FAULT_DAMAGE_MEMORY_COPY=RANK``: rank RANK flips one bit of every buddy copy it keeps
  in the memory tier, after it was checked on arrival (memory that rots): a restore from it must
  refuse it and load from storage.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


_fired: set[str] = set()


def _armed(name: str) -> tuple[int, int] | None:
    """(step, rank) of a fault armed by ``name`` for this round; each fault fires at most once
    per process, so a rollback that replays the step does not replay the fault."""
    raw = os.environ.get(name, "")
    if not raw or name in _fired:
        return None
    step, _, rest = raw.partition(":")
    rank, _, round_ = rest.partition(":")
    if round_ and round_ != os.environ.get("FTRAIN_ROUND", ""):
        return None
    return int(step), int(rank or 0)


def _listed(name: str, step: int, rank: int) -> bool:
    """Whether ``name`` (a comma-separated list of ``STEP:RANK[:ROUND]``) names this step and
    rank in this round."""
    for spec in os.environ.get(name, "").split(","):
        step_, _, rest = spec.strip().partition(":")
        rank_, _, round_ = rest.partition(":")
        if step_ == str(step) and (rank_ or "0") == str(rank):
            if not round_ or round_ == os.environ.get("FTRAIN_ROUND", ""):
                return True
    return False


def _fire(name: str, step: int, rank: int) -> bool:
    if _armed(name) == (step, rank):
        _fired.add(name)
        return True
    return False


#: The highest mantissa bit of each floating dtype: flipping it changes a value by at most a
#: factor of two and never makes it non-finite (a silent corruption, not a NaN).
_MANTISSA_TOP_BIT = {
    torch.float32: (torch.int32, 22),
    torch.float64: (torch.int64, 51),
    torch.bfloat16: (torch.int16, 6),
    torch.float16: (torch.int16, 9),
}
BITFLIP_TARGETS = ("param", "exp_avg")


REQUESTS_DIR = "FTRAIN_FAULT_REQUESTS_DIR"
#: a request that stops the training thread for good (see the module doc)
STUCK = "stuck"


def _requested() -> str | None:
    """What a ``FTRAIN_FAULT_REQUESTS_DIR`` request file for this process asks for (the request
    is consumed), or None."""
    where = os.environ.get(REQUESTS_DIR, "")
    if not where:
        return None
    path = os.path.join(where, str(os.getpid()))
    try:
        with open(path) as fh:
            request = fh.read(64).strip()
        os.unlink(path)
    except FileNotFoundError:
        return None
    return request or "param"


def after_update(step: int, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The faults armed to act after an optimizer update: a bit flip (``FTRAIN_FAULT_BITFLIP`` or a
    request), or a request to get stuck here."""
    request = _requested()
    if request == STUCK:
        log.warning("fault injected: rank %d stuck after step %d (outside any collective, still alive)", rank, step)
        threading.Event().wait()  # for good: only a signal ends this process now
    maybe_flip_bit(step, rank, model, optimizer, request)


def maybe_flip_bit(
    step: int, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, target: str | None = None
) -> str | None:
    """``FTRAIN_FAULT_BITFLIP`` (or ``target``: a request's): flip one bit in memory, as failing
    hardware does; returns what was flipped (for the log), or None."""
    key = f"FTRAIN_FAULT_BITFLIP@{step}"
    if target is None:
        if key in _fired or not _listed("FTRAIN_FAULT_BITFLIP", step, rank):
            return None
        _fired.add(key)
        target = os.environ.get("FTRAIN_FAULT_BITFLIP_IN", "param") or "param"
    if target not in BITFLIP_TARGETS:
        raise ValueError(f"FTRAIN_FAULT_BITFLIP_IN={target!r}: one of {', '.join(BITFLIP_TARGETS)}")
    param = next(model.parameters())
    tensor = param if target == "param" else optimizer.state[param][target]
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = local.detach().view(-1)
    index = flat.numel() // 2
    int_dtype, bit = _MANTISSA_TOP_BIT[flat.dtype]
    with torch.no_grad():
        bits = flat[index : index + 1].view(int_dtype)
        bits ^= 1 << bit
    what = f"{target} of the first parameter, element {index}, bit {bit}"
    log.warning("fault injected: rank %d flipped a bit (%s) after step %d", rank, what, step)
    return what


def maybe_crash(step: int, rank: int) -> None:
    if _fire("FTRAIN_FAULT_SIGKILL", step, rank):
        log.warning("fault injected: SIGKILL rank %d after step %d", rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash_inside(step: int, rank: int, start_collective: Callable[[], object]) -> None:
    """``FTRAIN_FAULT_SIGKILL_IN_COLLECTIVE``: start the collective (asynchronously), then die;
    ``FTRAIN_FAULT_SIGSTOP_IN_COLLECTIVE``: start it, then stop (a process frozen inside it)."""
    for name, sig in (
        ("FTRAIN_FAULT_SIGKILL_IN_COLLECTIVE", signal.SIGKILL),
        ("FTRAIN_FAULT_SIGSTOP_IN_COLLECTIVE", signal.SIGSTOP),
    ):
        if _fire(name, step, rank):
            log.warning("fault injected: %s to rank %d inside the last collective of step %d", sig.name, rank, step)
            logging.shutdown()
            start_collective()
            os.kill(os.getpid(), sig)


def maybe_skip_collective(step: int, rank: int) -> bool:
    """``FTRAIN_FAULT_SKIP_COLLECTIVE``: True once, when rank RANK is to skip the collective of step STEP
    (a desync: its next collective pairs with the one its peers are in)."""
    if _fire("FTRAIN_FAULT_SKIP_COLLECTIVE", step, rank):
        log.warning("fault injected: rank %d skips the all-gather of the losses at step %d", rank, step)
        return True
    return False


def maybe_slow_down() -> None:
    delay_s = float(os.environ.get("FTRAIN_FAULT_STEP_SLEEP_S", "0") or 0)
    if delay_s > 0:
        time.sleep(delay_s)


def maybe_pause_after_fence(step: int) -> None:
    """See ``FTRAIN_FAULT_PAUSE_AFTER_FENCE`` (runs wherever the save's coordinator runs)."""
    if _fire("FTRAIN_FAULT_PAUSE_AFTER_FENCE", step, int(os.environ.get("RANK", "0"))):
        log.warning("fault injected: stopping (SIGSTOP) between the fence check and the commit of step %d", step)
        # directed at this thread, so that it stops here (a process-directed SIGSTOP lets the
        # calling thread run on until the whole group has stopped)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        log.warning("continued after the pause at the commit of step %d", step)


def maybe_pause_before_clear(step: int) -> None:
    """See ``FTRAIN_FAULT_PAUSE_BEFORE_CLEAR`` (runs wherever the save's coordinator runs)."""
    if _fire("FTRAIN_FAULT_PAUSE_BEFORE_CLEAR", step, int(os.environ.get("RANK", "0"))):
        log.warning("fault injected: stopping (SIGSTOP) before clearing the directory of step %d", step)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)  # this thread: see maybe_pause_after_fence
        log.warning("continued after the pause before clearing step %d", step)


def maybe_pause_before_gc(step: int) -> None:
    """See ``FTRAIN_FAULT_PAUSE_BEFORE_GC`` (runs in the retention's thread)."""
    if _fire("FTRAIN_FAULT_PAUSE_BEFORE_GC", step, int(os.environ.get("RANK", "0"))):
        log.warning("fault injected: stopping (SIGSTOP) before retention removes step %d", step)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)  # this thread: see maybe_pause_after_fence
        log.warning("continued after the pause before retention removes step %d", step)


def maybe_damage_memory_copy(rank: int, files: dict[str, bytes], names: list[str]) -> dict[str, bytes]:
    """``files`` with one bit of each of ``names`` flipped, if this rank is armed to (see above)."""
    armed = os.environ.get("FTRAIN_FAULT_DAMAGE_MEMORY_COPY", "")
    if not armed or int(armed) != rank:
        return files
    damaged = dict(files)
    for name in names:
        if damaged.get(name):
            data = damaged[name]
            damaged[name] = data[:-1] + bytes([data[-1] ^ 1])
            log.warning("fault injected: rank %d flipped a bit of its memory-tier copy of %s", rank, name)
    return damaged


def maybe_poison_loss(step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
    if _fire("FTRAIN_FAULT_NAN", step, rank):
        log.warning("fault injected: NaN loss on rank %d at step %d", rank, step)
        return loss * float("nan")
    return loss
