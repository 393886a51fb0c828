"""Export one committed step as a single consolidated ``torch.save`` file (for inference).

The step is verified first (manifest, HMAC, every file's digest, and every pickle a load would
unpickle, see :func:`ftrain.checkpoint.verify.check_pickled_items`); DCP then reads every shard in this
one process through :class:`~ftrain.checkpoint.dcp_read.VerifiedReader` with
:class:`~ftrain.checkpoint.safe_pickle.SafeEmptyStateDictLoadPlanner`, so no byte from storage reaches
an unrestricted unpickler. The whole state must fit in memory. By default only the model's
parameters are exported (``{"model.<name>": tensor}`` keys become ``{"<name>": tensor}``).
"""

from __future__ import annotations

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
) -> dict[str, Any]:
    """Write the consolidated state of ``step`` to ``out_path``; returns a summary.

    Raises ChecksumMismatchError when the step does not verify (nothing is written), and
    ChecksumMismatchError/UnsafePickleError when the bytes change or turn out unsafe while
    being loaded."""
    dirname = step_dir_name(step)
    report = verify_step(storage, dirname, hmac_key_from_env(hmac_key_env), job=job)
    manifest = report.manifest
    if not report.ok or manifest is None:  # a report is ok only with the manifest it verified against
        raise ChecksumMismatchError(f"{dirname} does not verify: " + "; ".join(str(p) for p in report.problems))
    reader = VerifiedReader(
        storage.child_url(dirname), options=storage.options, files=manifest.files, algorithm=manifest.digest_algorithm
    )
    state = _load_all(reader)
    model = state.get("model", {})
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
