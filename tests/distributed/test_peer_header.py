"""A peer that announces a bad state header (issue 25, item 7), on 3 real gloo ranks: a shape
of 4 TiB, a float index, a shape unlike the receiver's, another step than the survey's, bytes
that do not match the announced digest. Every rank refuses the transfer together and loads the
committed step from storage; no exception escapes :func:`ftrain.recovery.live.restore`, no rank waits in
a collective its peers left (a later clean transfer in the same process group still works), and
each rank records a ``live_peer_refused`` event."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.contract.events import Event, read_events
from ftrain.testbed.jobs import TINY_CONFIG, run, worker_env

pytestmark = pytest.mark.dist

TAMPERS = ["huge_shape", "float_index", "other_shape", "wrong_step", "other_bytes"]


def test_a_bad_header_from_a_peer_makes_every_rank_load_from_storage_together(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "tests/distributed/peer_header_worker.py", str(config), str(out), str(tmp_path / "ck"), ",".join(TAMPERS),
    ]  # fmt: skip
    proc = run(cmd, timeout_s=420, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for i, how in enumerate(TAMPERS):
        got = [r[i] for r in ranks]
        assert [g["tamper"] for g in got] == [how] * 3
        assert [(g["source"], g["step"], g["cursor_step"]) for g in got] == [("storage", 2, 2)] * 3, (how, got)
        assert len({g["digest"] for g in got}) == 1, f"{how}: the ranks went on from different state"
    clean = [r[len(TAMPERS)] for r in ranks]
    assert [(g["source"], g["step"]) for g in clean] == [("live_peer", 3)] * 3, clean
    assert len({g["digest"] for g in clean}) == 1
    refused = [e for e in read_events(str(out / "events.jsonl")) if e["event"] == Event.LIVE_PEER_REFUSED]
    assert sorted((e["rank"], e["step"], e["from_rank"]) for e in refused) == sorted(
        (r, 3, 0) for r in range(3) for _ in TAMPERS
    ), refused
    problems = {e["problem"] for e in refused if e["rank"] == 1}
    assert any("survey announced step 3" in p for p in problems), problems
    assert any("digest" in p for p in problems), problems
