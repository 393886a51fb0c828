"""Entries of a session's state that differ between ranks: each rank saves and gets back its own.

A session's plain entries (a scheduler, a sampler, counters) are the same on every rank: rank 0's
go into the step's state file and every rank loads them. Some state is each rank's own: its random
number generators (dropout masks, noise), a per-rank data position. Mark such an entry with
:class:`PerRank` (an :class:`RNGState` is one without marking)::

    state = {"model": model, "optim": optim, "rng": ftrain.RNGState(), "mine": ftrain.PerRank(obj)}

**How it is stored.** Each rank encodes its entry's ``state_dict()`` (:mod:`ftrain.state_codec`,
the exact round trips of the plain entries) into a byte tensor of DCP's state dict under its own
key (:func:`dcp_key`: ``per_rank.<name>.rank<r>``), so that it is written by that rank, with the
model's shards, under the same digests, and travels with them into the memory tier (a lost rank's
copy held by its buddy holds its entries too). DCP loads a tensor into one of the saved size, so the
ranks agree at each save on one capacity per entry (the largest encoding, one all-reduce) and the
manifest records it (``trainer.per_rank``: name -> bytes); a tensor is an 8-byte little-endian
length, then the encoding, then zeros.

**What a rank gets back.** From storage or the memory tier: its own entry as saved; a rank that did
not exist when the step was saved (the job grew) keeps what the loop built. From a live peer (a
replicated model): a survivor that held the step the round goes on from takes its own entry as it
was at that step; a new process keeps what the loop built (a peer's is not its own).
"""

from __future__ import annotations

import random
import struct
import sys
from typing import Any

import torch
import torch.distributed as dist

from ftrain import state_codec
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import Manifest

#: the manifest's ``trainer`` key: each per-rank entry's name -> the bytes its tensors hold
CAPACITY_KEY = "per_rank"
_LENGTH_BYTES = 8


class PerRank:
    """Marks ``obj`` (with ``state_dict()``/``load_state_dict()``) as an entry each rank saves
    and loads for itself (see the module doc)."""

    def __init__(self, obj: Any):
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"PerRank({type(obj).__name__}): the object needs state_dict() and load_state_dict()")
        self.obj = obj


class RNGState:
    """This process's random number generators as an entry of a session's state, each rank its
    own: torch's CPU generator, each CUDA device's once CUDA is initialized, Python's ``random``
    and, when NumPy is imported, NumPy's global generator. Loading puts them back as saved."""

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss = random.getstate()  # 625 ints below 2**32: packed, they encode 10x faster
        python = (version, struct.pack(f"<{len(words)}I", *words), gauss)
        sd: dict[str, Any] = {"torch": torch.get_rng_state().numpy().tobytes(), "python": python}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = [t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()]
        np = sys.modules.get("numpy")
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            sd["numpy"] = (kind, keys.tobytes(), int(pos), int(has_gauss), float(cached))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        try:
            torch.set_rng_state(_byte_tensor(sd["torch"]))
            version, words, gauss = sd["python"]
            random.setstate((version, struct.unpack(f"<{len(words) // 4}I", words), gauss))
            if "cuda" in sd and torch.cuda.is_available():
                torch.cuda.set_rng_state_all([_byte_tensor(b) for b in sd["cuda"]])
            np = sys.modules.get("numpy")
            if "numpy" in sd and np is not None:
                kind, keys, pos, has_gauss, cached = sd["numpy"]
                np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached))
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, struct.error) as e:
            raise ValueError(f"RNGState: the saved states do not fit this process ({type(e).__name__}: {e})") from e


def _byte_tensor(data: Any) -> torch.Tensor:
    if not isinstance(data, bytes):
        raise TypeError(f"a generator's state is bytes, not {type(data).__name__}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unwrap(obj: Any) -> Any | None:
    """The object of a per-rank entry (None: ``obj`` is not one)."""
    if isinstance(obj, PerRank):
        return obj.obj
    return obj if isinstance(obj, RNGState) else None


def dcp_key(name: str, rank: int) -> str:
    """The key of rank ``rank``'s entry ``name`` in DCP's state dict."""
    return f"{CAPACITY_KEY}.{name}.rank{rank}"


def collective_device() -> torch.device:
    """Where this rank's collectives run (the default process group's device)."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def pack(encoded: dict[str, str], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Collective when a process group is up (every rank, the same names): this rank's encoded
    entries as DCP tensors, and each entry's capacity (the largest encoding of any rank)."""
    names = sorted(encoded)
    data = {name: encoded[name].encode() for name in names}
    sizes = torch.tensor([len(data[n]) for n in names], dtype=torch.int64, device=collective_device())
    if names and dist.is_initialized():
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    capacities = dict(zip(names, (int(s) for s in sizes.tolist()), strict=True))
    tensors = {}
    for name in names:
        padding = bytes(capacities[name] - len(data[name]))
        raw = bytearray(len(data[name]).to_bytes(_LENGTH_BYTES, "little") + data[name] + padding)
        tensors[dcp_key(name, rank)] = torch.frombuffer(raw, dtype=torch.uint8)
    return tensors, capacities


def held(manifest: Manifest) -> dict[str, int] | None:
    """The per-rank entries ``manifest``'s step holds: name -> capacity; None when the record is
    malformed (it is read from storage or a peer: :func:`capacities` says why)."""
    record = manifest.trainer.get(CAPACITY_KEY, {})
    if not isinstance(record, dict) or not all(
        isinstance(k, str) and type(v) is int and 0 <= v <= state_codec.MAX_STATE_BYTES for k, v in record.items()
    ):
        return None
    return record


def capacities(manifest: Manifest) -> dict[str, int]:
    """:func:`held`, or ManifestError when the record is malformed."""
    record = held(manifest)
    if record is None:
        raise ManifestError(
            f"step {manifest.step}: trainer.{CAPACITY_KEY} is not name -> bytes (at most {state_codec.MAX_STATE_BYTES})"
        )
    return record


def targets(names: list[str], manifest: Manifest, rank: int) -> dict[str, torch.Tensor]:
    """What a load of ``manifest``'s step fills with this rank's entries ``names`` (none when the
    rank did not exist then, or the record is malformed: the step's validation refuses it)."""
    held_now = held(manifest)
    if rank >= manifest.world_size or held_now is None:
        return {}
    sizes = {n: _LENGTH_BYTES + held_now[n] for n in names if n in held_now}
    return {dcp_key(n, rank): torch.zeros(size, dtype=torch.uint8) for n, size in sizes.items()}


def unpack(t: torch.Tensor, name: str, step: int) -> Any:
    """The value a loaded tensor holds; ManifestError when it is not what :func:`pack` writes."""
    raw = t.cpu().numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
    if len(raw) < _LENGTH_BYTES or length > len(raw) - _LENGTH_BYTES:
        raise ManifestError(f"step {step}: the per-rank entry {name!r} says {length} bytes, more than it holds")
    try:
        return state_codec.decode(raw[_LENGTH_BYTES : _LENGTH_BYTES + length].decode())
    except (UnicodeDecodeError, state_codec.StateDecodeError) as e:
        raise ManifestError(f"step {step}: the per-rank entry {name!r} does not decode: {e}") from e


__all__ = ["CAPACITY_KEY", "PerRank", "RNGState", "capacities", "collective_device", "dcp_key", "pack", "unpack"]
