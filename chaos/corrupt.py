"""Damage a committed checkpoint the ways storage and people do: a flipped bit, a truncated or
deleted file, an edited manifest. Each returns the name of the file it damaged."""

from __future__ import annotations

import json
import random

from ftrain.checkpoint.manifest import MANIFEST_NAME
from ftrain.checkpoint.storage import Storage

MODES = ("bitflip", "truncate", "delete", "manifest")


def _data_files(storage: Storage, dirname: str) -> list[str]:
    manifest = json.loads(storage.read_bytes(f"{dirname}/{MANIFEST_NAME}"))
    return sorted(name for name in manifest["files"] if name.endswith(".distcp"))


def corrupt_step(storage: Storage, dirname: str, mode: str, rng: random.Random) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown corruption {mode!r}: one of {', '.join(MODES)}")
    name = rng.choice(_data_files(storage, dirname))
    path = f"{dirname}/{name}"
    if mode == "bitflip":
        flipped = bytearray(storage.read_bytes(path))
        position = rng.randrange(len(flipped))
        flipped[position] ^= 1 << rng.randrange(8)
        storage.write_bytes(path, bytes(flipped))
    elif mode == "truncate":
        data = storage.read_bytes(path)
        storage.write_bytes(path, data[: len(data) // 3])
    elif mode == "delete":
        storage.remove(path)
    else:  # the manifest now promises a size the file does not have
        manifest = json.loads(storage.read_bytes(f"{dirname}/{MANIFEST_NAME}"))
        manifest["files"][name]["size_bytes"] += 1
        storage.write_bytes(f"{dirname}/{MANIFEST_NAME}", json.dumps(manifest).encode())
    return name
