"""Bytes and JSON over the memory tier's gloo group (no pickle: bytes travel as uint8 tensors,
names and holdings as JSON), and the digest check of what arrives.

Every function here is collective over ``group`` (None: a world of one, nothing is sent) except
:func:`matches`. A peer is a rank of the same job, but what it sends may come from a damaged
directory, so the caller checks every byte against a manifest before it is used, and nothing is
allocated from a peer's numbers past a bound: a size announced beyond :data:`MAX_BYTES` (or
below 0) is bytes that are never sent (:func:`broadcast_bytes` returns ``b""`` on every rank),
and a JSON row past :data:`MAX_JSON_BYTES`, or not JSON within
:mod:`ftrain.contract.bounded_json`'s bounds, is a :class:`WireError` raised on every rank at
the same point (every rank holds the same gathered bytes), so no rank is left in a collective
its peers abandoned.

A buddy copy travels file by file in messages of at most :data:`CHUNK_BYTES`
(:func:`exchange_files`): read straight from the sender's files and received straight into the
receiver's final buffers, so an exchange holds no serialized blob of a rank's files beside them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ftrain.checkpoint.digest import new_hasher
from ftrain.checkpoint.manifest import FileEntry
from ftrain.contract.bounded_json import JsonInputError, loads

#: the most bytes one broadcast carries (a manifest, a DCP ``.metadata``)
MAX_BYTES = 1 << 30
#: the most bytes one message of a buddy exchange carries (the sender's one extra buffer)
CHUNK_BYTES = 64 << 20
#: the longest JSON row one rank sends (names and holdings of the snapshots it keeps)
MAX_JSON_BYTES = 64 << 20


class WireError(ValueError):
    """What the ranks gathered is not usable (raised on every rank alike)."""


def as_tensor(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def pieces(sizes: list[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Pure: ``(file index, start, end)`` of each message that carries files of ``sizes``, in
    order, at most ``chunk_bytes`` each (an empty file is no message). Sender and receiver cut
    the same sizes alike, so their messages pair up one by one."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return [(i, a, min(a + chunk_bytes, n)) for i, n in enumerate(sizes) for a in range(0, n, chunk_bytes)]


def exchange_files(
    out: list[bytes | bytearray],
    to: int,
    into: list[bytearray],
    src: int,
    group: Any,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Collective over pairs: send ``out`` (in order) to rank ``to`` while receiving ``into``
    (buffers of the sizes the receiver expects, in order) from rank ``src``, in messages of at
    most ``chunk_bytes``, one each way in flight at a time. A message goes out from one reused
    buffer of ``chunk_bytes`` (gloo sends tensors; the sender's bytes are immutable) and comes
    in straight into its place in ``into``: no other copy is made. Both ends must cut the same
    sizes (the receiver's come from a manifest the sender checked its files against first):
    then every rank's i-th messages pair with its peers' i-th, and no rank waits on one that
    is never posted."""
    sends = pieces([len(b) for b in out], chunk_bytes)
    receives = pieces([len(b) for b in into], chunk_bytes)
    buf = torch.empty(max((b - a for _, a, b in sends), default=0), dtype=torch.uint8)
    views = [torch.frombuffer(b, dtype=torch.uint8) if len(b) else None for b in into]
    for i in range(max(len(sends), len(receives))):
        ops = []
        if i < len(sends):
            k, a, b = sends[i]
            piece = buf[: b - a]
            piece.numpy()[:] = np.frombuffer(out[k], dtype=np.uint8, count=b - a, offset=a)
            ops.append(dist.P2POp(dist.isend, piece, to, group))
        if i < len(receives):
            k, a, b = receives[i]
            view = views[k]
            if view is not None:
                ops.append(dist.P2POp(dist.irecv, view[a:b], src, group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def broadcast_bytes(data: bytes | bytearray | None, src: int, group: Any, *, max_bytes: int = MAX_BYTES) -> bytes:
    """``src``'s bytes on every rank (``None`` at ``src``, or more than ``max_bytes``: empty bytes
    everywhere: the size is broadcast first, so every rank decides alike)."""
    data = bytes(data) if isinstance(data, bytearray) else data  # a manifest or .metadata: small
    if group is None:
        return data if data is not None and len(data) <= max_bytes else b""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    n = int(size.item())
    if not 0 <= n <= max_bytes:  # never allocated: the caller refuses empty bytes (no manifest)
        return b""
    mine = dist.get_rank() == src
    buf = as_tensor(data) if mine and data else torch.empty(n, dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, src, group=group)
    return data if mine and data is not None else buf.numpy().tobytes()


def all_gather_json(obj: Any, group: Any, *, max_bytes: int = MAX_JSON_BYTES) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), by rank; :class:`WireError` on every rank when a rank's
    row is longer than ``max_bytes`` or not bounded JSON (see the module doc)."""
    if group is None:
        return [obj]
    blob = json.dumps(obj).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(blob)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    if not all(0 <= n <= max_bytes for n in lengths):  # every rank sees the same sizes: all raise here
        raise WireError(f"a rank's row of {max(lengths)} bytes (at most {max_bytes}): {lengths[:8]}")
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else padded[:0]
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    rows = []
    for rank, (t, n) in enumerate(zip(out, lengths, strict=True)):
        try:
            rows.append(loads(t[:n].numpy().tobytes(), max_bytes=max_bytes, what=f"rank {rank}'s row"))
        except JsonInputError as e:  # the same bytes on every rank: every rank raises here
            raise WireError(str(e)) from e
    return rows


def max_over(group: Any, values: list[float]) -> list[float]:
    """The element-wise maximum of ``values`` over the group's ranks."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def any_rank(flag: bool, device: torch.device, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (None: the training group, on its
    device: a world of one has nobody to ask)."""
    return any_ranks([flag], device, group)[0]


def any_ranks(flags: list[bool], device: torch.device, group: Any = None) -> list[bool]:
    """For each of ``flags``, whether it is true on any rank of ``group`` (one all-reduce)."""
    if group is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return list(flags)
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device if group is None else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def matches(data: bytes | bytearray, entry: FileEntry, algorithm: str) -> bool:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return len(data) == entry.size_bytes and hasher.hexdigest() == entry.digest


__all__ = [
    "CHUNK_BYTES",
    "MAX_BYTES",
    "MAX_JSON_BYTES",
    "WireError",
    "all_gather_json",
    "any_rank",
    "any_ranks",
    "as_tensor",
    "broadcast_bytes",
    "matches",
    "exchange_files",
    "max_over",
    "pieces",
]
