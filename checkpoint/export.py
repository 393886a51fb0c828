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
returns with :func:`write_hf_dir`: ``config.json`` and ``model.safetensors``, or shards of at most
``max_shard_bytes`` and ``model.safetensors.index.json`` as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
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

#: a converter for ``fmt="hf"``: (model state, recorded ``[model]`` config) -> (tensors, config.json)
HfConverter = Callable[[Mapping[str, Any], Mapping[str, Any]], tuple[dict[str, torch.Tensor], dict[str, Any]]]
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
) -> dict[str, Any]:
    """Write the consolidated state of ``step`` to ``out_path`` (a directory for ``fmt="hf"``,
    converted by ``to_hf``); returns a summary.

    Raises ChecksumMismatchError when the step does not verify (nothing is written), and
    ChecksumMismatchError/UnsafePickleError when the bytes change or turn out unsafe while
    being loaded; ConfigError when the recorded model has no Hugging Face form."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "hf" and (to_hf is None or include_optimizer):
        raise ValueError("the hf format needs a converter and holds the model only (no optimizer state)")
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
        tensors, config = to_hf(model, recorded_model)
        written = write_hf_dir(out_path, tensors, config, max_shard_bytes=max_shard_bytes)
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
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, out_path)
    return {
        "step": step,
        "tensors": len(model),
        "params": sum(t.numel() for t in model.values() if torch.is_tensor(t)),
        "path": str(out_path),
    }


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigError("", f"--format hf needs the hf extra: pip install 'ftrain[hf]' ({e})") from None
    return save_file


def write_hf_dir(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Write a ``save_pretrained``-style directory: ``config.json`` and ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (in name order) and
    ``model.safetensors.index.json``. Returns the files written."""
    save_file = _safetensors_save()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
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
    (out / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    written = ["config.json"]
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
