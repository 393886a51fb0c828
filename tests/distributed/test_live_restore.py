"""How live workers agree on the state of a new round (:func:`ftrain.recovery.live.restore`), on 3 real
gloo ranks: the newest step that some rank holds wins, is sent whole to the others and checked
against its digest; replicas that disagree send everyone to storage; a rank that holds everything
already receives nothing."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import TINY_CONFIG, run, worker_env

pytestmark = pytest.mark.dist


def _restore(tmp_path, scenario: str) -> list[dict]:
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / scenario
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "tests/distributed/live_restore_worker.py", str(config), scenario, str(out),
    ]  # fmt: skip
    proc = run(cmd, timeout_s=180, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


def test_a_rank_behind_takes_the_newer_step_whole_from_a_rank_ahead(tmp_path):
    ranks = _restore(tmp_path, "mixed")
    assert {r["source"] for r in ranks} == {"live_peer"} and {r["from_rank"] for r in ranks} == {0}
    assert {r["step"] for r in ranks} == {3} and {r["cursor_step"] for r in ranks} == {3}
    assert len({r["digest"] for r in ranks}) == 1, "the ranks hold different state after the transfer"


def test_replicas_that_disagree_on_the_newest_step_make_every_rank_load_from_storage(tmp_path):
    ranks = _restore(tmp_path, "replicas_differ")
    # no checkpoint.uri in this job: storage has nothing, so every rank starts fresh, together
    assert [r["source"] for r in ranks] == ["fresh"] * 3
    assert {r["cursor_step"] for r in ranks} == {0}


def test_a_new_process_gets_the_state_of_the_ranks_that_hold_it(tmp_path):
    """... and the LR schedule they trained on (one a resume kept: 7 steps, not the configured 3)."""
    ranks = _restore(tmp_path, "joiner")
    assert {r["source"] for r in ranks} == {"live_peer"} and {r["step"] for r in ranks} == {2}
    assert len({r["digest"] for r in ranks}) == 1
    assert [r["schedule_steps"] for r in ranks] == [7, 7, 7]


def test_ranks_that_all_hold_the_step_keep_it_and_receive_nothing(tmp_path):
    ranks = _restore(tmp_path, "all_hold")
    assert {r["source"] for r in ranks} == {"memory"} and {r["step"] for r in ranks} == {2}
    assert len({r["digest"] for r in ranks}) == 1
