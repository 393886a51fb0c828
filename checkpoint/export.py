"""Export one committed step as a single consolidated ``torch.save`` file (for inference).

The step is verified first (manifest, HMAC, every file's digest); DCP then reads every shard
in this one process, so the whole state must fit in memory. By default only the model's
parameters are exported (``{"model.<name>": tensor}`` keys become ``{"<name>": tensor}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from checkpoint.dcp_io import VerifiedReader
from checkpoint.errors import ChecksumMismatchError
from checkpoint.manifest import hmac_key_from_env, step_dir_name
from checkpoint.storage import Storage
from checkpoint.verify import verify_step


def export_step(storage: Storage, step: int, out_path: str | Path, *, hmac_key_env: str = "",
                include_optimizer: bool = False) -> dict[str, Any]:
    """Write the consolidated state of ``step`` to ``out_path``; returns a summary."""
    dirname = step_dir_name(step)
    report = verify_step(storage, dirname, hmac_key_from_env(hmac_key_env))
    if not report.ok:
        raise ChecksumMismatchError(f"{dirname} does not verify: " + "; ".join(str(p) for p in report.problems))
    manifest = report.manifest
    state: dict[str, Any] = {}
    reader = VerifiedReader(storage.child_url(dirname), options=storage.options, files=manifest.files,
                            algorithm=manifest.digest_algorithm)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    model = state.get("model", {})
    out: dict[str, Any] = dict(model)
    if include_optimizer:
        out = {"model": model, "optim": state.get("optim", {})}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, out_path)
    return {"step": step, "tensors": len(model), "params": sum(t.numel() for t in model.values() if torch.is_tensor(t)),
            "path": str(out_path)}
