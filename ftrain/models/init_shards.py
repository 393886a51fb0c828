"""``model.init_from`` straight into the parts of a model that each rank holds.

Where the model is built deferred (:mod:`ftrain.models.deferred_init`: fsdp, zero2, hsdp, tp,
fsdp+tp, pipelines), no rank has the whole model to read the weights into. Each rank checks the
directory against the meta model before anything is made parallel (:func:`survey`: config.json,
every tensor's presence, shape and dtype, from the headers), then, once the model is parallel,
reads from the files only the rows of each tensor that its part covers (:func:`load`): a
DTensor's indices along each dimension come from its placements, the rows spanning them are read
(one contiguous range per tensor: a rank reads about its share of the bytes), and the local part
is cut out of them. Rank 0 also hashes every file whole, in a thread while the ranks read: the
sha256 recorded is of the files as they were read.

Unlike the whole-model path (rank 0 reads, the others receive), every rank reads the directory:
it must be on a filesystem every node sees. A rank's error is raised on every rank, none is left
in a collective; and the files must be the same for every rank and not change while they are
read (size, mtime and inode compared across ranks, before and after), or the start fails.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ftrain.config import ConfigError, ModelConfig
from ftrain.models.hf_weights import KEY, InitFrom, damaged, sha256_of, survey_init_from
from ftrain.models.init_weights import agreed
from ftrain.models.safetensors_file import SafetensorsFileError, read_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :func:`load` read: each file's sha256 (rank 0 hashed them) and each rank's bytes read."""

    files: dict[str, str]
    read_bytes_by_rank: list[int]


def _stats(files: list[Path]) -> list[tuple[int, int, int]]:
    out = []
    for file in files:
        st = os.stat(file)
        out.append((st.st_size, st.st_mtime_ns, st.st_ino))
    return out


@dataclass(frozen=True, slots=True)
class Surveyed:
    """:func:`survey`'s outcome: what to read, and the files as every rank saw them then."""

    init: InitFrom
    stats: list[tuple[int, int, int]]  #: each file's size, mtime (ns) and inode


def survey(model: nn.Module, cfg: ModelConfig) -> Surveyed:
    """Collective: ``cfg.init_from`` checked against the deferred ``model`` on every rank."""

    def check() -> Surveyed:
        init = survey_init_from(model, cfg)
        return Surveyed(init, _stats(init.files))

    surveys = agreed(check)
    _same_files([s.stats for s in surveys], f"rank {{rank}} sees other files in {cfg.init_from!r} than rank 0")
    return surveys[dist.get_rank()]


def _same_files(stats: list[list[tuple[int, int, int]]], problem: str) -> None:
    for rank, seen in enumerate(stats):
        if seen != stats[0]:
            raise ConfigError(KEY, problem.format(rank=rank) + " (size, mtime or inode differ)")


def _local_indices(t: DTensor, dim: int) -> torch.Tensor:
    """The global indices along ``dim`` of the part of ``t`` this rank holds, in its order."""
    placements = []
    for p in t.placements:
        if p.is_shard() and getattr(p, "dim", None) == dim:
            extra = {"split_factor": p.split_factor} if hasattr(p, "split_factor") else {}
            placements.append(type(p)(0, **extra))  # type: ignore[call-arg]
        else:
            placements.append(Replicate())
    index = torch.arange(t.shape[dim], device=t.device_mesh.device_type)
    return distribute_tensor(index, t.device_mesh, placements, src_data_rank=None).to_local().cpu()


def _read_part(init: InitFrom, hf_name: str, target: torch.Tensor) -> int:
    """``target``'s part of ``hf_name`` read from its file into it; returns the bytes read."""
    file, entry = init.found[hf_name]
    if not isinstance(target, DTensor) or not entry.shape:
        rows = entry.shape[0] if entry.shape else 1
        part = read_rows(file, entry, 0, rows)
        (target.to_local() if isinstance(target, DTensor) else target).copy_(part)
        return part.numel() * part.element_size()
    local = target.to_local()
    if local.numel() == 0:
        return 0
    indices = [_local_indices(target, d) for d in range(len(entry.shape))]
    first, last = int(indices[0].min()), int(indices[0].max())
    part = read_rows(file, entry, first, last - first + 1)
    read = part.numel() * part.element_size()
    part = part.index_select(0, indices[0] - first)
    for d in range(1, len(entry.shape)):
        if len(indices[d]) != entry.shape[d]:
            part = part.index_select(d, indices[d])
    local.copy_(part)
    return read


def load(surveyed: Surveyed, model: nn.Module) -> Loaded:
    """Collective: each rank's part of ``model`` (made parallel; the model :func:`survey` checked)
    read from the files; rank 0 hashes each file whole meanwhile."""
    init = surveyed.init
    digests: dict[str, str] = {}
    hashing: threading.Thread | None = None
    hash_error: list[BaseException] = []
    if dist.get_rank() == 0:

        def hash_files() -> None:
            try:
                digests.update({file.name: sha256_of(file) for file in init.files})
            except BaseException as e:  # noqa: BLE001 - raised by load, on every rank
                hash_error.append(e)

        hashing = threading.Thread(target=hash_files, name="ftrain-init-from-hash", daemon=True)
        hashing.start()

    def read_mine() -> tuple[int, list[tuple[int, int, int]], dict[str, str]]:
        read = 0
        try:
            with torch.no_grad():
                for name, tensor in model.state_dict(keep_vars=True).items():
                    hf_name = init.hf_of.get(name)
                    if hf_name is None:
                        raise ConfigError(KEY, f"the model made parallel has {name!r}, which was not surveyed")
                    if hf_name in init.found:  # else a tied copy, filled through its twin
                        read += _read_part(init, hf_name, tensor)
        except (SafetensorsFileError, OSError) as e:
            raise damaged(e) from e
        finally:
            if hashing is not None:
                hashing.join()
        if hash_error:
            raise damaged(Exception(str(hash_error[0])))
        return read, _stats(init.files), digests

    results = agreed(read_mine)
    _same_files(
        [surveyed.stats] + [s for _, s, _ in results],
        f"the files of {str(init.directory)!r} changed while the ranks read them (rank {{rank}} saw it): "
        "start again once they are still",
    )
    loaded = Loaded(files=results[0][2], read_bytes_by_rank=[r for r, _, _ in results])
    log.info(
        "model.init_from: each rank read its part of %s (rank %d: %d bytes); %s",
        init.directory,
        dist.get_rank(),
        loaded.read_bytes_by_rank[dist.get_rank()],
        ", ".join(f"{name} sha256={digest}" for name, digest in loaded.files.items()),
    )
    return loaded
