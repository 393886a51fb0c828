"""Checkpoints on a real S3 server (SeaweedFS): bitwise resume after a real SIGKILL, and
resharding fsdp x4 -> ddp x2 / x1 and across pipeline layouts with an exact data cursor; a step
exported whole (``ftrain ckpt export``) is the trained model."""

from __future__ import annotations

import sys

import pytest
import torch

from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.storage import Storage
from ftrain.contract.events import read_events
from ftrain.data import read_ledger
from ftrain.testbed.jobs import max_abs_diff, optimizer_tensors, run, train_job, worker_env
from tests.distributed.batched_runs import batched_runs

pytestmark = pytest.mark.dist


def ckpt_args(url: str, *extra: str) -> list[str]:
    return [f"--checkpoint.uri={url}", "--checkpoint.interval=4", *extra]


def assert_bitwise(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"parameter {k} differs"
    oa, ob = optimizer_tensors(a["optim"]), optimizer_tensors(b["optim"])
    assert oa and oa.keys() == ob.keys()
    for k in oa:
        assert torch.equal(oa[k], ob[k]), f"optimizer state {k} differs"


@pytest.mark.parametrize(
    ("strategy", "layout"), [("ddp", []), ("fsdp", []), ("ddp", ["--parallel.pp_size=2"])], ids=["ddp", "fsdp", "pp2"]
)
def test_sigkill_then_resume_is_bitwise_identical(strategy, layout, seaweed, s3_prefix, tmp_path, golden):
    """A run SIGKILLed after step 9 resumes from its newest commit and ends bitwise equal to an
    uninterrupted run, loss for loss. Under fsdp the resumed run's last step (saved sharded) also
    exports whole with ``ftrain ckpt export``, equal to its final weights, and ``ftrain ckpt show``
    lists its files (was a test of its own, with a job of its own)."""
    env = seaweed.env()
    golden = golden(2, *([] if strategy == "ddp" else [f"--parallel.strategy={strategy}"]), *layout)
    url = seaweed.url(f"{s3_prefix}/job")
    # fsdp keeps the node's files on local disk too: its resume reads them there (ddp: from S3)
    cache = [f"--checkpoint.local_cache_dir={tmp_path / 'cache'}"] if strategy == "fsdp" else []
    # rank 1 SIGKILLs itself after step 9: step 4 is committed, step 8 may be in flight
    crashed = train_job(
        tmp_path / "crash",
        2,
        f"--parallel.strategy={strategy}",
        *layout,
        *ckpt_args(url, *cache),
        env={**env, "FTRAIN_FAULT_SIGKILL": "9:1"},
        check=False,
        save_final=False,
    )
    assert crashed.returncode != 0
    assert [m["step"] for m in crashed.metrics][-1] >= 8
    committed = [s.step for s in list_steps(Storage(url, seaweed.storage_options())) if s.state == "committed"]
    assert 4 in committed and 10 not in committed
    events = tmp_path / "resume-events.jsonl"
    resumed = train_job(
        tmp_path / "resume",
        2,
        f"--parallel.strategy={strategy}",
        *layout,
        f"--logging.events_path={events}",
        *ckpt_args(url, *cache),
        env=env,
    )
    first = resumed.metrics[0]["step"]
    assert first - 1 in (4, 8) and first - 1 == max(committed), resumed.output[-2000:]
    assert "resumed from checkpoint step" in resumed.output
    loads = [e for e in read_events(str(events)) if e["event"] == "ckpt_loaded"]
    assert len(loads) == 2 and all(e["bytes_read"] > 0 for e in loads), loads
    # every rank read all it needed from this node's cache, or (no cache) nothing from one
    assert all(e["bytes_from_cache"] == (e["bytes_read"] if cache else 0) for e in loads), loads
    assert_bitwise(resumed.final, golden.final)
    # the resumed run's losses are the golden run's, step for step
    golden_losses = {m["step"]: m["loss"] for m in golden.metrics}
    assert all(m["loss"] == golden_losses[m["step"]] for m in resumed.metrics)
    if strategy == "fsdp":  # what fsdp saved (sharded) exports whole, and shows its files
        _assert_export_is_the_trained_model(url, 10, resumed.final["model"], env, tmp_path)


def _assert_export_is_the_trained_model(url: str, step: int, model: dict, env: dict[str, str], tmp_path) -> None:
    """``ftrain ckpt export`` of ``step`` is ``model`` exactly; ``ftrain ckpt show`` lists its files."""
    out = tmp_path / "model.pt"
    proc = run(
        [sys.executable, "-m", "ftrain", "ckpt", "export", url, str(step), str(out)],
        timeout_s=120,
        env=worker_env(**env),
    )
    assert proc.returncode == 0, proc.stdout
    exported = torch.load(out)
    assert exported.keys() == model.keys()
    assert all(torch.equal(exported[k], model[k]) for k in exported)
    show = run([sys.executable, "-m", "ftrain", "ckpt", "show", url, str(step)], timeout_s=60, env=worker_env(**env))
    assert show.returncode == 0, show.stdout
    assert "__0_0.distcp" in show.stdout and ".metadata" in show.stdout


def test_reshard_fsdp4_to_ddp2_and_ddp1(seaweed, s3_prefix, tmp_path, golden):
    """Saved by fsdp on 4 ranks, resumed by ddp on 2 and on 1 rank.

    Tolerance: as in tests/distributed/test_strategies.py (2e-4 on parameters): after the reshard the
    reduction order changes (fsdp reduce-scatter over 4 -> ddp all-reduce over 2, or none), so
    only reordering noise separates the runs. The data cursor must be exact: the samples of
    every step after the resume are those of the uninterrupted run.
    """
    env = seaweed.env()
    url = seaweed.url(f"{s3_prefix}/job")
    golden = golden(4, "--parallel.strategy=fsdp")
    saved = train_job(
        tmp_path / "fsdp4",
        4,
        "--parallel.strategy=fsdp",
        "--train.steps=10",
        *ckpt_args(url, "--checkpoint.async_mode=off"),
        env={**env, "FTRAIN_FAULT_SIGKILL": "5:0"},
        check=False,
        save_final=False,
    )
    assert saved.returncode != 0
    for world in (2, 1):
        ledger = tmp_path / f"l{world}"
        run = train_job(
            tmp_path / f"ddp{world}",
            world,
            "--parallel.strategy=ddp",
            *ckpt_args(url),
            "--checkpoint.load_step=4",
            "--checkpoint.interval=0",
            "--checkpoint.final_save=false",
            f"--data.ledger_dir={ledger}",
            env=env,
        )
        assert "saved at world size 4" in run.output
        assert run.metrics[0]["step"] == 5 and run.metrics[0]["world_size"] == world
        diff = max_abs_diff(run.final["model"], golden.final["model"])
        assert diff < 2e-4, f"ddp x{world}: parameters differ by {diff}"
        odiff = max_abs_diff(optimizer_tensors(run.final["optim"]), optimizer_tensors(golden.final["optim"]))
        assert odiff < 2e-4
        golden_ids = _ids_by_step(golden.workdir / "ledger")
        ids = _ids_by_step(ledger)
        assert sorted(ids) == list(range(4, 10))
        assert all(ids[s] == golden_ids[s] for s in ids), f"ddp x{world}: data cursor drifted"


def _resume_close_to(golden, run, ledger, what: str) -> None:
    """``run`` resumed at step 5 from step 4 and ended where ``golden`` did (reordering noise,
    as in test_reshard_fsdp4_to_ddp2_and_ddp1), reading exactly the golden run's samples."""
    assert run.metrics[0]["step"] == 5, what
    diff = max_abs_diff(run.final["model"], golden.final["model"])
    assert diff < 2e-4, f"{what}: parameters differ by {diff}"
    odiff = max_abs_diff(optimizer_tensors(run.final["optim"]), optimizer_tensors(golden.final["optim"]))
    assert odiff < 2e-4, f"{what}: optimizer state differs by {odiff}"
    ids, golden_ids = _ids_by_step(ledger), _ids_by_step(golden.workdir / "ledger")
    assert sorted(ids) == list(range(4, 10)), what
    assert all(ids[s] == golden_ids[s] for s in ids), f"{what}: data cursor drifted"


@pytest.mark.timeout(600)
def test_pipeline_checkpoints_load_across_layouts(seaweed, s3_prefix, tmp_path, tmp_path_factory, golden):
    """Saved at pp=2 x dp=2, resumed at dp=2 without a pipeline and at pp=2 x dp=1; saved
    without a pipeline, resumed at pp=2; and ``ftrain ckpt export`` of a pipeline's step is the
    whole model. The checkpoint's parameter names are the model's, whatever the layout."""
    env = seaweed.env()
    golden = golden(1, "--model.n_layer=4")
    once = ["--model.n_layer=4", "--checkpoint.load_step=4", "--checkpoint.interval=0", "--checkpoint.final_save=false"]
    saves = {
        "pp2xdp2": (4, ["--parallel.pp_size=2"], [(2, [], "dp2"), (2, ["--parallel.pp_size=2"], "pp2xdp1")]),
        "dp2": (2, [], [(2, ["--parallel.pp_size=2"], "pp2")]),
    }
    resumes: dict[str, tuple[int, tuple[str, ...]]] = {}
    for name, (nproc, layout, resumed_as) in saves.items():
        url = seaweed.url(f"{s3_prefix}/{name}")
        saved = train_job(
            tmp_path / name,
            nproc,
            "--model.n_layer=4",
            *layout,
            *ckpt_args(url, "--checkpoint.async_mode=off"),
            env={**env, "FTRAIN_FAULT_SIGKILL": "5:0"},
            check=False,
            save_final=False,
        )
        assert saved.returncode != 0
        for world, resume_layout, what in resumed_as:
            resumes[f"{name}-to-{what}"] = (world, (*resume_layout, *ckpt_args(url), *once))
    # the resumes (all on 2 ranks) share one torchrun launch (tests/distributed/batched_runs.py)
    resumed = batched_runs(tmp_path_factory, resumes, env=env)
    for case in resumes:
        result = resumed(case)  # also checks that it exited 0
        saved_on = saves[case.split("-to-")[0]][0]
        assert f"saved at world size {saved_on}" in result.output, case
        _resume_close_to(golden, result, result.workdir / "ledger", case)
    url = seaweed.url(f"{s3_prefix}/pp2xdp2")
    out = tmp_path / "model.pt"
    proc = run(
        [sys.executable, "-m", "ftrain", "ckpt", "export", url, "4", str(out)], timeout_s=120, env=worker_env(**env)
    )
    assert proc.returncode == 0, proc.stdout
    exported = torch.load(out)
    assert exported.keys() == golden.final["model"].keys()  # both stages' parts
    assert any("blocks.3." in k for k in exported) and "head.weight" in exported and "tok_emb.weight" in exported


def _ids_by_step(ledger_dir) -> dict[int, list[int]]:
    out: dict[int, dict[int, list[int]]] = {}
    for e in read_ledger(ledger_dir):
        out.setdefault(e["step"], {})[e["dp_rank"]] = e["sample_ids"]
    return {s: [i for r in sorted(v) for i in v[r]] for s, v in out.items()}


def test_deterministic_reshard_is_bitwise(seaweed, s3_prefix, tmp_path, golden):
    """With the fixed-order reduction, a 4-rank save resumed on 2 ranks is bitwise identical."""
    from tests.distributed.test_deterministic import DETERMINISTIC

    env = seaweed.env()
    url = seaweed.url(f"{s3_prefix}/job")
    ck = [f"--checkpoint.uri={url}", "--checkpoint.interval=2"]
    golden = golden(4, *DETERMINISTIC)
    saved = train_job(
        tmp_path / "w4",
        4,
        *DETERMINISTIC,
        *ck,
        "--checkpoint.async_mode=off",
        env={**env, "FTRAIN_FAULT_SIGKILL": "3:2"},
        check=False,
        save_final=False,
    )
    assert saved.returncode != 0
    run = train_job(tmp_path / "w2", 2, *DETERMINISTIC, *ck, env=env)
    assert run.metrics[0]["step"] == 3
    assert_bitwise(run.final, golden.final)
