"""One rank of tests/distributed/test_peer_header.py (run under torchrun, 3 ranks, gloo).

Trains 2 steps (step 2 committed to a local checkpoint root), then holds state as after a
failure: ranks 0 and 2 at step 3, rank 1 at step 2, so rank 0 sends step 3 to rank 1. For each
tampering named on the command line, rank 0's sender announces a bad header (or bad bytes) and
every rank runs :func:`ftrain.recovery.live.restore` in a new trainer, as a live worker does in its next
round; a last restore without tampering shows the ranks still agree on their collectives.
Writes what each restore gave to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import ftrain.recovery.peer_state as peer_state
from ftrain.config import load_config
from ftrain.distributed import exit_without_teardown, init_distributed, select_device, shutdown_distributed
from ftrain.recovery.live import hold, restore
from ftrain.recovery.peer_state import HeldState
from ftrain.train import Trainer
from tests.distributed.live_restore_worker import OVERRIDES, _ahead

_flatten = peer_state.flatten


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return next(iter(header["d"]["model"]["d"].values()))


def _huge_shape(header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    _first_tensor(header)["shape"] = [1 << 20, 1 << 20]  # 4 TiB of float32: within the sender's own bounds


def _float_index(header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    _first_tensor(header)["t"] = float(_first_tensor(header)["t"])


def _other_shape(header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    node = _first_tensor(header)
    node["shape"] = list(reversed(node["shape"])) if len(set(node["shape"])) > 1 else [*node["shape"], 1]


def _wrong_step(header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    header["d"]["step"] = {"v": header["d"]["step"]["v"] + 5}


def _other_bytes(header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    tensors[0] = tensors[0] + 1  # a well-formed header, bytes that do not match the announced digest


TAMPER = {f.__name__.lstrip("_"): f for f in (_huge_shape, _float_index, _other_shape, _wrong_step, _other_bytes)}


def _tampering(how: str):
    def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
        header, tensors = _flatten(obj)
        TAMPER[how](header, tensors)
        return header, tensors

    return flatten


def main(config: str, out: str, ckpt: str, tampers: str) -> None:
    common = [
        *OVERRIDES,
        f"--checkpoint.uri={ckpt}",
        "--checkpoint.async_mode=off",
        f"--logging.events_path={out}/events.jsonl",
    ]
    cfg = load_config(config, ["--train.steps=2", *common])
    device = select_device(cfg.train)
    rank, world, local = init_distributed(cfg.parallel, device)
    first = Trainer(cfg, device, torch.float32, rank, world, local)
    first.run(resume=False)
    base = hold(first)
    first.close()
    results = []
    for how in [*tampers.split(","), "none"]:
        held: HeldState = _ahead(base, 0.5) if rank != 1 else base
        held.digest()  # what the survey announces: computed before the sender is tampered with
        peer_state.flatten = _tampering(how) if rank == 0 and how != "none" else _flatten
        longer = load_config(config, ["--train.steps=3", "--train.on_schedule_change=rescale", *common])
        second = Trainer(longer, device, torch.float32, rank, world, local)
        restored = restore(second, held)
        peer_state.flatten = _flatten
        results.append(
            {
                "tamper": how,
                "source": restored.source,
                "step": restored.step,
                "cursor_step": second.cursor.step,
                "digest": hold(second).digest(),
            }
        )
        second.close()
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
