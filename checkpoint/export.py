"""Export one committed step as a single consolidated ``torch.save`` file (for inference), or as a
Hugging Face ``save_pretrained`` directory (``--format hf``).

The step is verified first (manifest, HMAC, every file's digest, and every pickle a load would
unpickle, see :func:`ftrain.checkpoint.verify.check_pickled_items`); DCP then reads every shard in this
one process through :class:`~ftrain.checkpoint.dcp_read.VerifiedReader` with
:class:`~ftrain.checkpoint.safe_pickle.SafeEmptyStateDictLoadPlanner`, so no byte from storage reaches
an unrestricted unpickler. The whole state must fit in memory. By default only the model's
parameters are exported (``{"model.<name>": tensor}`` keys become ``{"<name>": tensor}``).

``fmt="hf"`` hands the model state and the ``[model]`` config the manifest recorded to a converter
(the runtime's :func:`ftrain.models.hf_weights.to_hf`: this layer knows no model) and writes what it
returns with :func:`write_hf_dir`: its JSON files (``config.json``, ``generation_config.json``) and
``model.safetensors``, or shards of at most ``max_shard_bytes`` and ``model.safetensors.index.json``
as ``save_pretrained`` does.

What must stay true: an export is one model, whole or absent. The output (a file, or a
directory) must not exist, or be an empty directory, unless ``replace`` is given; it is written
under a fresh name beside it (created exclusively) and renamed into place only once complete, and
a replaced export is swapped out whole (an atomic exchange where the kernel has one), never
written over file by file — so no directory ever mixes the files of two exports (a stale index
beside a new single file would give ftrain one model and transformers another).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ftrain.checkpoint.dcp_read import VerifiedReader
from ftrain.checkpoint.errors import ChecksumMismatchError, UnsafePickleError
from ftrain.checkpoint.manifest import hmac_key_from_env, step_dir_name
from ftrain.checkpoint.safe_pickle import SafeEmptyStateDictLoadPlanner
from ftrain.checkpoint.storage import Storage
from ftrain.checkpoint.verify import verify_step
from ftrain.contract.config import ConfigError
from ftrain.contract.local_files import create_new

#: a converter for ``fmt="hf"``: (model state, recorded ``[model]`` config) -> (tensors, JSON files by
#: name: ``config.json`` and any others, e.g. ``generation_config.json``)
HfConverter = Callable[
    [Mapping[str, Any], Mapping[str, Any]], tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]
]
#: shards of a Hugging Face export hold at most this many bytes (a tensor larger than it gets its own)
MAX_SHARD_BYTES = 2 * 1000**3
FORMATS = ("torch", "hf")

_CORRUPTION_TYPES = (ChecksumMismatchError, UnsafePickleError)


def _corruption_in(err: BaseException) -> BaseException | None:
    """The ChecksumMismatchError/UnsafePickleError behind a failed DCP load, if any (DCP wraps
    per-rank errors in CheckpointException, a BaseException)."""
    if isinstance(err, _CORRUPTION_TYPES):
        return err
    for wrapped in (getattr(err, "failures", None) or {}).values():
        exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
        if isinstance(exc, _CORRUPTION_TYPES):
            return exc
    return None


def _load_all(reader: VerifiedReader) -> dict[str, Any]:
    """Every item of the step, loaded safely; a corruption error is re-raised as itself."""
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=SafeEmptyStateDictLoadPlanner(), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        found = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else _corruption_in(e)
        if found is None or found is e:
            raise
        raise found from e
    return state


def export_step(
    storage: Storage,
    step: int,
    out_path: str | Path,
    *,
    hmac_key_env: str = "",
    job: str | None = None,
    include_optimizer: bool = False,
    fmt: str = "torch",
    to_hf: HfConverter | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    replace: bool = False,
) -> dict[str, Any]:
    """Write the consolidated state of ``step`` to ``out_path`` (a directory for ``fmt="hf"``,
    converted by ``to_hf``); returns a summary. ``replace``: an existing output is replaced whole
    (else it is refused, before the step is read).

    Raises ChecksumMismatchError when the step does not verify (nothing is written), and
    ChecksumMismatchError/UnsafePickleError when the bytes change or turn out unsafe while
    being loaded; ConfigError when the recorded model has no Hugging Face form;
    :class:`OutputExistsError` when ``out_path`` holds something and ``replace`` is not given."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "hf" and (to_hf is None or include_optimizer):
        raise ValueError("the hf format needs a converter and holds the model only (no optimizer state)")
    check_output(out_path, directory=fmt == "hf", replace=replace)
    dirname = step_dir_name(step)
    report = verify_step(storage, dirname, hmac_key_from_env(hmac_key_env), job=job)
    manifest = report.manifest
    if not report.ok or manifest is None:  # a report is ok only with the manifest it verified against
        raise ChecksumMismatchError(f"{dirname} does not verify: " + "; ".join(str(p) for p in report.problems))
    recorded_model = manifest.config.get("model", {})
    if to_hf is not None and fmt == "hf":
        to_hf({}, recorded_model)  # no tensors: a model without a Hugging Face form fails before the read
    reader = VerifiedReader(
        storage.child_url(dirname), options=storage.options, files=manifest.files, algorithm=manifest.digest_algorithm
    )
    state = _load_all(reader)
    model = state.get("model", {})
    if fmt == "hf":
        assert to_hf is not None
        tensors, files = to_hf(model, recorded_model)
        written = write_hf_dir(out_path, tensors, files, max_shard_bytes=max_shard_bytes, replace=replace)
        return {
            "step": step,
            "tensors": len(tensors),
            "params": sum(t.numel() for t in tensors.values()),
            "path": str(out_path),
            "files": written,
        }
    out: dict[str, Any] = dict(model)
    if include_optimizer:
        out = {"model": model, "optim": state.get("optim", {})}
    _write_file(Path(out_path), lambda f: torch.save(out, f), replace=replace)
    return {
        "step": step,
        "tensors": len(model),
        "params": sum(t.numel() for t in model.values() if torch.is_tensor(t)),
        "path": str(out_path),
    }


class OutputExistsError(FileExistsError):
    """The export's output already holds something, and replacing it was not asked for."""


def check_output(out_path: str | Path, *, directory: bool, replace: bool) -> None:
    """Refuse an output an export must not write: a link, the wrong kind of thing, or (without
    ``replace``) an existing file or a directory that is not empty."""
    out = Path(out_path)
    if out.is_symlink():
        raise OutputExistsError(f"{str(out)!r} is a symbolic link: give the path it points to")
    if not out.exists():
        return
    kind = "directory" if directory else "file"
    if out.is_dir() != directory:
        raise OutputExistsError(f"{str(out)!r} exists and is not a {kind}")
    if directory and not any(out.iterdir()):
        return
    if not replace:
        what = "a directory that is not empty" if directory else "a file"
        raise OutputExistsError(
            f"{str(out)!r} is {what} (an earlier export?): give a new path, or --replace to replace it whole"
        )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_file(out: Path, write: Callable[[Any], None], *, replace: bool) -> None:
    """``write(file)`` into a new file beside ``out``, renamed over it once complete."""
    check_output(out, directory=False, replace=replace)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}-{os.urandom(4).hex()}")
    fd = create_new(tmp)  # O_EXCL | O_NOFOLLOW: nothing planted under the name is written through
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        check_output(out, directory=False, replace=replace)  # again: it may have appeared meanwhile
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the kernel,
    libc or filesystem has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _install_dir(new: Path, out: Path) -> None:
    """Put the complete directory ``new`` at ``out``; an existing ``out`` is swapped out whole
    and removed only after."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.rename(new, out)  # onto nothing, or onto an empty directory: atomic
        return
    if _exchange(new, out):
        shutil.rmtree(new)  # now the old export
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    os.rename(out, old)  # onto the empty directory just made
    os.rename(new, out)
    shutil.rmtree(old)


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigError("", f"--format hf needs the hf extra: pip install 'ftrain[hf]' ({e})") from None
    return save_file


def write_hf_dir(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    files: Mapping[str, Mapping[str, Any]],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    replace: bool = False,
) -> list[str]:
    """Write a ``save_pretrained``-style directory: ``files`` (JSON, by name: ``config.json`` and
    any others), and ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at
    most ``max_shard_bytes`` (in name order) and ``model.safetensors.index.json``. Written in a new
    directory beside ``out_dir`` and put in place whole once complete (see the module doc);
    ``replace``: an existing export there is replaced. Returns the files written."""
    if "config.json" not in files or any(Path(n).name != n or not n.endswith(".json") for n in files):
        raise ValueError(f"the JSON files of an hf export are plain *.json names with config.json, got {sorted(files)}")
    save_file = _safetensors_save()
    out = Path(os.path.abspath(out_dir))
    check_output(out, directory=True, replace=replace)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))  # 0700, a fresh name
    try:
        written = _write_hf_files(tmp, tensors, files, max_shard_bytes, save_file)
        os.chmod(tmp, 0o777 & ~_umask())
        check_output(out, directory=True, replace=replace)  # again: it may have been filled meanwhile
        _install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def _write_hf_files(
    out: Path,
    tensors: Mapping[str, torch.Tensor],
    files: Mapping[str, Mapping[str, Any]],
    max_shard_bytes: int,
    save_file: Any,
) -> list[str]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    written = []
    for name in sorted(files, key=lambda n: (n != "config.json", n)):
        (out / name).write_text(json.dumps(dict(files[name]), indent=2, sort_keys=True) + "\n")
        written.append(name)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return [*written, "model.safetensors"]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        written.append(name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*written, "model.safetensors.index.json"]
