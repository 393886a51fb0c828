"""Process groups and devices of a run.

``init_distributed`` joins the process group torchrun describes in the environment (or a
one-rank group when started without torchrun): NCCL on GPUs, gloo on CPU. Where a rank sits in
the parallel layout is the strategy's to say (:func:`ftrain.parallel.strategies.compute_layout`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from ftrain.agent_link import flight_recorder
from ftrain.config import ConfigError, ParallelConfig, TrainConfig

log = logging.getLogger(__name__)


def select_device(train: TrainConfig) -> torch.device:
    """``cuda:<local rank>`` on a GPU host (local ranks beyond the devices there are share them,
    round-robin: more processes than GPUs, as in a one-GPU test of two ranks over gloo), else the CPU."""
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda requested but no GPU is visible")
        local_rank, devices = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= devices:
            log.warning("local rank %d shares cuda:%d (%d GPU(s) here)", local_rank, local_rank % devices, devices)
        return torch.device("cuda", local_rank % devices)
    return torch.device("cpu")


def select_dtype(train: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 by default on GPUs; fp32 on CPU, where bf16 runs ~12x slower without bf16 units."""
    if train.dtype == "bf16" or (train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def init_distributed(parallel: ParallelConfig, device: torch.device) -> tuple[int, int, int]:
    """Join the process group; returns (rank, world_size, local_world_size)."""
    backend = parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=parallel.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    flight_recorder.new_world()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        local_world = 1
    log.debug("joined %s group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), local_world


def shutdown_distributed() -> None:
    """Tear down after a successful run: a barrier first, so no rank destroys its groups (and
    exits) while gloo work of a peer still references them, which can abort the process at
    exit ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_without_teardown(code: int) -> None:
    """End a finished process without running C++ static destructors.

    After a clean run every collective has completed and the process groups are destroyed, yet
    gloo/c10d threads can still be joinable when the interpreter tears down, and destroying them
    calls std::terminate ("terminate called without an active exception", SIGABRT; seen in CI on
    workers that had passed a barrier and destroyed their groups). The launcher then reports a
    failed rank for a run that succeeded. Nothing is left to flush but Python's own buffers, so
    flush those and leave at once.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def abort_distributed(keep_ports: Iterable[int] = ()) -> None:
    """End every process group of this process at once, without waiting for any peer (some are
    gone, some may be blocked in a collective with this rank): abort them all, destroy them, then
    shut down the TCP connections they leave open.

    That last part is what frees the peers. Measured here (torch 2.13, gloo, 4 ranks, one
    SIGKILLed): the two ranks whose collective failed aborted and destroyed their groups, yet the
    fourth, blocked on a receive from one of them, stayed blocked until the process-group
    timeout — gloo keeps its pairs' sockets open. Shutting those sockets down (``SHUT_RDWR``:
    the peer reads end-of-file) made it fail within 0.2 s. Only established connections are shut
    down (a listener's accept thread aborts the process on an error), and none whose remote port
    is in ``keep_ports`` (the checkpoint storage and etcd: their clients pool connections)."""
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()  # noqa: SLF001 - the one call that aborts every group
        except (RuntimeError, ValueError, AttributeError) as e:  # already broken: destroying is what matters
            log.debug("abort of the process groups: %s", e)
        if dist.is_initialized():
            dist.destroy_process_group()
    # torch names the default group after a per-process counter that every init_process_group
    # bumps and only a completed destroy resets: after an init that was interrupted (a round
    # ended during its rendezvous) it would name the next round's group "1/" while a fresh
    # spare's is "0/", and their gloo rendezvous would wait on different keys until the timeout.
    dist.distributed_c10d._world.group_count = 0  # noqa: SLF001 - no group is left to collide with
    forget_sharding_specs()
    severed = sever_connections(set(keep_ports))
    log.debug("left the process groups; shut down %d connection(s)", severed)


def forget_sharding_specs() -> None:
    """Empty DTensor's caches of sharding propagation, once this process's groups are gone.

    They are keyed by specs whose device meshes compare equal across process groups: a mesh's
    equality covers its shape, ranks and device type, not this process's rank in it. A process
    that serves a later round under another rank then gets the old round's mesh back from the
    cache (measured here, torch 2.13: ``fully_shard`` in the new round gave parameters whose mesh
    still said the old rank), and every shard offset follows from it: DCP saved the same chunk
    from two ranks ("Failed to validate global plan: invalid fill") and loaded another rank's
    shard."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001 - no public handle on the cache
    for cached in (propagator.propagate_op_sharding, type(propagator)._propagate_tensor_meta_cached):  # noqa: SLF001
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # noqa: SLF001 - where torch has it
    if native is not None:
        native()


_ESTABLISHED = "01"


def _tcp_connections() -> dict[int, tuple[str, int]]:
    """socket inode -> (state, remote port) of this process's network namespace's TCP sockets."""
    found: dict[int, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as fh:
                next(fh)
                for line in fh:
                    fields = line.split()
                    found[int(fields[9])] = (fields[3], int(fields[2].rsplit(":", 1)[1], 16))
        except (OSError, IndexError, ValueError, StopIteration):
            continue
    return found


def sever_connections(keep_ports: set[int]) -> int:
    """Shut down (both ways) every established TCP connection of this process whose remote port
    is not in ``keep_ports``; how many. The descriptors stay open: their owners close them."""
    connections = _tcp_connections()
    severed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        state, remote_port = connections.get(int(target[8:-1]), ("", 0))
        if state != _ESTABLISHED or remote_port in keep_ports:
            continue
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:  # closed meanwhile
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return severed
