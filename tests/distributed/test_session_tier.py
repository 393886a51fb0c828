"""The memory tier in a user's loop (:mod:`ftrain.session_tier`) on real gloo ranks, for every
layout that spreads a model over the ranks (and pipeline-like stages of plain parameters, which the
loop declares not replicas): a snapshot of a session's state (model shards,
optimizer, a sampler, each rank's own RNG state) is restored bit for bit after the state moved on, with one rank a new
process whose shards come from its buddy's copy only. The agents' end of it (a SIGKILLed
worker and a lost node healed from memory) is tests/integration/test_own_loop.py's."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import run, worker_env

pytestmark = pytest.mark.dist

LAYOUTS = ("fsdp", "tp", "fsdp+tp", "hsdp", "stages")  # stages: a pipeline's, plain parameters


def test_a_session_state_spread_over_the_ranks_heals_from_the_tier_bitwise_in_every_layout(tmp_path):
    out = tmp_path / "results.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "tests/distributed/session_tier_worker.py", *LAYOUTS,
    ]  # fmt: skip
    proc = run(cmd, timeout_s=300, env=worker_env(OUT=str(out)))
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [r for rank in json.loads(out.read_text()) for r in rank]
    assert sorted({r["layout"] for r in results}) == sorted(LAYOUTS) and len(results) == 4 * len(LAYOUTS)
    for r in results:
        assert r["restored_step"] == 2, r  # the snapshot's step, on every rank
        assert r["tensors"] > 0 and r["different"] == [], r  # every shard and optimizer state, bitwise
        assert r["sampler_equal"] and r["rng_equal"], r  # rank 1's RNG state too, from its buddy's copy
    for name in LAYOUTS:  # each rank went back to its own generator, not one rank's
        assert len({r["rng_draw"] for r in results if r["layout"] == name}) == 4
    assert all(r["rank1_held"] >= 1 for r in results if r["rank1_held"] >= 0)  # it had one, then lost it
