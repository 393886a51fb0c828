"""Where ``ftrain ckpt export`` writes: a new output, or with ``replace`` an old one swapped out
whole, never two exports mixed in one directory (``checkpoint/export.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from ftrain.checkpoint import export  # noqa: E402
from ftrain.checkpoint.export import OutputExistsError, check_output, write_hf_dir  # noqa: E402

FILES = {"config.json": {"model_type": "llama"}, "generation_config.json": {"bos_token_id": 1}}


def tensors(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64,), value) for i in range(n)}


def read_back(out: Path) -> dict[str, torch.Tensor]:
    """What a reader of the index (ftrain's init_from) sees, else of model.safetensors (transformers' first look)."""
    index = out / "model.safetensors.index.json"
    names = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    whole: dict[str, torch.Tensor] = {}
    for name in names:
        whole |= safetensors_torch.load_file(str(out / name))
    return whole


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_an_export_over_an_earlier_one_in_another_layout_is_refused_then_replaced_whole(tmp_path):
    out = tmp_path / "hf"
    sharded = write_hf_dir(out, tensors(1.0), FILES, max_shard_bytes=300)
    assert "model.safetensors.index.json" in sharded
    with pytest.raises(OutputExistsError, match=r"is a directory that is not empty .*--replace to replace it whole"):
        write_hf_dir(out, tensors(2.0), FILES)
    assert sorted(p.name for p in out.iterdir()) == sorted(sharded)  # untouched
    single = write_hf_dir(out, tensors(2.0), FILES, replace=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(single)  # no stale shard or index beside it
    assert all(torch.equal(t, torch.full((64,), 2.0)) for t in read_back(out).values())
    write_hf_dir(out, tensors(3.0), FILES, max_shard_bytes=300, replace=True)  # and back to shards
    assert not (out / "model.safetensors").exists()
    assert all(torch.equal(t, torch.full((64,), 3.0)) for t in read_back(out).values())
    assert leftovers(tmp_path) == []


def test_a_failed_export_leaves_the_old_one_whole_and_nothing_else(tmp_path, monkeypatch):
    out = tmp_path / "hf"
    before = write_hf_dir(out, tensors(1.0), FILES)
    real = export._safetensors_save()

    def fail_at_the_second_shard(shard, path, metadata=None):
        if "00002" in path:
            raise OSError("disk full")
        real(shard, path, metadata=metadata)

    monkeypatch.setattr(export, "_safetensors_save", lambda: fail_at_the_second_shard)
    with pytest.raises(OSError, match="disk full"):
        write_hf_dir(out, tensors(2.0), FILES, max_shard_bytes=300, replace=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
    assert all(torch.equal(t, torch.full((64,), 1.0)) for t in read_back(out).values())
    assert leftovers(tmp_path) == []


def test_a_replace_without_an_atomic_exchange_still_swaps_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "_exchange", lambda a, b: False)  # a kernel or filesystem without one
    out = tmp_path / "hf"
    write_hf_dir(out, tensors(1.0), FILES, max_shard_bytes=300)
    written = write_hf_dir(out, tensors(2.0), FILES, replace=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(written) and leftovers(tmp_path) == []


def test_an_empty_directory_is_a_new_output_and_the_mode_follows_the_umask(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_dir(out, tensors(1.0), FILES)
    assert (out / "config.json").exists()
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_links_files_and_existing_files_are_named(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OutputExistsError, match="is a symbolic link"):
        check_output(tmp_path / "link", directory=True, replace=True)
    (tmp_path / "model.pt").write_bytes(b"old")
    with pytest.raises(OutputExistsError, match="exists and is not a directory"):
        check_output(tmp_path / "model.pt", directory=True, replace=True)
    with pytest.raises(OutputExistsError, match=r"is a file \(an earlier export\?\)"):
        check_output(tmp_path / "model.pt", directory=False, replace=False)
    check_output(tmp_path / "model.pt", directory=False, replace=True)


def test_a_torch_file_is_written_beside_and_renamed_into_place(tmp_path):
    out = tmp_path / "model.pt"
    export._write_file(out, lambda f: torch.save({"w": torch.ones(2)}, f), replace=False)
    with pytest.raises(OutputExistsError):
        export._write_file(out, lambda f: torch.save({"w": torch.zeros(2)}, f), replace=False)

    def broken(f):
        f.write(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        export._write_file(out, broken, replace=True)
    assert torch.equal(torch.load(out)["w"], torch.ones(2)) and leftovers(tmp_path) == []
