"""Issue 40 item 5: a world size the job cannot run is refused once, at ``ftrain agent``'s start or
at the round that would form it, naming the setting and the node counts that work — never a
shrink/grow loop (before: ``--nnodes 2:3`` with a batch that 3 nodes do not divide shrank to 2,
grew back to 3 and failed again for two minutes).

The runtime's check (:mod:`ftrain.parallel.world_sizes`), the leader on a fake clock
(:mod:`tests.leader_support`: nothing waits) and the agent's command line (no etcd: it refuses
before it connects).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from ftrain.agents.leader import Finish, FormRound, Wait, decide, waiting_reasons
from ftrain.agents.records import FAILED, SCALE_UP, WORKER_EXIT, Report
from ftrain.cli import build_parser, main
from ftrain.cli.agent import resolve_options
from ftrain.cli.config import load_job_config
from ftrain.contract import exits
from ftrain.parallel import world_sizes
from tests.leader_support import POLICY, T0, FakeJob, running_job

#: 16 sequences in micro-batches of 2: 8 per step, so 2, 4 or 8 data-parallel ranks (1, 2 or 4
#: nodes of 2 workers) divide it, and 3 nodes (6 ranks) do not
BATCH = ("--train.global_batch_size=16", "--train.micro_batch_size=2")
#: the worker's own words at 3 nodes of 2 (``ftrain.train.describe_failure`` of its ConfigError)
REFUSED_AT_3 = (
    "ConfigError: train.global_batch_size: 16 is not divisible by train.micro_batch_size * data-parallel size "
    "(b*dp=2*6=12); choose a data-parallel size in {1, 2, 4, 8} with train.micro_batch_size=2"
)


def job_config(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'[checkpoint]\nuri = "{tmp_path / "ckpt"}"\n')
    return path


def test_the_runtime_says_which_world_sizes_a_config_runs_at_naming_the_setting(tmp_path: Path) -> None:
    cfg = load_job_config(job_config(tmp_path), BATCH)
    assert world_sizes.refusal(cfg, 8, local_world_size=2) is None
    problem = world_sizes.refusal(cfg, 6, local_world_size=2)
    assert problem is not None and problem.key == "train.global_batch_size" and "b*dp=2*6=12" in str(problem)
    assert list(world_sizes.node_count_refusals(cfg, range(1, 6), 2)) == [3, 5]
    assert world_sizes.workable_node_counts(cfg, 2, 64) == [1, 2, 4]  # 8 nodes: 16 ranks, 8 micro-batches
    piped = load_job_config(job_config(tmp_path), (*BATCH, "--parallel.pp_size=4"))
    assert world_sizes.refusal(piped, 6, local_world_size=2).key == "parallel.pp_size"


# -- the leader --------------------------------------------------------------------------------
def fail_on_config(job: FakeJob, g: int, *node_ids: str, at: float) -> None:
    """``node_ids``' workers stopped at start on the config error a world of 3 nodes gives."""
    for node_id in node_ids:
        detail = f"torchrun exited with 1; log /tmp/{node_id}.log; local rank 0: {REFUSED_AT_3}"
        report = Report(FAILED, WORKER_EXIT, detail, job.uid(node_id), at, step=-1, error=REFUSED_AT_3)
        job.put(job.keys.report(g, node_id), report.to_json())


def test_a_node_count_the_config_cannot_run_never_forms_a_round_at_start_or_to_scale_up() -> None:
    """3 nodes available, 3 refused (``ftrain agent`` found it at start): the round takes 2 and the
    third waits as a spare, saying why; committed checkpoints do not make it grow into 3."""
    policy = replace(POLICY, refused=((3, REFUSED_AT_3.removeprefix("ConfigError: ")),))
    job, memory, first = running_job("a", "b", "c", policy=policy)
    assert [m.node_id for m in first.members] == ["a", "b"]
    for step, at in ((100, T0 + 2), (200, T0 + 40), (300, T0 + 80)):
        job.checkpoint("a", step, at=at)
        job.checkpoint("b", step, at=at)
        decision, memory = decide(job.state(), policy, memory, at + 1)
        assert decision == Wait("round healthy"), decision
    why = waiting_reasons(job.state(), policy, memory, T0 + 81)["c"]
    assert "world size 6" in why and "train.global_batch_size" in why and "spare" in why


def test_a_world_size_the_workers_refuse_with_a_config_error_is_left_out_after_one_try() -> None:
    """The agent could not check it (or the check missed it): round 1 of 3 nodes fails on the
    workers' config error. The next round takes 2, says once why, and the idle third node never
    makes the leader try 3 again — where before it shrank and grew until the restart budget ended."""
    job, memory, first = running_job("a", "b", "c")
    fail_on_config(job, first.round, "a", "b", "c", at=T0 + 5)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 6)
    assert isinstance(decision, FormRound), decision
    second = decision.record
    assert [m.node_id for m in second.members] == ["a", "b"] and second.reason == WORKER_EXIT
    assert "refused world size 6 (3 node(s) x 2)" in decision.note and "train.global_batch_size" in decision.note
    job.apply(second)
    job.start(second.round, "a", "b")
    for step, at in ((100, T0 + 10), (200, T0 + 60), (300, T0 + 600)):
        job.checkpoint("a", step, at=at)
        job.checkpoint("b", step, at=at)
        decision, memory = decide(job.state(), POLICY, memory, at + 1)
        assert decision == Wait("round healthy"), decision
    assert "train.global_batch_size" in waiting_reasons(job.state(), POLICY, memory, T0 + 601)["c"]
    job.lose("b")  # a node loss: the spare takes its place, at the size that runs
    _, memory = decide(job.state(), POLICY, memory, T0 + 602)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 602 + POLICY.settle_s)
    assert isinstance(decision, FormRound) and [m.node_id for m in decision.record.members] == ["a", "c"]
    assert decision.note == "", "said once"


def test_when_the_workers_refuse_the_only_node_count_the_job_fails_at_once_naming_the_setting() -> None:
    policy = replace(POLICY, min_nodes=3)
    job, memory, first = running_job("a", "b", "c", policy=policy)
    fail_on_config(job, first.round, "c", at=T0 + 5)
    decision, _ = decide(job.state(), policy, memory, T0 + 6)
    assert isinstance(decision, Finish) and decision.final.status == FAILED
    assert "refused world size 6" in decision.final.reason and "train.global_batch_size" in decision.final.reason
    assert "--nnodes 3:3" in decision.final.reason


def test_another_worker_error_is_no_refusal_of_the_size() -> None:
    job, memory, first = running_job("a", "b", "c")
    report = Report(FAILED, WORKER_EXIT, "torchrun exited with 1", job.uid("c"), T0 + 5, step=7, error="OSError: disk")
    job.put(job.keys.report(first.round, "c"), report.to_json())
    decision, memory = decide(job.state(), POLICY, memory, T0 + 6)
    assert isinstance(decision, FormRound) and len(decision.record.members) == 3 and decision.note == ""
    assert memory.refused == () and decision.record.reason != SCALE_UP


# -- ftrain agent ------------------------------------------------------------------------------
AGENT = ("agent", "--etcd", "http://127.0.0.1:1", "--job", "j", "--node-id", "n", "--nproc-per-node", "2")


def test_the_agent_refuses_at_start_a_range_where_no_node_count_runs_naming_the_setting_and_those_that_do(
    tmp_path: Path, capsys
) -> None:
    """3 nodes of 2 do not divide the batch, and --nnodes 3:3 has no other count: exit 2 before
    any etcd is reached (the one given is not listening), naming the key and 1, 2, 4 nodes."""
    argv = [*AGENT, "--nnodes", "3:3", "--", str(job_config(tmp_path)), *BATCH]
    assert main(argv) == exits.USAGE
    err = capsys.readouterr().err
    assert err.startswith("ftrain: config error: train.global_batch_size: no node count of --nnodes 3:3")
    assert "3 node(s) = 6 ranks" in err and "node counts that would run it at --nproc-per-node 2: 1, 2, 4" in err


def test_the_agent_skips_the_node_counts_that_cannot_run_and_says_so_once(tmp_path: Path, caplog) -> None:
    argv = [*AGENT, "--nnodes", "2:4", "--", str(job_config(tmp_path)), *BATCH]
    with caplog.at_level(logging.WARNING, logger="ftrain.cli.agent"):
        opts = resolve_options(*build_parser(argv).parse_known_args(argv))
    opts.validate()
    [(nodes, why)] = opts.refused_nodes
    assert nodes == 3 and why.startswith("train.global_batch_size: 16 is not divisible")
    [said] = [r.getMessage() for r in caplog.records]
    assert "rounds of 3 node(s) are never formed" in said and "train.global_batch_size" in said
    policy = opts.policy()
    assert [policy.usable_nodes(n) for n in range(2, 6)] == [2, 2, 4, 4]


def test_a_minimum_the_config_cannot_run_is_refused_naming_the_fewest_that_can(tmp_path: Path) -> None:
    argv = [*AGENT, "--nnodes", "3:4", "--", str(job_config(tmp_path)), *BATCH]
    opts = resolve_options(*build_parser(argv).parse_known_args(argv))
    with pytest.raises(ValueError, match=r"--nnodes 3:4: a round of the minimum, 3 node\(s\).*--nnodes 4:4"):
        opts.validate()
