"""A three-file ``[[data.sources]]`` mixture through real ``ftrain train`` jobs: trained on 2 ranks,
killed, resumed on 1 rank from its checkpoint, and the ledger proves that every sample of every
file was read exactly once by the steps that count.

The weights equal the files' sizes (48, 32 and 16 samples of ``seq_len`` 16), so one mixture epoch
of 96 samples is one pass over each file, and six steps of 16 are that epoch. Rank 0 SIGKILLs
itself after step 4; the checkpoint of step 3 is the newest, so the resumed job, in round 1,
re-runs steps 4-6 (ledger steps 3-5, 0-based) at world size 1 and supersedes what round 0
recorded of them. A last resume with the sources listed in another order (the same files, sizes
and epoch: the sample count and seed the cursor checked before all agree) is refused before any
file of the step is read, naming ``data.sources`` and the option.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ftrain.cli.config import load_job_config
from ftrain.data import MixtureSource, build_source, check_exactly_once, read_ledger, write_token_file
from ftrain.testbed.jobs import TINY_CONFIG, train_job

pytestmark = pytest.mark.dist

SEQ_LEN, SIZES, BATCH, STEPS = 16, (48, 32, 16), 16, 6


def _sources(tmp_path: Path, order: tuple[int, ...] = (0, 1, 2)) -> str:
    """Three token files (each in its own band of the 64-token vocabulary) as [[data.sources]] tables."""
    tables = []
    for k in order:
        samples = SIZES[k]
        path = tmp_path / f"source{k}.bin"
        if not path.exists():
            rng = np.random.default_rng(k)
            write_token_file(path, k * 20 + rng.integers(0, 20, size=samples * SEQ_LEN + 1), "uint16")
        tables.append(f'[[data.sources]]\npath = "{path}"\nweight = {samples}\n')
    return "\n".join(tables)


def test_mixture_resumed_at_another_world_size_reads_every_sample_of_every_source_once(tmp_path):
    config = TINY_CONFIG + "\n" + _sources(tmp_path)
    assert f"seq_len = {SEQ_LEN}" in config and f"global_batch_size = {BATCH}" in config
    ledger, ckpt = tmp_path / "ledger", tmp_path / "ckpt"
    common = (
        f"--train.steps={STEPS}",
        f"--data.ledger_dir={ledger}",
        f"--checkpoint.uri={ckpt}",
        "--checkpoint.interval=3",
        "--checkpoint.async_mode=off",
    )
    crashed = train_job(
        tmp_path / "w2",
        2,
        *common,
        config=config,
        env={"FTRAIN_FAULT_SIGKILL": "4:0"},
        check=False,
        save_final=False,
    )
    assert crashed.returncode != 0 and max(m["step"] for m in crashed.metrics) == 4, crashed.output[-3000:]
    resumed = train_job(tmp_path / "w1", 1, *common, config=config, env={"FTRAIN_ROUND": "1"}, save_final=False)
    assert resumed.metrics[0]["step"] == 4 and resumed.metrics[0]["world_size"] == 1, resumed.output[-3000:]

    cfg = load_job_config(tmp_path / "w1" / "config.toml")
    mixture = build_source(cfg.data, cfg.model)
    assert isinstance(mixture, MixtureSource) and mixture.num_samples == sum(SIZES) == STEPS * BATCH
    entries = read_ledger(ledger)
    assert {(e["round"], e["dp_rank"]) for e in entries} == {(0, 0), (0, 1), (1, 0)}
    report = check_exactly_once(
        entries,
        num_samples=mixture.num_samples,
        global_batch_size=BATCH,
        seed=cfg.data.seed,
        steps=STEPS,
        sources=mixture,
    )
    assert report.ok and report.superseded_entries >= 2, report.summary()  # step 4 ran in both rounds
    assert report.every_sample_once, report.summary()
    assert [(c.num_samples, c.reads) for c in report.sources] == [(n, n) for n in SIZES]

    reordered = TINY_CONFIG + "\n" + _sources(tmp_path, order=(1, 0, 2))
    refused = train_job(tmp_path / "reordered", 1, *common, config=reordered, check=False, save_final=False)
    assert refused.returncode != 0 and not refused.metrics, refused.output[-3000:]
    assert "data.sources[0] is" in refused.output and "which was data.sources[1]" in refused.output
    assert "--data.on_mixture_change=new_blend" in refused.output
