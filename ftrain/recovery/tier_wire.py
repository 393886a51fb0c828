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
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ftrain.checkpoint.digest import new_hasher
from ftrain.checkpoint.manifest import FileEntry
from ftrain.contract.bounded_json import JsonInputError, loads

#: the most bytes one broadcast carries (a manifest, a DCP ``.metadata``)
MAX_BYTES = 1 << 30
#: the longest JSON row one rank sends (names and holdings of the snapshots it keeps)
MAX_JSON_BYTES = 64 << 20


class WireError(ValueError):
    """What the ranks gathered is not usable (raised on every rank alike)."""


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def concat(parts: list[bytes]) -> torch.Tensor:
    return as_tensor(b"".join(parts))


def split(buf: torch.Tensor, names: list[str], sizes: list[int]) -> dict[str, bytes]:
    out, offset, raw = {}, 0, buf.numpy().tobytes()
    for name, size in zip(names, sizes, strict=True):
        out[name] = raw[offset : offset + size]
        offset += size
    return out


def broadcast_bytes(data: bytes | None, src: int, group: Any, *, max_bytes: int = MAX_BYTES) -> bytes:
    """``src``'s bytes on every rank (``None`` at ``src``, or more than ``max_bytes``: empty bytes
    everywhere: the size is broadcast first, so every rank decides alike)."""
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


def matches(data: bytes, entry: FileEntry, algorithm: str) -> bool:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return len(data) == entry.size_bytes and hasher.hexdigest() == entry.digest


__all__ = [
    "MAX_BYTES",
    "MAX_JSON_BYTES",
    "WireError",
    "all_gather_json",
    "any_rank",
    "any_ranks",
    "as_tensor",
    "broadcast_bytes",
    "concat",
    "matches",
    "max_over",
    "split",
]
