"""Training state handed from one live rank to the others over the process group, without pickle.

A live worker that survived a failure holds the model and optimizer state of the last step it
completed (:class:`HeldState`). After the new round's process group is up, the ranks compare
what they hold (:func:`survey`: step, digest) and a rank that holds the newest step sends it to
the ranks that do not (:func:`broadcast`): one JSON header (the nested structure, shapes, dtypes
and every non-tensor value) and then one flat buffer per dtype. Nothing is unpickled.

What a peer sends is untrusted input, and must stay so: a receiver bounds the header's size by
its own state's, parses it as JSON and compares it with the header of its OWN state (the same
dict keys, list lengths and kinds of values; each tensor's allow-listed dtype and shape; indices
that are ints, never bools or floats): under a full-replica strategy every rank holds the same
structure, so nothing is allocated from a peer's numbers. The step in the header must be the one
the survey announced, and the digest (which covers the step, the structure, every value and
every tensor byte) the one the holder announced in the survey. Because the transfer is a series
of collectives, every rank learns whether any rank refused (one all-reduce of a flag after the
size, one after the header, one after the digest) and all raise :class:`PeerStateError`
together: the caller falls back to storage on every rank, and no rank is left in a broadcast
that its peers abandoned.

Only state that every rank holds whole (``ftrain train``'s ddp, a session's plain or DDP module)
is handed over this way; sharded state heals from the memory tier (:mod:`ftrain.recovery.memory_tier`).
:func:`take_held_state` is the choice both ``ftrain train``'s rounds and ``Session.run``'s make at
a round's start: what the ranks hold, whether it may be gone on from, and the transfer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ftrain import state_codec
from ftrain.torch_compat import all_gather_single

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
log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 20
MAX_DEPTH = 32
#: bounds of a tensor a header may describe before it is compared with this rank's own
MAX_DIMS = 32
MAX_ELEMENTS = 1 << 40
#: how much longer than this rank's own header a peer's may be (its values differ: digits of a
#: step, a learning rate, a cursor)
HEADER_SLACK_BYTES = 64 << 10


class PeerStateError(RuntimeError):
    """What a peer sent is not usable state (a malformed header, a digest that does not match)."""


@dataclass(slots=True)
class HeldState:
    """What a live rank holds after its round ended: the step it completed and, for full-replica
    strategies, its model and optimizer state (``get_state_dict`` form) and the loop's other
    entries at that step (``cursor``)."""

    step: int
    committed_step: int
    model: dict[str, Any] | None = None
    optim: dict[str, Any] | None = None
    cursor: dict[str, str] | None = None
    """The loop's other entries, each encoded by :mod:`ftrain.state_codec` (name -> text): a
    session's scheduler, sampler, counters; ``ftrain train``'s data cursor and the LR schedule in
    force. Sent with the model; :meth:`entry` decodes one."""
    own: dict[str, str] | None = None
    """A session's per-rank entries at ``step``, encoded (:mod:`ftrain.session_per_rank`): this
    rank's own, never sent to a peer."""
    _digest: int | None = None

    @property
    def complete(self) -> bool:
        return self.model is not None and self.optim is not None and self.cursor is not None

    def entry(self, name: str) -> Any:
        """Entry ``name`` of :attr:`cursor`, decoded (it may have come from a peer: its digest was
        checked, its values were not); PeerStateError naming it when it is missing or does not decode."""
        text = (self.cursor or {}).get(name)
        if not isinstance(text, str):
            raise PeerStateError(f"the state held for step {self.step} has no entry {name!r}")
        try:
            return state_codec.decode(text)
        except state_codec.StateDecodeError as e:
            raise PeerStateError(f"the state's {name!r} held for step {self.step} does not decode: {e}") from e

    def payload(self) -> dict[str, Any]:
        """What :func:`broadcast` sends, and :meth:`digest` covers: the state and its step."""
        return {"model": self.model, "optim": self.optim, "cursor": self.cursor, "step": self.step}

    def digest(self) -> int:
        """A 63-bit digest of everything held (tensor bytes in a fixed order, the structure, the
        values and the step)."""
        if self._digest is None:
            header, tensors = flatten(self.payload())
            self._digest = _digest(header, tensors)
        return self._digest


def held_on(held: HeldState | None, device: torch.device) -> HeldState | None:
    """``held`` with its tensors on ``device`` (a process whose local rank, and so its GPU,
    changed between rounds: what it sends and compares must be on the round's device); the same
    object where nothing moves."""
    if held is None or not held.complete:
        return held

    def moved(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return tree if tree.device == device else tree.to(device)
        if isinstance(tree, dict):
            return {k: moved(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(moved(v) for v in tree)
        return tree

    return dataclasses.replace(held, model=moved(held.model), optim=moved(held.optim))


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
    """The object :func:`flatten` described (tensors taken from ``tensors`` by index); the header
    must have passed :func:`tensor_specs` (or :func:`check_header`) first."""

    def node(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(x, dict) or len(x) not in (1, 3):
            raise PeerStateError("malformed state header")
        if "t" in x and _is_index(x["t"]) and x["t"] < len(tensors):
            return tensors[x["t"]]
        if "d" in x and isinstance(x["d"], dict):
            return {k: node(v, depth + 1) for k, v in x["d"].items()}
        if "l" in x and isinstance(x["l"], list):
            return [node(v, depth + 1) for v in x["l"]]
        if "v" in x and (x["v"] is None or isinstance(x["v"], (bool, int, str))):
            return x["v"]
        if "f" in x and isinstance(x["f"], str):
            return _float(x["f"])
        raise PeerStateError("malformed state header")

    return node(header, 0)


def _is_index(x: Any) -> bool:
    """An int that JSON read as one (never a bool, a float or a string), not negative."""
    return type(x) is int and x >= 0


def _float(text: str) -> float:
    if len(text) > 64:
        raise PeerStateError("malformed float in state header")
    try:
        return float(text)
    except ValueError as e:
        raise PeerStateError(f"malformed float in state header: {text!r}") from e


def _tensor_spec(x: dict[str, Any]) -> tuple[int, torch.dtype, tuple[int, ...]]:
    """(index, dtype, shape) of one tensor node, each checked for its type and bounds."""
    index, dtype, shape = x.get("t"), DTYPES.get(str(x.get("dtype"))), x.get("shape")
    if (
        set(x) != {"t", "dtype", "shape"}
        or not _is_index(index)
        or dtype is None
        or not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(_is_index(d) and d <= MAX_ELEMENTS for d in shape)
        or math.prod(shape) > MAX_ELEMENTS
    ):
        raise PeerStateError(
            f"bad tensor in state header: index {index!r}, dtype {x.get('dtype')!r}, shape {str(shape)[:200]}"
        )
    assert isinstance(index, int)  # checked above
    return index, dtype, tuple(shape)


def tensor_specs(header: Any) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    """(index, dtype, shape) of every tensor the header names, checked (ints that are not bools
    or floats, an allow-listed dtype, non-negative bounded dims, indices 0..n-1 each once)."""
    specs: list[tuple[int, torch.dtype, tuple[int, ...]]] = []

    def walk(x: Any, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(x, dict):
            raise PeerStateError("malformed state header")
        if "t" in x:
            specs.append(_tensor_spec(x))
            return
        for key in ("d", "l"):
            children = x.get(key)
            if children is None:
                continue
            if not isinstance(children, dict if key == "d" else list):
                raise PeerStateError("malformed state header")
            for child in children.values() if isinstance(children, dict) else children:
                walk(child, depth + 1)

    walk(header, 0)
    if sorted(i for i, _, _ in specs) != list(range(len(specs))):
        raise PeerStateError("state header tensor indices are not 0..n-1")
    return sorted(specs, key=lambda s: s[0])


def _leaf_kind(x: dict[str, Any]) -> str:
    """What kind of non-tensor value a node holds ("" if it holds none, or a malformed one)."""
    if len(x) != 1:
        return ""
    if "f" in x:
        return "float" if isinstance(x["f"], str) and len(x["f"]) <= 64 else ""
    if "v" in x:
        v = x["v"]
        return "none" if v is None else type(v).__name__ if type(v) in (bool, int, str) else ""
    return ""


def check_header(header: Any, reference: Any) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    """:func:`tensor_specs` of ``header``, after checking that it has the structure of
    ``reference`` (this rank's own :func:`flatten` header of the same kind of state): the same
    dict keys, list lengths and kinds of values, and each tensor's dtype and shape. Values may
    differ (a peer's step, learning rate, cursor); nothing else may, so nothing this rank
    allocates comes from a peer's numbers. PeerStateError naming the first difference."""

    def walk(got: Any, mine: Any, where: str, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(got, dict):
            raise PeerStateError(f"malformed state header at {where}")
        if "t" in mine:
            if "t" not in got:
                raise PeerStateError(f"state header at {where}: not a tensor, expected one")
            _, dtype, shape = _tensor_spec(got)
            if str(dtype).removeprefix("torch.") != mine["dtype"] or list(shape) != mine["shape"]:
                raise PeerStateError(
                    f"state header at {where}: a {dtype} tensor of shape {list(shape)}, "
                    f"this rank's is {mine['dtype']} of shape {mine['shape']}"
                )
        elif "d" in mine:
            children = got.get("d")
            if len(got) != 1 or not isinstance(children, dict) or set(children) != set(mine["d"]):
                raise PeerStateError(f"state header at {where}: not a dict with this rank's keys")
            for key, child in mine["d"].items():
                walk(children[key], child, f"{where}.{key}"[:300], depth + 1)
        elif "l" in mine:
            children = got.get("l")
            if len(got) != 1 or not isinstance(children, list) or len(children) != len(mine["l"]):
                raise PeerStateError(f"state header at {where}: not a list of {len(mine['l'])}")
            for i, (g, m) in enumerate(zip(children, mine["l"], strict=True)):
                walk(g, m, f"{where}[{i}]"[:300], depth + 1)
        elif _leaf_kind(got) != _leaf_kind(mine):
            raise PeerStateError(
                f"state header at {where}: a {_leaf_kind(got) or 'malformed'} value, expected a {_leaf_kind(mine)}"
            )

    walk(header, reference, "state", 0)
    return tensor_specs(header)


def _digest(header: Any, tensors: list[torch.Tensor]) -> int:
    h = xxhash.xxh3_64(json.dumps(header, sort_keys=True).encode())
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.intdigest() & ((1 << 63) - 1)  # fits an int64 tensor


def survey(held: HeldState | None, full_replica: bool, device: torch.device) -> list[tuple[int, int, int, int]]:
    """Collective: every rank's (step, holds state 0/1, digest, committed step), by rank."""
    has = int(full_replica and held is not None and held.complete)
    digest = 0
    if has and held is not None:
        try:
            digest = held.digest()
        except PeerStateError as e:  # a rank that cannot describe what it holds offers nothing
            log.warning("this rank's held state cannot be sent (%s): it offers none", e)
            has = 0
    mine = torch.tensor(
        [
            held.step if held is not None else -1,
            has,
            digest,
            held.committed_step if held is not None else -1,
        ],
        dtype=torch.int64,
        device=device,
    )
    out = torch.empty(dist.get_world_size() * 4, dtype=torch.int64, device=device)
    all_gather_single(out, mine)
    return [(a, b, c, d) for a, b, c, d in out.view(-1, 4).cpu().tolist()]


def _agree(ok: bool, device: torch.device) -> bool:
    """Collective: whether every rank is ``ok`` (one all-reduce of a flag)."""
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _parse(raw: torch.Tensor, reference: Any, expected_step: int) -> tuple[Any, list[Any]]:
    """The received header, checked against ``reference`` (see :func:`check_header`) and
    carrying ``expected_step``; PeerStateError otherwise."""
    try:
        header = json.loads(raw.cpu().numpy().tobytes())
    except (ValueError, RecursionError) as e:
        raise PeerStateError(f"state header is not JSON: {str(e)[:200]}") from e
    specs = check_header(header, reference)
    step = header["d"]["step"].get("v")
    if type(step) is not int or step != expected_step:
        raise PeerStateError(f"state header for step {step!r}, but the survey announced step {expected_step}")
    return header, specs


def broadcast(
    held: HeldState | None,
    src: int,
    expected_digest: int,
    device: torch.device,
    *,
    expected_step: int,
    reference: HeldState | None = None,
) -> HeldState:
    """Collective: rank ``src`` sends its held state; every rank returns it (the sender its own).

    A receiver checks what arrives against its own state ``reference`` (a :class:`HeldState` of
    this rank's model, optimizer and cursor, any step: under a full-replica strategy every rank
    holds the same structure): the header's size, structure, dtypes and shapes (nothing is
    allocated from a peer's numbers), its step against ``expected_step`` and the digest of the
    whole against ``expected_digest`` (both from :func:`survey`). Every rank raises
    :class:`PeerStateError`, at the same point, when any rank refuses (one all-reduce of a flag
    after the header and one after the digest): no rank goes on to a collective that its peers
    left, so a bad transfer never leaves ranks waiting on each other; they fall back together."""
    sending = dist.get_rank() == src
    problem, blob, limit, mine = "", b"", 0, None
    if not sending and reference is None:
        raise ValueError("a receiving rank needs its own state as the reference")
    try:
        if sending:
            assert held is not None
            header, tensors = flatten(held.payload())
            blob = json.dumps(header).encode()
        else:
            assert reference is not None
            mine, _ = flatten(reference.payload())
            limit = min(MAX_HEADER_BYTES, 2 * len(json.dumps(mine).encode()) + HEADER_SLACK_BYTES)
    except PeerStateError as e:  # state this rank cannot describe: refused below, with every rank
        problem = f"rank {dist.get_rank()} cannot describe its own state: {e}"
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    n = int(size.item())
    if not problem and not sending and not 0 < n <= limit:  # 0: the sender has nothing to send
        problem = f"state header of {n} bytes from rank {src} (this rank's own is about {limit // 2} bytes)"
    if not _agree(not problem and n > 0, device):
        raise PeerStateError(problem or f"a rank refused the size of rank {src}'s state header")
    raw = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        if sending
        else torch.empty(n, dtype=torch.uint8, device=device)
    )
    dist.broadcast(raw, src)
    try:  # the sender checks its own header too: what it cannot describe, no rank receives
        if sending:
            specs = tensor_specs(header)
        else:
            header, specs = _parse(raw, mine, expected_step)
    except PeerStateError as e:
        problem = f"state header from rank {src}: {e}"
    if not _agree(not problem, device):
        raise PeerStateError(problem or f"a rank refused the state header of rank {src}")
    received = tensors if sending else [torch.empty(shape, dtype=dtype, device=device) for _, dtype, shape in specs]
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
    got = held
    if not sending:
        try:
            obj = unflatten(header, received)
            got = HeldState(
                step=obj["step"], committed_step=-1, model=obj["model"], optim=obj["optim"], cursor=obj["cursor"]
            )
            if got.digest() != expected_digest:
                problem = f"state from rank {src} arrived with digest {got.digest():x}, expected {expected_digest:x}"
        except PeerStateError as e:
            problem = f"state from rank {src}: {e}"
    if not _agree(not problem, device):
        raise PeerStateError(problem or f"a rank refused the state that rank {src} sent")
    assert got is not None
    return got


@dataclass(frozen=True, slots=True)
class Restored:
    """Where a round's state came from: ``memory`` (every rank held it), ``live_peer``,
    ``memory_tier``, ``storage`` or ``fresh``; ``from_rank``: the live peer's rank (-1: none)."""

    source: str
    step: int
    from_rank: int = -1

    def said(self) -> str:
        """Where from, in words."""
        return {
            "memory": "this process's memory",
            "live_peer": f"rank {self.from_rank}'s memory (a live peer)",
            "memory_tier": "the memory tier (the ranks' and their buddies' memory)",
        }.get(self.source, self.source)


@dataclass(frozen=True, slots=True)
class HeldChoice:
    """What :func:`take_held_state` agreed on: ``state`` to go on from (None: nothing the ranks
    hold can be, on every rank alike), sent by rank ``from_rank`` (-1: every rank held it), the
    newest step any rank held, the newest commit the ranks know of, and why the transfer of the
    newest step was refused (empty: it was not)."""

    state: HeldState | None
    from_rank: int
    newest_step: int
    committed_step: int
    refused: str = ""


def take_held_state(
    held: HeldState | None,
    full_replica: bool,
    device: torch.device,
    committed_step: int,
    reference: Callable[[int], HeldState],
    newest_listed: Callable[[], int] | None = None,
) -> HeldChoice:
    """Collective, at a round's start: the state the ranks go on from when they hold it.

    The ranks compare what they hold (:func:`survey`); the newest step held goes on if its
    holders agree on its digest and no commit is newer (a rank that sat out the rounds that
    trained on holds an old step): every rank keeps its own when every rank holds it, else the
    first holder sends it (:func:`broadcast`; ``reference(step)``: this rank's own state, which
    what arrives is checked against). ``committed_step``: the newest commit this rank's
    assignment knows of; when it is newer than any rank knows and ``newest_listed`` is given,
    the storage's listing decides instead (a commit whose manifest never landed is no commit).
    Every rank sees the same rows, so every rank decides alike."""
    rows = survey(held, full_replica, device)
    newest = max(step for step, _, _, _ in rows)
    holders = [r for r, (step, has, _, _) in enumerate(rows) if has and step == newest]
    committed = max(c for _, _, _, c in rows)
    if committed_step > committed:
        committed = max(committed, newest_listed()) if newest_listed is not None else committed_step
    nothing = HeldChoice(None, -1, newest, committed)
    if not holders:
        return nothing
    digests = {rows[r][2] for r in holders}
    if len(digests) > 1:
        log.error("replicas at step %d differ (digests %s): loading", newest, sorted(digests))
        return nothing
    if newest < committed:
        log.warning("the newest step held in memory (%d) is older than committed step %d: loading", newest, committed)
        return nothing
    if len(holders) == len(rows):
        return HeldChoice(held, -1, newest, committed)
    src = holders[0]
    mine = reference(newest) if dist.get_rank() != src else None
    try:
        got = broadcast(held, src, rows[src][2], device, expected_step=newest, reference=mine)
    except PeerStateError as e:
        log.error("the state of step %d from rank %d was refused (%s): loading", newest, src, e)
        return HeldChoice(None, src, newest, committed, refused=str(e))
    return HeldChoice(got, src, newest, committed)
