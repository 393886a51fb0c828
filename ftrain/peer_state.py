"""Training state handed from one live rank to the others over the process group, without pickle.

A live worker that survived a failure holds the model and optimizer state of the last step it
completed (:class:`HeldState`). After the new round's process group is up, the ranks compare
what they hold (:func:`survey`: step, digest) and a rank that holds the newest step sends it to
the ranks that do not (:func:`broadcast`): one JSON header (the nested structure, shapes, dtypes
and every non-tensor value) and then one flat buffer per dtype. Nothing is unpickled: the header
is JSON checked against an allow-list of dtypes, and a receiver checks the digest of what it
got against the digest the sender announced in the survey.

Only strategies whose every rank holds the whole state (``Strategy.full_replica``: ddp) hand
state over this way; the others load from storage (a later memory tier will hold their shards).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

#: dtypes a header may name (anything else is refused)
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MAX_HEADER_BYTES = 64 << 20
MAX_DEPTH = 32


class PeerStateError(RuntimeError):
    """What a peer sent is not usable state (a malformed header, a digest that does not match)."""


@dataclass(slots=True)
class HeldState:
    """What a live rank holds after its round ended: the step it completed and, for full-replica
    strategies, its model and optimizer state (``get_state_dict`` form) and data cursor."""

    step: int
    committed_step: int
    model: dict[str, Any] | None = None
    optim: dict[str, Any] | None = None
    cursor: dict[str, int] | None = None
    _digest: int | None = None

    @property
    def complete(self) -> bool:
        return self.model is not None and self.optim is not None and self.cursor is not None

    def digest(self) -> int:
        """A 63-bit digest of everything held (tensor bytes in a fixed order, and the structure)."""
        if self._digest is None:
            header, tensors = flatten({"model": self.model, "optim": self.optim, "cursor": self.cursor})
            self._digest = _digest(header, tensors)
        return self._digest


def flatten(obj: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(header, tensors): ``obj`` as JSON-able nested nodes whose tensors are indices into the list."""
    tensors: list[torch.Tensor] = []

    def node(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise PeerStateError("state nested too deep")
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return {"t": len(tensors) - 1, "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise PeerStateError("state dict keys must be strings")
            return {"d": {k: node(v, depth + 1) for k, v in x.items()}}
        if isinstance(x, (list, tuple)):
            return {"l": [node(v, depth + 1) for v in x]}
        if x is None or isinstance(x, (bool, int, str)):
            return {"v": x}
        if isinstance(x, float):
            return {"f": repr(x)}  # keeps nan/inf and every bit of the value
        raise PeerStateError(f"cannot send a {type(x).__name__} in state")

    return node(obj, 0), tensors


def unflatten(header: Any, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`flatten` described (tensors taken from ``tensors`` by index)."""

    def node(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(x, dict) or len(x) not in (1, 3):
            raise PeerStateError("malformed state header")
        if "t" in x:
            return tensors[x["t"]]
        if "d" in x and isinstance(x["d"], dict):
            return {k: node(v, depth + 1) for k, v in x["d"].items()}
        if "l" in x and isinstance(x["l"], list):
            return [node(v, depth + 1) for v in x["l"]]
        if "v" in x and (x["v"] is None or isinstance(x["v"], (bool, int, str))):
            return x["v"]
        if "f" in x and isinstance(x["f"], str):
            return float(x["f"])
        raise PeerStateError("malformed state header")

    return node(header, 0)


def tensor_specs(header: Any) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    """(index, dtype, shape) of every tensor the header names, checked (allow-listed dtype,
    non-negative dims, indices 0..n-1 each once)."""
    specs: list[tuple[int, torch.dtype, tuple[int, ...]]] = []

    def walk(x: Any, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(x, dict):
            raise PeerStateError("malformed state header")
        if "t" in x:
            dtype, shape = DTYPES.get(str(x.get("dtype"))), x.get("shape")
            if dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise PeerStateError(f"bad tensor in state header: dtype {x.get('dtype')!r}, shape {shape!r}")
            specs.append((x["t"], dtype, tuple(shape)))
        for key in ("d", "l"):
            children = x.get(key)
            for child in children.values() if isinstance(children, dict) else children or []:
                walk(child, depth + 1)

    walk(header, 0)
    if sorted(i for i, _, _ in specs) != list(range(len(specs))):
        raise PeerStateError("state header tensor indices are not 0..n-1")
    return sorted(specs, key=lambda s: s[0])


def _digest(header: Any, tensors: list[torch.Tensor]) -> int:
    h = xxhash.xxh3_64(json.dumps(header, sort_keys=True).encode())
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.intdigest() & ((1 << 63) - 1)  # fits an int64 tensor


def survey(held: HeldState | None, full_replica: bool, device: torch.device) -> list[tuple[int, int, int, int]]:
    """Collective: every rank's (step, holds state 0/1, digest, committed step), by rank."""
    has = int(full_replica and held is not None and held.complete)
    mine = torch.tensor(
        [
            held.step if held is not None else -1,
            has,
            held.digest() if has and held is not None else 0,
            held.committed_step if held is not None else -1,
        ],
        dtype=torch.int64,
        device=device,
    )
    out = torch.empty(dist.get_world_size() * 4, dtype=torch.int64, device=device)
    dist.all_gather_single(out, mine)
    return [(a, b, c, d) for a, b, c, d in out.view(-1, 4).cpu().tolist()]


def broadcast(held: HeldState | None, src: int, expected_digest: int, device: torch.device) -> HeldState:
    """Collective: rank ``src`` sends its held state; every rank returns it (the sender its own).
    A receiver raises :class:`PeerStateError` unless the digest of what arrived is ``expected_digest``."""
    sending = dist.get_rank() == src
    if sending:
        assert held is not None
        header, tensors = flatten({"model": held.model, "optim": held.optim, "cursor": held.cursor, "step": held.step})
        blob = json.dumps(header).encode()
        size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    n = int(size.item())
    if not 0 < n <= MAX_HEADER_BYTES:
        raise PeerStateError(f"state header of {n} bytes")
    raw = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        if sending
        else torch.empty(n, dtype=torch.uint8, device=device)
    )
    dist.broadcast(raw, src)
    if not sending:
        try:
            header = json.loads(bytes(raw.cpu().tolist()))
        except ValueError as e:
            raise PeerStateError(f"state header is not JSON: {e}") from e
    specs = tensor_specs(header)
    if sending:
        received = tensors
    else:
        received = [torch.empty(shape, dtype=dtype, device=device) for _, dtype, shape in specs]
    for dtype in sorted({d for _, d, _ in specs}, key=str):  # one flat buffer per dtype
        members = [i for i, d, _ in specs if d == dtype]
        if sending:
            flat = torch.cat([received[i].reshape(-1).to(device) for i in members])
        else:
            flat = torch.empty(sum(math.prod(specs[i][2]) for i in members), dtype=dtype, device=device)
        dist.broadcast(flat, src)
        if not sending:
            offset = 0
            for i in members:
                numel = received[i].numel()
                received[i].copy_(flat[offset : offset + numel].view(received[i].shape))
                offset += numel
    if sending:
        assert held is not None
        return held
    obj = unflatten(header, received)
    if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
        raise PeerStateError("state header without a step")
    got = HeldState(step=obj["step"], committed_step=-1, model=obj["model"], optim=obj["optim"], cursor=obj["cursor"])
    if got.digest() != expected_digest:
        raise PeerStateError(
            f"state from rank {src} arrived with digest {got.digest():x}, expected {expected_digest:x}"
        )
    return got
