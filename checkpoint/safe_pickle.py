"""Restricted loading of what DCP unpickles out of a step's shards, and the checks on where
``.metadata`` says those bytes are.

DCP's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(value, weights_only=False)`` on every
non-tensor ("bytes") item of a ``.distcp`` shard (the optimizer's ``param_groups`` values, for
one). A shard whose digest matches a forged manifest would then run code on resume, in
``ftrain ckpt export``, or wherever DCP reads it. Here every such item goes through
:func:`load_bytes_item`: it must be a ``torch.save`` archive (what DCP writes) and is loaded with
``torch.load(weights_only=True)``, torch's own allow-list unpickler (plain containers, numbers,
strings, tensors; a ``__reduce__`` to ``os.system`` or ``builtins.exec`` is refused).

What must stay true:

- no byte of a bytes item reaches an unrestricted unpickler: :class:`SafeLoadPlanner`,
  :class:`SafeEmptyStateDictLoadPlanner`, the planner guard of
  :class:`ftrain.checkpoint.dcp_read.VerifiedReader` and :func:`ftrain.checkpoint.verify.check_pickled_items`
  all load through :func:`load_bytes_item`;
- the check and the load agree: :func:`metadata_problems` admits only references into files the
  manifest lists, inside their recorded size, with no stream transform, so the verification pass
  reads exactly the byte ranges DCP will hand to ``load_bytes``;
- every refusal names the item's fqn and the file it came from.

torch-version note: :func:`safe_load_bytes` copies the body of ``DefaultLoadPlanner.load_bytes``
(torch 2.13) with the unpickler swapped; re-check it when torch is upgraded.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ftrain.checkpoint.errors import UnsafePickleError
from ftrain.checkpoint.manifest import FileEntry

METADATA_NAME = ".metadata"
#: Every ``torch.save`` archive (the format DCP writes bytes items in) starts with a zip header.
TORCH_SAVE_MAGIC = b"PK\x03\x04"
#: At most this many reference problems are listed for one ``.metadata`` (a forged file can
#: have millions of entries; the first few say enough).
MAX_LISTED_PROBLEMS = 20

_GLOBAL_ASKED = re.compile(r"GLOBAL ([\w.]+)")
_UNPICKLER_SAYS = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")


def _refusal_reason(err: BaseException) -> str:
    """What torch's weights-only unpickler refused, without its advice (which is to re-run with
    ``weights_only=False`` or to allow-list the global: exactly what must not be done here)."""
    text = str(err)
    asked = _GLOBAL_ASKED.search(text)
    if asked:
        return f"it asks for the global {asked.group(1)}"
    says = _UNPICKLER_SAYS.search(text)
    if says:
        return says.group(1).split(". ")[0][:200]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return (
        (first[:200] or type(err).__name__)
        if not first.startswith("Weights only load failed")
        else (type(err).__name__)
    )


def load_bytes_item(data: bytes, *, fqn: str, file: str) -> Any:
    """Unpickle one DCP bytes item with torch's allow-list unpickler.

    Raises :class:`UnsafePickleError` naming ``fqn`` and ``file`` when the bytes are not a
    ``torch.save`` archive, ask for a global outside the allow-list, or do not load at all: in
    every case the step holds bytes no writer of this project produced.
    """
    if not bytes(data[:4]) == TORCH_SAVE_MAGIC:
        raise UnsafePickleError(
            f"{file}: item {fqn!r} is not a torch.save archive (DCP writes every non-tensor "
            "item with torch.save); refused to unpickle it"
        )
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafePickleError(
            f"{file}: item {fqn!r} was refused by the weights-only unpickler "
            f"({_refusal_reason(e)}): the shard was forged or corrupted; do not load it "
            "with weights_only=False"
        ) from e
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - in-memory bytes: any failure is a property of the bytes
        raise UnsafePickleError(
            f"{file}: item {fqn!r} is not a loadable torch.save item: {type(e).__name__}: {_refusal_reason(e)}"
        ) from e


def _item_file(planner: DefaultLoadPlanner, read_item: ReadItem) -> str:
    """The shard ``read_item`` comes from, for error messages ("?" when unknown)."""
    metadata = getattr(planner, "metadata", None)
    storage_data = getattr(metadata, "storage_data", None) or {}
    info = storage_data.get(read_item.storage_index) if isinstance(storage_data, dict) else None
    return str(getattr(info, "relative_path", "?"))


def safe_load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with :func:`load_bytes_item` instead of
    ``torch.load(weights_only=False)``: stores the item where the default planner would."""
    fqn = read_item.dest_index.fqn
    value.seek(0)
    obj = load_bytes_item(value.read(), fqn=read_item.storage_index.fqn, file=_item_file(planner, read_item))
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj


class SafeBytesLoadMixin:
    """Put first in the bases of a ``DefaultLoadPlanner`` subclass: its ``load_bytes`` then never
    runs an unrestricted unpickler on shard bytes."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # mypy cannot type a mixin's self as the DefaultLoadPlanner it is mixed into
        safe_load_bytes(self, read_item, value)  # type: ignore[arg-type]


class SafeLoadPlanner(SafeBytesLoadMixin, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose bytes items are loaded with the allow-list unpickler.
    Pass it to every ``dcp.load``: ``dcp.load(sd, storage_reader=r, planner=SafeLoadPlanner())``."""


class SafeEmptyStateDictLoadPlanner(SafeBytesLoadMixin, _EmptyStateDictLoadPlanner):
    """``_EmptyStateDictLoadPlanner`` (rebuilds the state dict from ``.metadata``, for export)
    whose bytes items are loaded with the allow-list unpickler."""


# -- references from .metadata into the step's files ----------------------------------------
def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def reference_problem(index: Any, info: Any, files: Mapping[str, FileEntry]) -> str | None:
    """Why the storage entry ``info`` (for ``index``) may not be read, or None if it may.

    Allowed: a ``_StorageInfo`` naming a data file the manifest lists (never ``.metadata``
    itself, never a path outside the step: manifest names cannot hold ``..`` or a leading
    ``/``), a non-negative offset and length inside that file's recorded size, and no stream
    transform (this project's writer never writes one, and a decompressor would turn a small
    verified range into unbounded bytes).
    """
    fqn = getattr(index, "fqn", index)
    if not isinstance(info, _StorageInfo):
        return f"entry for {fqn!r} is a {type(info).__name__}, not DCP storage info"
    name, offset, length = info.relative_path, info.offset, info.length
    if not isinstance(name, str) or name == METADATA_NAME or name not in files:
        return f"entry for {fqn!r} points at {name!r}, which is not a data file listed in the manifest"
    if not _is_count(offset) or not _is_count(length):
        return f"entry for {fqn!r} has offset {offset!r} and length {length!r}; both must be non-negative ints"
    size_bytes = files[name].size_bytes
    if offset + length > size_bytes:
        return f"entry for {fqn!r} reads bytes {offset}..{offset + length} of {name}, which has {size_bytes} bytes"
    if info.transform_descriptors:
        return f"entry for {fqn!r} asks for stream transforms {list(info.transform_descriptors)!r}; none are allowed"
    return None


def _tensor_bytes(md: TensorStorageMetadata) -> int | None:
    """Bytes ``torch.empty`` would allocate for ``md``, or None when the sizes are not counts."""
    sizes = list(getattr(md, "size", None) or ())
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not all(_is_count(s) for s in sizes) or not isinstance(dtype, torch.dtype):
        return None
    return math.prod(sizes) * dtype.itemsize


#: A list index in ``planner_data`` may exceed the number of entries by at most this much
#: (export rebuilds nested lists from these paths, padding with None up to each index).
LIST_INDEX_SLACK = 1024


def _planner_path_problem(fqn: Any, path: Any, max_index: int) -> str | None:
    """Why ``path`` (an object path like ``("optim", "param_groups", 0, "lr")``) may not be
    used to rebuild a state dict, or None."""
    if not isinstance(path, (tuple, list)) or not path:
        return f"planner path of {fqn!r} is {type(path).__name__}, not a non-empty tuple"
    for key in path:
        if isinstance(key, str):
            continue
        if not _is_count(key) or key > max_index:
            return f"planner path of {fqn!r} holds {key!r}; keys must be strings or list indices <= {max_index}"
    return None


def metadata_problems(metadata: Metadata, files: Mapping[str, FileEntry]) -> list[str]:
    """Everything in ``metadata`` a reader must not act on (empty when all is well).

    Checks every storage entry with :func:`reference_problem`, that every bytes item has one,
    that the tensors it declares fit in the step's files (``ftrain ckpt export`` allocates
    them from these sizes before reading a byte: a forged size must not exhaust memory), and
    that the object paths export rebuilds nested containers from are strings and small list
    indices (a forged index of 10**12 would pad a list with None until memory runs out).
    """
    out: list[str] = []
    sdm, storage_data = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    storage_data = {} if storage_data is None else storage_data  # an empty checkpoint has none
    if not isinstance(sdm, dict) or not isinstance(storage_data, dict):
        return ["state_dict_metadata and storage_data must both be dicts"]
    planner_data = getattr(metadata, "planner_data", None)
    if isinstance(planner_data, dict):  # planner-specific; export uses the entries of saved items
        max_index = len(sdm) + LIST_INDEX_SLACK
        for fqn in sdm:
            if fqn in planner_data:
                why = _planner_path_problem(fqn, planner_data[fqn], max_index)
                if why is not None:
                    out.append(why)
    for index, info in storage_data.items():
        why = reference_problem(index, info, files)
        if why is not None:
            out.append(why)
    data_bytes = sum(e.size_bytes for n, e in files.items() if n != METADATA_NAME)
    declared_bytes = 0
    for fqn, md in sdm.items():
        if isinstance(md, BytesStorageMetadata) and MetadataIndex(fqn) not in storage_data:
            out.append(f"bytes item {fqn!r} has no storage entry")
        elif isinstance(md, TensorStorageMetadata):
            size_bytes = _tensor_bytes(md)
            if size_bytes is None:
                out.append(f"tensor {fqn!r} declares size {getattr(md, 'size', None)!r}, not a list of counts")
            else:
                declared_bytes += size_bytes
    if declared_bytes > data_bytes:
        out.append(f"tensors declare {declared_bytes} bytes but the step's data files hold only {data_bytes}")
    if len(out) > MAX_LISTED_PROBLEMS:
        out = out[:MAX_LISTED_PROBLEMS] + [f"... and {len(out) - MAX_LISTED_PROBLEMS} more"]
    return out


def bytes_items(metadata: Metadata) -> dict[str, _StorageInfo]:
    """Every bytes item of ``metadata`` (fqn -> where it is): exactly what a full load unpickles.
    Call only after :func:`metadata_problems` found nothing."""
    return {
        fqn: (metadata.storage_data or {})[MetadataIndex(fqn)]
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, BytesStorageMetadata)
    }


__all__ = [
    "MAX_LISTED_PROBLEMS",
    "SafeBytesLoadMixin",
    "SafeEmptyStateDictLoadPlanner",
    "SafeLoadPlanner",
    "TORCH_SAVE_MAGIC",
    "bytes_items",
    "load_bytes_item",
    "metadata_problems",
    "reference_problem",
    "safe_load_bytes",
]
