"""Pickles inside real DCP shards (issue #8): a step whose manifest and digests are valid but
whose ``.distcp`` shard carries a crafted pickle in a non-tensor item (an optimizer
``param_groups`` value) must never run code — not in ``ftrain ckpt verify`` (exit 1, names the
file and the item), not in ``ftrain ckpt export`` (refused, nothing written), not on resume
through ``CheckpointManager.load`` (marked corrupt, falls back) or ``dcp.load`` with
``SafeLoadPlanner`` and ``VerifiedReader``. A clean step still loads bitwise.

Steps are saved by the real ``CheckpointManager`` to a local directory in this one process;
the attacker is someone who can write the bucket but has no HMAC key: they rewrite shard bytes,
``.metadata`` if they need to, and the manifest's digests to match.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftrain.checkpoint.dcp_read import VerifiedReader, load_metadata
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.errors import UnsafePickleError
from ftrain.checkpoint.export import export_step
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, step_dir_name
from ftrain.checkpoint.safe_pickle import SafeLoadPlanner, bytes_items
from ftrain.checkpoint.storage import Storage
from ftrain.checkpoint.verify import check_pickled_items, verify_step
from ftrain.cli.ckpt import add_parsers as add_ckpt_parser

ITEM = "optim.param_groups.0.lr"
FIELDS = {
    "round": 0,
    "world_size": 1,
    "layout": {"strategy": "single"},
    "config_hash": "h",
    "config": {},
    "trainer": {"cursor": [0, 0]},
}


class _Payload:
    """Unpickling this runs ``open(path, "w")``: the file's existence proves code ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


@pytest.fixture
def saved(tmp_path) -> tuple[Storage, torch.nn.Module, torch.optim.Optimizer]:
    """Steps 1 and 2 of a tiny model + AdamW, saved through the real CheckpointManager."""
    model, optim = _model_and_optimizer(0)
    manager = CheckpointManager(url=f"file://{tmp_path}/ckpt", async_mode="off", keep_last=10)
    for step in (1, 2):
        assert manager.save(step, _state(model, optim), FIELDS, sync=True)
    manager.close()
    return Storage(f"file://{tmp_path}/ckpt"), model, optim


def _forge_manifest(storage: Storage, dirname: str, names: list[str]) -> None:
    """Rewrite the manifest's entries for ``names`` to match the bytes now in storage (no HMAC)."""
    obj = json.loads(storage.read_bytes(f"{dirname}/{MANIFEST_NAME}"))
    for name in names:
        data = storage.read_bytes(f"{dirname}/{name}")
        obj["files"][name] = {"size_bytes": len(data), "digest": digest_bytes(data, obj["digest_algorithm"])}
    storage.write_bytes(f"{dirname}/{MANIFEST_NAME}", json.dumps(obj).encode())


def _plant_in_place(storage: Storage, dirname: str, sentinel: Path) -> str:
    """Overwrite ITEM's bytes inside its shard with a plain pickle of the payload, padded to the
    same length (unpickling stops at STOP): ``.metadata`` stays byte-identical."""
    metadata = load_metadata(storage.read_bytes(f"{dirname}/.metadata"))
    info = bytes_items(metadata)[ITEM]
    evil = pickle.dumps(_Payload(str(sentinel)), protocol=2)
    assert len(evil) <= info.length
    shard = bytearray(storage.read_bytes(f"{dirname}/{info.relative_path}"))
    shard[info.offset : info.offset + info.length] = evil.ljust(info.length, b" ")
    storage.write_bytes(f"{dirname}/{info.relative_path}", bytes(shard))
    _forge_manifest(storage, dirname, [info.relative_path])
    return info.relative_path


def _plant_torch_save(storage: Storage, dirname: str, sentinel: Path) -> str:
    """Append a ``torch.save`` archive of the payload to the shard and point ITEM at it in a
    re-pickled ``.metadata``: both files and the manifest forged."""
    metadata = load_metadata(storage.read_bytes(f"{dirname}/.metadata"))
    info = bytes_items(metadata)[ITEM]
    buf = io.BytesIO()
    torch.save(_Payload(str(sentinel)), buf)
    shard = storage.read_bytes(f"{dirname}/{info.relative_path}")
    storage.write_bytes(f"{dirname}/{info.relative_path}", shard + buf.getvalue())
    info.offset, info.length = len(shard), len(buf.getvalue())
    storage.write_bytes(f"{dirname}/.metadata", pickle.dumps(metadata))
    _forge_manifest(storage, dirname, [info.relative_path, ".metadata"])
    return info.relative_path


PLANTS = {"pickle-in-place": _plant_in_place, "torch-save-forged-metadata": _plant_torch_save}


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ftrain")
    add_ckpt_parser(parser.add_subparsers(dest="command", required=True))
    args, overrides = parser.parse_known_args(argv)
    return args.func(args, overrides)


def _reader(storage: Storage, dirname: str) -> VerifiedReader:
    manifest = verify_step(storage, dirname).manifest
    return VerifiedReader(
        storage.child_url(dirname), options=storage.options, files=manifest.files, algorithm=manifest.digest_algorithm
    )


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_crafted_shard_item_never_runs(plant, saved, tmp_path, capsys):
    storage, _, _ = saved
    dirname = step_dir_name(2)
    sentinel = tmp_path / "PWNED"
    shard = PLANTS[plant](storage, dirname, sentinel)
    manifest = verify_step(storage, dirname).manifest  # the forged manifest parses: only digests to go on

    assert run_cli(["ckpt", "verify", storage.url, "2"]) == 1
    out = capsys.readouterr().out
    assert f"{dirname}: FAILED" in out and f"{shard}: unsafe:" in out and ITEM in out
    assert run_cli(["ckpt", "verify", storage.url]) == 1
    out = capsys.readouterr().out
    assert "step-000000001: OK" in out and f"{shard}: unsafe:" in out

    problems = check_pickled_items(storage, dirname, manifest, span_limit_bytes=0)  # one read per item
    assert [(p.file, p.kind) for p in problems] == [(shard, "unsafe")] and ITEM in problems[0].detail

    out_pt = tmp_path / "export.pt"
    assert run_cli(["ckpt", "export", storage.url, "2", str(out_pt)]) == 1
    assert f"{shard}: unsafe" in capsys.readouterr().err and not out_pt.exists()

    model, optim = _model_and_optimizer(1)
    with pytest.raises(BaseException) as err:  # DCP wraps it in CheckpointException (a BaseException)
        dcp.load(_state(model, optim), storage_reader=_reader(storage, dirname), planner=SafeLoadPlanner())
    assert "UnsafePickleError" in repr(err.value) or isinstance(err.value, UnsafePickleError)
    assert ITEM in str(err.value) and shard in str(err.value)
    assert not sentinel.exists(), "the crafted pickle ran"


def test_export_refuses_even_when_verification_is_skipped(saved, tmp_path, monkeypatch):
    """The planner is the last line: with the verification pass stubbed out, export still refuses."""
    storage, _, _ = saved
    sentinel = tmp_path / "PWNED"
    _plant_torch_save(storage, step_dir_name(2), sentinel)
    real = verify_step

    def digests_only(storage_, dirname_, key_=None, **kw):
        report = real(storage_, dirname_, key_, **kw)
        report.problems, report.ok = [], True
        return report

    monkeypatch.setattr("ftrain.checkpoint.export.verify_step", digests_only)
    with pytest.raises(UnsafePickleError, match=ITEM):
        export_step(storage, 2, tmp_path / "export.pt")
    assert not sentinel.exists() and not (tmp_path / "export.pt").exists()


def test_resume_falls_back_from_a_crafted_step(saved, tmp_path):
    """CheckpointManager.load (as the lead wires it, and even with DCP's default planner, which
    VerifiedReader overrides for bytes items) marks the crafted step corrupt and loads step 1."""
    storage, _, _ = saved
    sentinel = tmp_path / "PWNED"
    _plant_in_place(storage, step_dir_name(2), sentinel)
    model, optim = _model_and_optimizer(1)
    manager = CheckpointManager(url=storage.url, async_mode="off")
    manifest = manager.load(lambda m: _state(model, optim))
    assert manifest is not None and manifest.step == 1
    assert storage.exists(f"{step_dir_name(2)}/{CORRUPT_NAME}")
    assert not sentinel.exists(), "the crafted pickle ran"


def test_default_planner_would_run_the_crafted_pickle(saved, tmp_path):
    """Canary: the crafted shard is a real attack on plain DCP, so the refusals above are not vacuous."""
    storage, _, _ = saved
    sentinel = tmp_path / "PWNED"
    dirname = step_dir_name(2)
    _plant_in_place(storage, dirname, sentinel)
    model, optim = _model_and_optimizer(1)
    # any error will do (noqa: B017): the payload returns a file object, not torch's magic number
    with pytest.raises(BaseException):  # noqa: B017
        dcp.load(_state(model, optim), storage_reader=FsspecReader(storage.child_url(dirname)))
    assert sentinel.exists()


def test_clean_step_loads_bitwise(saved):
    storage, model, optim = saved
    dirname = step_dir_name(2)
    assert verify_step(storage, dirname).ok
    fresh_model, fresh_optim = _model_and_optimizer(1)
    state = _state(fresh_model, fresh_optim)
    dcp.load(state, storage_reader=_reader(storage, dirname), planner=SafeLoadPlanner())
    set_state_dict(fresh_model, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    want, got = optim.state_dict(), fresh_optim.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for key, per_param in want["state"].items():
        for field, value in per_param.items():
            assert torch.equal(got["state"][key][field], value), (key, field)
