"""A bad file in ``checkpoint.memory_dir`` (issue 25 item 4): a link to /dev/zero, a FIFO, a
directory named like a shard, a file longer than its manifest says, a file that vanished between
discovery and the restore. Each makes every rank refuse the snapshot together — an event naming
the file — and fall back to storage (none here: a fresh start), and the job trains on; never an
unbounded read, a hang, a crash or a rank left alone in an exchange. An intact snapshot is then
resumed from as before."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.contract.events import read_jsonl
from ftrain.testbed.jobs import TINY_CONFIG, run, worker_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

DEFECTS = ["symlink_to_dev_zero", "fifo", "directory", "longer", "vanished"]


def test_a_bad_file_in_the_tier_is_refused_by_every_rank_and_training_goes_on(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    shm, events, out = tmp_path / "shm", tmp_path / "events.jsonl", tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "tests/distributed/tier_files_worker.py", str(config), str(shm), str(events), str(out), ",".join(DEFECTS),
    ]  # fmt: skip
    proc = run(cmd, timeout_s=540, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    log = events.read_bytes()
    for phase in zip(*ranks, strict=True):
        defect = phase[0]["defect"]
        lines = log[phase[0]["begin"] : phase[0]["end"]].decode().splitlines()
        seen = [json.loads(line) for line in lines]
        named = [e for e in seen if e["event"] in ("memory_skipped", "memory_refused") and "__0_0.distcp" in str(e)]
        restored = [e for e in seen if e["event"] == "memory_restored"]
        if defect == "none":
            assert [p["resumed_at"] for p in phase] == [4, 4] and len(restored) == 2, (defect, seen)
        else:
            assert [p["resumed_at"] for p in phase] == [0, 0], (defect, phase)  # storage: nothing, a fresh start
            assert not restored and named, (defect, seen)
            assert {e["rank"] for e in seen if e["event"] == "memory_refused"} == {0, 1}, (defect, seen)
    # Each run that trained to step 4 (the first, and one per defect: a fresh start) ended with a
    # snapshot of step 4 on both ranks (a due one is put off only while a step follows).
    last = [e for e in read_jsonl(events) if e["event"] == "memory_snapshot" and e["step"] == 4]
    assert len(last) == 2 * (1 + len(DEFECTS)), last
