"""Live recovery (``ftrain agent --recovery live``) against real etcd, worker processes and signals.

Two agents with two workers each train the tiny config (steps slowed to ~30 ms so faults land
mid-run). A fault must leave the healthy workers' processes running (same PIDs before and after)
and end bitwise equal to a fault-free torchrun run of the same job. The memory tier's tests
also cover ``checkpoint.memory_dir``: new processes (of restart recovery, the agent's default,
or spares replacing every worker at once) resume from the snapshots their nodes kept instead of
from S3.

Each job costs a start of many processes (15-20 s here), so a test puts several faults of one
kind into one job where they do not interfere (each fault's recovery checked before the next).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable

import pytest
import torch

from ftrain.agent_link.heartbeat import process_gone
from ftrain.agents.workers import descendants
from ftrain.chaos.cluster import Cluster
from ftrain.chaos.s3proxy import FaultRates, S3FaultProxy
from ftrain.faults import STUCK
from ftrain.testbed.jobs import TINY_CONFIG, max_abs_diff, optimizer_tensors, train_job
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(300)

STEPS = 120
LIVE = ("--recovery", "live", "--spares", "1")
#: the fixed-order reduction: bitwise equal at any world size, and whatever DDP's bucket layout
DETERMINISTIC = ("--parallel.deterministic=true",)
FSDP = ("--parallel.strategy=fsdp",)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The same job without faults: 4 ranks under plain torchrun."""
    return train_job(tmp_path_factory.mktemp("golden"), 4, f"--train.steps={STEPS}", *DETERMINISTIC).final


#: the built-in Llama (RoPE, GQA, SwiGLU) at the tiny sizes: the model of the FSDP tests, whose
#: golden run they share
LLAMA = ("--model.arch=llama", "--model.n_kv_heads=2")


@pytest.fixture(scope="module")
def golden_llama_fsdp(tmp_path_factory):
    return train_job(tmp_path_factory.mktemp("golden-llama"), 4, f"--train.steps={STEPS}", *FSDP, *LLAMA).final


def _cluster(
    tmp_path,
    etcd,
    *overrides: str,
    strategy: tuple[str, ...] = DETERMINISTIC,
    step_sleep_s: float = 0.03,
    ckpt_uri: str | None = None,
    env: dict[str, str] | None = None,
) -> Cluster:
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    return Cluster(
        tmp_path,
        etcd.endpoint,
        config,
        steps=STEPS,
        ckpt_interval=20,
        step_sleep_s=step_sleep_s,
        ckpt_uri=ckpt_uri,
        env=env,
        overrides=[f"--train.save_final_path={tmp_path / 'final.pt'}", *strategy, *overrides],
    )


def _serving(job: Cluster, node: str, worker_round: int) -> dict[int, int]:
    """local rank -> PID of the process that served ``node`` in ``worker_round``."""
    return {e["local_rank"]: e["pid"] for e in job.events("worker_started", node=node, round=worker_round)}


def _assert_bitwise_golden(final_path, golden) -> None:
    final = torch.load(final_path, weights_only=False)
    assert max_abs_diff(final["model"], golden["model"]) == 0.0
    assert max_abs_diff(optimizer_tensors(final["optim"]), optimizer_tensors(golden["optim"])) == 0.0


def _restored_in_round_2(job, ranks: int, timeout_s: float = 60, **kwargs) -> list[dict]:
    """The ``live_restored`` events of round 2, once each of its ``ranks`` ranks emitted one."""
    return wait_for(
        lambda: len(job.events("live_restored", round=2)) == ranks and job.events("live_restored", round=2),
        timeout_s,
        "round 2",
        **kwargs,
    )


def _start(job: Cluster, *nodes: str) -> None:
    for node in nodes:
        job.start(node, *LIVE, nnodes="1:2", nproc=2)


def _node_of(job: Cluster, rank: int, worker_round: int) -> tuple[str, int]:
    """(node, pid) of the worker that served global ``rank`` in ``worker_round``."""
    e = next(e for e in job.events("worker_started", round=worker_round) if e["rank"] == rank)
    return e["node"], e["pid"]


def _distcp_reads(proxy: S3FaultProxy, since: float, until: float) -> list[str]:
    return [p for t, method, p in proxy.requests_seen if method == "GET" and ".distcp" in p and since <= t <= until]


def _s3_cluster(
    tmp_path, etcd, seaweed, s3_prefix, proxy: S3FaultProxy, *overrides: str, strategy: tuple[str, ...] = FSDP
) -> Cluster:
    """A job (fsdp unless ``strategy`` says otherwise) checkpointing to S3 through ``proxy``."""
    return _cluster(
        tmp_path,
        etcd,
        f"--checkpoint.endpoint_url={proxy.endpoint_url}",
        *overrides,
        strategy=strategy,
        ckpt_uri=seaweed.url(f"{s3_prefix}/job"),
        env=seaweed.env(),
    )


def _wait_tier_covers_commits(job: Cluster, ranks: int, step: int) -> None:
    """Until every rank's newest memory snapshot is at or past ``step`` and the newest commit. The
    tier owes a snapshot of every checkpointed step, but takes it a step or more later while the
    one before is still exchanging (slow on a loaded machine); a fault in between finds the tier
    older than storage, and the restore then rightly reads storage: not what these tests test."""

    def covered() -> bool:
        newest: dict[int, int] = {}
        for e in job.events("memory_snapshot"):
            newest[e["rank"]] = max(newest.get(e["rank"], -1), e["step"])
        wanted = max(step, *job.committed_steps())
        return len(newest) == ranks and min(newest.values()) >= wanted

    wait_for(covered, 60, f"a memory snapshot of every rank at or past step {step} and the newest commit")


def test_under_fsdp_a_damaged_memory_copy_is_refused_and_storage_is_used_in_process(
    tmp_path, etcd, seaweed, s3_prefix, golden_llama_fsdp
):
    """The copy of rank 0's shards that rank 2 keeps rots in memory (a fault hook flips a bit of
    it): the restore refuses it, every rank loads the newest checkpoint in-process instead."""
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        job = _s3_cluster(tmp_path, etcd, seaweed, s3_prefix, proxy, *LLAMA)
        damage = {"FTRAIN_FAULT_DAMAGE_MEMORY_COPY": "2"}
        try:
            job.start("a", *LIVE, nnodes="2:2", nproc=2, env=damage)
            job.start("b", *LIVE, nnodes="2:2", nproc=2, env=damage)
            job.wait_step(45)
            os.kill(_node_of(job, 0, 1)[1], signal.SIGKILL)
            restored = _restored_in_round_2(job, 4)
            assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
            assert {e["source"] for e in restored} == {"storage"}, restored
            refused = job.events("memory_refused", round=2)
            assert refused and all("does not match" in e["why"] for e in refused), refused
            assert {e["step"] for e in restored} == {max(s for s in job.committed_steps() if s <= 45)}
            _assert_bitwise_golden(tmp_path / "final.pt", golden_llama_fsdp)
        finally:
            job.close()


def _lose_and_bring_back(
    job: Cluster, lost: str, while_gone: Callable[[], None] = lambda: None, worker_round: int = 1
) -> None:
    """Node ``lost``'s agent and ``worker_round``'s workers SIGKILLed, ``while_gone()``, its agent
    started again (again while the dead agent's lease still holds its registration)."""
    job.kill_agent(lost)
    for pid in _serving(job, lost, worker_round).values():
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)
    while_gone()
    job.restart(lost)

    def registered_again() -> bool:
        if job.agents[lost].poll() == 2:  # refused: the dead agent's lease has not expired yet
            job.restart(lost)
            return False
        return len(job.events("agent_registered", node=lost)) > 1

    wait_for(registered_again, 30, f"node {lost}'s agent to register again")


def test_under_fsdp_restarted_workers_resume_from_the_snapshots_kept_in_memory_dir(
    tmp_path, etcd, seaweed, s3_prefix, golden_llama_fsdp
):
    """Restart recovery with ``checkpoint.memory_dir``: rank 0's node is lost together with its
    host memory (agent and workers SIGKILLed, its tier directory deleted) and comes back. Every
    worker of round 2 is a new process; they resume from the snapshots the nodes kept: the
    survivor's own shards and the copies of the lost node's shards its workers kept, the lost
    node's new workers receiving theirs from the survivor. No shard is read from S3, and the job
    ends bitwise equal to golden. (A damaged copy is refused by the same verification: the live
    test above and tests/distributed/test_memory_tier.py damage one.)"""
    memory_dir = tmp_path / "shm"
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        job = _s3_cluster(tmp_path, etcd, seaweed, s3_prefix, proxy, f"--checkpoint.memory_dir={memory_dir}", *LLAMA)
        try:
            job.start("a", "--recovery", "restart", nnodes="2:2", nproc=2)
            job.start("b", "--recovery", "restart", nnodes="2:2", nproc=2)
            job.wait_step(45)
            wait_for(lambda: 40 in job.committed_steps(), 30, "step 40's commit")
            _wait_tier_covers_commits(job, 4, 40)
            lost = _node_of(job, 0, 1)[0]
            lost_dir = memory_dir / "ftrain-tier-job" / lost
            assert sorted(p.parent.name for p in lost_dir.glob("local*/step-*")), "no snapshot in memory_dir"
            lost_at = time.time()
            _lose_and_bring_back(job, lost, lambda: shutil.rmtree(lost_dir))
            assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
            # the round that finished the job (the agents may first form one with the dead agent)
            last = max(e["round"] for e in job.events("worker_started"))
            restored = job.events("memory_restored", round=last)
            after_loss = [e for e in job.events("ckpt_loaded") if e["round"] > 1]
            rounds = [(e["new_round"], e["reason"], e["members"]) for e in job.events("round_formed")]
            assert len(restored) == 4 and len({e["step"] for e in restored}) == 1, (restored, rounds)
            assert min(e["step"] for e in restored) >= max(e["committed_step"] for e in restored) >= 40
            assert not after_loss and not job.events("memory_refused"), (after_loss, job.events("memory_refused"))
            assert not _distcp_reads(proxy, lost_at, max(e["time"] for e in restored)), "the restore read S3"
            _assert_bitwise_golden(tmp_path / "final.pt", golden_llama_fsdp)
            assert not list(memory_dir.rglob("step-*")), "the finished job left snapshots in memory_dir"
        finally:
            job.close()


def test_a_worker_killed_inside_a_collective_is_replaced_by_a_spare_and_losing_every_worker_heals_from_memory_dir(
    tmp_path, etcd, seaweed, s3_prefix, golden
):
    """Live recovery, ddp, ``checkpoint.memory_dir``, two faults in one job, neither read from S3.

    Rank 3 dies inside the last collective of step 40 (the peers may or may not complete it);
    the survivors keep their processes, agree on one step (replicas checked by digest at every
    step), a spare started before the fault takes rank 3's place, and nothing is read from S3.

    Later every worker of the round is SIGKILLed at once (what a fault that takes the whole job
    does: no live replica is left). The processes that replace them take the newest snapshot
    their nodes kept in memory_dir, not the newest checkpoint from S3: no shard is read from S3,
    and the job ends bitwise equal to golden, leaving no snapshot in memory_dir. (Was two tests:
    one job per fault.)"""
    memory_dir = tmp_path / "shm"
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        memory = f"--checkpoint.memory_dir={memory_dir}"
        job = _s3_cluster(
            tmp_path, etcd, seaweed, s3_prefix, proxy, memory, "--consistency.interval=1", strategy=DETERMINISTIC
        )
        try:
            fault = {"FTRAIN_FAULT_SIGKILL_IN_COLLECTIVE": "40:3:1"}
            job.start("a", *LIVE, nnodes="2:2", nproc=2, env=fault)
            job.start("b", *LIVE, nnodes="2:2", nproc=2, env=fault)
            wait_for(lambda: len(job.events("live_restored", round=1)) == 4, 90, "round 1")
            round1 = {n: _serving(job, n, 1) for n in ("a", "b")}
            node_of_rank3 = next(e["node"] for e in job.events("worker_started", round=1) if e["rank"] == 3)
            before = set(descendants(job.agents[node_of_rank3].pid))  # serving workers and the warm spare
            spares = before - set(round1[node_of_rank3].values())
            assert spares, f"no spare process under agent {node_of_rank3}: {before}"

            restored = _restored_in_round_2(job, 4, 90)
            detected_at = job.wait_event("workers_exited", 10)["time"]
            # a rank's worker_started follows its live_restored: wait for each of them
            wait_for(lambda: len(job.events("worker_started", round=2)) == 4, 60, "round 2's workers")
            round2 = {n: _serving(job, n, 2) for n in ("a", "b")}
            other = "a" if node_of_rank3 == "b" else "b"
            assert round2[other] == round1[other], "the other node's workers were restarted"
            assert round2[node_of_rank3][0] == round1[node_of_rank3][0], "the surviving sibling was restarted"
            assert round2[node_of_rank3][1] in spares, "the replacement was not a spare started before the fault"

            # one step for everyone: 40 if the survivors completed the collective, else 39
            held = {e["rank"]: e["held_step"] for e in restored}
            assert {e["step"] for e in restored} == {max(held.values())} and max(held.values()) in (39, 40), held
            assert {e["source"] for e in restored} == {"live_peer"}, restored
            print(f"held steps after the kill: {held}")
            reads = [(t, p) for t, method, p in proxy.requests_seen if method == "GET" and "list-type" not in p]
            window = (detected_at, max(e["time"] for e in restored))
            assert not [r for r in reads if window[0] <= r[0] <= window[1]], "the recovery read from S3"
            assert not job.events("resume_started", round=2)

            job.wait_step(60)
            _wait_tier_covers_commits(job, 4, 60)
            killed_at = time.time()
            for pid in [p for pids in round2.values() for p in pids.values()]:
                os.kill(pid, signal.SIGKILL)
            assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
            rounds = sorted(job.events("round_formed"), key=lambda e: e["new_round"])
            assert [e["reason"] for e in rounds[:2]] == ["start", "worker_exit"], rounds
            assert all(e["time"] > killed_at for e in rounds[2:]), (
                f"a round formed before every worker was lost: {rounds}"
            )
            assert not job.events("replica_mismatch"), "replicas held different state after a recovery"
            first_step = min(m["time"] for m in job.metrics() if m["time"] > detected_at)
            print(f"worker kill detected -> first completed step of round 2: {first_step - detected_at:.2f}s")

            last = max(e["round"] for e in job.events("worker_started"))
            restored = job.events("live_restored", round=last)
            assert last > 2 and len(restored) == 4 and {e["source"] for e in restored} == {"memory_tier"}, restored
            assert all(e["pid"] not in round2[e["node"]].values() for e in job.events("worker_started", round=last))
            assert not [e for e in job.events("ckpt_loaded") if e["round"] > 1], "a new worker loaded from S3"
            assert not job.events("memory_refused"), job.events("memory_refused")
            assert not _distcp_reads(proxy, killed_at, max(e["time"] for e in restored)), "the restore read S3"
            _assert_bitwise_golden(tmp_path / "final.pt", golden)
            assert not list(memory_dir.rglob("step-*")), "the finished job left snapshots in memory_dir"
        finally:
            job.close()


def test_a_save_waiting_for_a_slow_upload_is_not_taken_for_a_hang(tmp_path, etcd, seaweed, s3_prefix):
    """Every S3 request 0.6 s late: an upload outlasts the checkpoint interval and the next save
    waits for it (when_busy = wait) far longer than the 2 s hang timeout. The worker says it is
    saving, so its agent waits (start timeout) instead of killing it: one round, nothing lost."""
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        proxy.set_faults(FaultRates(latency=1.0, latency_s=0.6))
        job = _cluster(
            tmp_path,
            etcd,
            f"--checkpoint.endpoint_url={proxy.endpoint_url}",
            # saves at 20 and 40 (which waits for 20's upload); step 41 shows the wait; no final save
            "--train.steps=41",
            "--checkpoint.final_save=false",
            ckpt_uri=seaweed.url(f"{s3_prefix}/job"),
            env=seaweed.env(),
        )
        try:
            job.start("a", *LIVE, "--hang-timeout-s", "2", nnodes="1", nproc=1)
            assert job.wait_exit("a", timeout_s=240) == 0, job.log_tail()
        finally:
            job.close()
    times = {m["step"]: m["time"] for m in job.metrics()}
    longest_s = max(times[s] - times[s - 1] for s in times if s - 1 in times)
    assert longest_s > 2, f"no save waited longer than the hang timeout (longest gap {longest_s:.2f}s)"
    assert not job.events("hang"), "a save in progress was taken for a hang"
    assert [e["reason"] for e in job.events("round_formed")] == ["start"]


def test_a_lost_node_leaves_the_survivors_training_and_its_return_heals_from_them(tmp_path, etcd, golden):
    # slower steps: the job must outlast the returning node's warm-up (it joins only once warm)
    job = _cluster(tmp_path, etcd, step_sleep_s=0.25)
    try:
        _start(job, "a", "b")
        wait_for(lambda: len(job.events("live_restored", round=1)) == 4, 90, "both nodes in round 1")
        job.wait_step(30)
        first = min(job.events("round_formed"), key=lambda e: e["new_round"])
        survivor, lost = first["members"]  # lose node rank 1 (not the leader's node: that is covered by test_agent)
        kept = _serving(job, survivor, 1)
        lost_at = time.time()
        job.kill_agent(lost)
        for pid in _serving(job, lost, 1).values():
            os.kill(pid, signal.SIGKILL)
        shrunk = wait_for(
            lambda: len(_serving(job, survivor, 2)) == 2 and job.events("live_restored", round=2),
            30,
            "the smaller round",
        )
        assert _serving(job, survivor, 2) == kept, "the survivor's workers were restarted"
        assert {e["source"] for e in job.events("live_restored", round=2)} == {"memory"}
        assert {e["world_size"] for e in shrunk} == {2}
        recovered_s = (
            wait_for(lambda: [m["time"] for m in job.metrics() if m["world_size"] == 2], 30, "a step")[0] - lost_at
        )
        print(f"node loss -> first step at world size 2: {recovered_s:.2f}s")  # speed: bench/recovery.py

        job.restart(lost)  # the node comes back: it joins at the next committed checkpoint
        grown = wait_for(
            lambda: len(job.events("live_restored", round=3)) == 4 and job.events("live_restored", round=3),
            90,
            "round 3",
        )
        assert job.wait_exit(survivor) == 0 and job.wait_exit(lost) == 0, job.log_tail()
        assert _serving(job, survivor, 3) == kept
        assert {e["source"] for e in grown} == {"live_peer"} and {e["world_size"] for e in grown} == {4}
        assert [e["round"] for e in job.events("resume_started")] == [1] * 4, "storage was read after the start"
        _assert_bitwise_golden(tmp_path / "final.pt", golden)
    finally:
        job.close()


def test_without_a_warm_replacement_the_others_go_on_and_the_node_rejoins_once_warm(tmp_path, etcd, golden):
    """No spares: a killed worker's replacement is a cold process (seconds of imports). The other
    node does not wait for it: it trains on at world size 2; the node whose worker died keeps its
    survivor and rejoins, healed from its peers, once the new process is warm."""
    job = _cluster(tmp_path, etcd, step_sleep_s=0.25)  # the job must outlast the cold start
    try:
        for node in ("a", "b"):
            job.start(node, "--recovery", "live", "--spares", "0", nnodes="1:2", nproc=2)
        wait_for(lambda: len(job.events("live_restored", round=1)) == 4, 90, "both nodes in round 1")
        job.wait_step(20)
        other, failing = min(job.events("round_formed"), key=lambda e: e["new_round"])["members"]
        kept, before = _serving(job, other, 1), _serving(job, failing, 1)
        killed_at = time.time()
        os.kill(before[1], signal.SIGKILL)
        went_on = _restored_in_round_2(job, 2, 30, context=lambda: job.log_tail(6000))
        assert {e["world_size"] for e in went_on} == {2} and {e["source"] for e in went_on} == {"memory"}, went_on
        # a rank's worker_started follows its live_restored: wait for each of the other node's
        wait_for(lambda: len(_serving(job, other, 2)) == len(kept), 60, "the other node's workers in round 2")
        assert _serving(job, other, 2) == kept and not _serving(job, failing, 2)
        first_step = wait_for(
            lambda: [m["time"] for m in job.metrics() if m["time"] > killed_at and m["world_size"] == 2], 30, "a step"
        )[0]
        print(f"worker kill without a spare -> first step of the others at world size 2: {first_step - killed_at:.2f}s")

        back = wait_for(
            lambda: len(job.events("live_restored", round=3)) == 4 and job.events("live_restored", round=3),
            90,
            "round 3",
        )
        assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
        assert {e["world_size"] for e in back} == {4} and {e["source"] for e in back} == {"live_peer"}, back
        assert _serving(job, other, 3) == kept
        assert _serving(job, failing, 3)[0] == before[0], "the failing node's survivor was restarted"
        assert [e["round"] for e in job.events("resume_started")] == [1] * 4, "storage was read after the start"
        _assert_bitwise_golden(tmp_path / "final.pt", golden)
    finally:
        job.close()


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_paused_node_is_left_behind_and_its_zombies_neither_rejoin_the_old_round_nor_join_the_new(
    tmp_path, etcd, golden
):
    """A whole node frozen (agent, workers, spare: SIGSTOP) — the survivors are blocked in a
    collective with it, which gloo never fails. Its lease expires, the survivors' agent assigns a
    smaller round that interrupts the old one, and the round watchdog frees them at once (not at
    the process-group timeout); when the node is continued, its workers are
    zombies of round 1: nothing of round 2 comes from them, no commit of round 1 follows round 2,
    and the node comes back only through a new round, healed from its peers."""
    job = _cluster(tmp_path, etcd, step_sleep_s=0.25)
    try:
        _start(job, "a", "b")
        wait_for(lambda: len(job.events("live_restored", round=1)) == 4, 90, "both nodes in round 1")
        job.wait_step(25)
        first = min(job.events("round_formed"), key=lambda e: e["new_round"])
        survivor, paused = first["members"]
        kept, zombies = _serving(job, survivor, 1), _serving(job, paused, 1)
        frozen = [job.agents[paused].pid, *descendants(job.agents[paused].pid)]
        paused_at = time.time()
        _signal_all(frozen, signal.SIGSTOP)
        try:
            wait_for(lambda: [m for m in job.metrics() if m["world_size"] == 2 and m["time"] > paused_at], 40, "a step")
            recovered_s = min(m["time"] for m in job.metrics() if m["world_size"] == 2) - paused_at
        finally:
            _signal_all(frozen, signal.SIGCONT)
        print(f"node paused -> first step at world size 2: {recovered_s:.2f}s")  # speed: bench/recovery.py
        assert _serving(job, survivor, 2) == kept, "the survivor's workers were restarted"
        left = job.events("live_round_left", round=1)
        assert any("newer round was assigned" in e["why"] for e in left if e["pid"] in kept.values()), left
        assert job.wait_exit(survivor) == 0 and job.wait_exit(paused) == 0, job.log_tail()
        round2_formed = next(e["time"] for e in job.events("round_formed") if e["new_round"] == 2)
        zombie_pids = set(zombies.values())
        assert not [e for e in job.events() if e.get("pid") in zombie_pids and e.get("round") == 2]
        late = [e for e in job.events("ckpt_committed") if e["round"] == 1 and e["time"] > round2_formed]
        assert not late, f"round 1 committed after round 2 formed: {late}"
        rejoined = [e for e in job.events("live_restored") if e["round"] > 2 and e["world_size"] == 4]
        assert rejoined and {e["source"] for e in rejoined} == {"live_peer"}, rejoined
        _assert_bitwise_golden(tmp_path / "final.pt", golden)
    finally:
        job.close()


def _hang_and_recover(job: Cluster, worker_round: int, node: str, how: str) -> None:
    """Hang ``node``'s local rank 0 of ``worker_round`` (``how``: ``stopped`` or ``stuck``), then
    check that its node dumped and ended it, naming it, and that round ``worker_round + 1`` kept
    every other worker's process."""
    other = "a" if node == "b" else "b"
    before = {n: _serving(job, n, worker_round) for n in ("a", "b")}
    hung = before[node][0]
    hung_at = time.time()
    if how == "stopped":
        os.kill(hung, signal.SIGSTOP)
    else:
        job.requests_dir.mkdir(exist_ok=True)
        (job.requests_dir / str(hung)).write_text(STUCK)
    # the hung worker's node ends it (and dumps its stack) once the other node took its
    # workers' records, which it does on seeing the hang reported (a hang event of its own)
    hang = wait_for(
        lambda: [e for e in job.events("hang", node=node) if e["time"] > hung_at and str(hung) in e["stacks"]],
        30,
        f"node {node}'s hang event naming {hung}",
        context=job.log_tail,
    )[-1]
    if how == "stopped":
        assert "was stopped" in hang["stacks"][str(hung)], hang["stacks"]
    else:
        assert "after_update" in hang["stacks"][str(hung)], hang["stacks"]
    hung_rank = next(e["rank"] for e in job.events("worker_started", round=worker_round) if e["pid"] == hung)
    assert f"rank {hung_rank}" in hang["verdict"], hang["verdict"]
    new_round = worker_round + 1
    # every rank restored, and each one's worker_started (which follows its live_restored) seen
    wait_for(
        lambda: len(job.events("worker_started", round=new_round)) == 4, 60, f"round {new_round}", context=job.log_tail
    )
    after = {n: _serving(job, n, new_round) for n in ("a", "b")}
    assert after[other] == before[other], "the other node's workers were restarted"
    assert after[node][1] == before[node][1] and hung not in after[node].values(), (before, after)
    restored_at = max(e["time"] for e in job.events("live_restored", round=new_round))
    first_step = wait_for(
        lambda: [m["time"] for m in job.metrics() if m["time"] > restored_at], 60, f"a step of round {new_round}"
    )[0]
    print(f"{how}: hang -> first step of round {new_round}: {first_step - hung_at:.2f}s (hang_timeout_s 5)")
    print(f"verdict: {hang['verdict']}")


def test_a_hung_worker_is_dumped_and_killed_and_the_others_recover_in_process(tmp_path, etcd, golden):
    """Two hangs in one job; each time the hung worker's node dumps and ends it, naming it in the
    hang verdict, and everyone else goes on in-process. First node b's local rank 0 is frozen
    (SIGSTOP: it says nothing any more); later, in the round that recovered from that, node a's
    local rank 0 gets stuck: its training thread waits for good outside any collective
    (``FTRAIN_FAULT_REQUESTS_DIR``) while it stays alive and its peers wait for it in their next
    collective. (Was one test per kind of hang.)"""
    job = _cluster(tmp_path, etcd)
    try:
        job.start("a", *LIVE, nnodes="2:2", nproc=2)
        job.start("b", *LIVE, nnodes="2:2", nproc=2)
        job.wait_step(30)
        _hang_and_recover(job, 1, "b", "stopped")
        job.wait_step(50)  # the second hang lands well inside round 2
        _hang_and_recover(job, 2, "a", "stuck")
        assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
        rounds = sorted(job.events("round_formed"), key=lambda e: e["new_round"])
        assert [e["reason"] for e in rounds] == ["start", "hang", "hang"], rounds
        _assert_bitwise_golden(tmp_path / "final.pt", golden)
    finally:
        job.close()


def test_no_worker_or_spare_outlives_a_sigkilled_agent(tmp_path, etcd):
    job = _cluster(tmp_path, etcd)
    try:
        job.start("a", *LIVE, nnodes="1:1", nproc=2)
        job.wait_step(10)
        processes = descendants(job.agents["a"].pid)
        assert len(processes) >= 3, processes  # two serving, at least one spare
        job.kill_agent("a")
        job.wait_exit("a")
        wait_for(lambda: all(process_gone(p) for p in processes), 10, f"{processes} to exit after their agent")
    finally:
        job.close()


def test_under_fsdp_a_killed_worker_and_a_lost_node_heal_from_the_memory_tier_without_storage(
    tmp_path, etcd, seaweed, s3_prefix, golden_llama_fsdp
):
    """fsdp keeps no replica; the built-in Llama (RoPE, GQA, SwiGLU) trains on two nodes (2:2).
    First rank 0's worker is SIGKILLed: the spare that replaces it gets its shards from the copy
    its buddy on the other node keeps in memory (the memory tier), every survivor goes back to
    that snapshot in memory, and the other node's workers keep their processes. Later the other
    node (agent and workers) is SIGKILLed and restarted: the job needs both nodes, so it waits,
    then the new workers take their shards from the copies the surviving node keeps in memory,
    whose workers keep their processes. Neither recovery reads a shard from S3, no memory copy is
    refused, and the job ends bitwise equal to a fault-free run. (Folds what were three tests:
    the buddy heal of a killed worker and the healed lost node, each under the tiny model, and
    both faults under the Llama.)"""
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        job = _s3_cluster(tmp_path, etcd, seaweed, s3_prefix, proxy, *LLAMA)
        try:
            job.start("a", *LIVE, nnodes="2:2", nproc=2)
            job.start("b", *LIVE, nnodes="2:2", nproc=2)
            job.wait_step(30)
            _wait_tier_covers_commits(job, 4, 30)
            node, pid = _node_of(job, 0, 1)
            other = "b" if node == "a" else "a"
            kept = _serving(job, other, 1)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            restored = _restored_in_round_2(job, 4)
            assert {e["source"] for e in restored} == {"memory_tier"}, restored
            assert not _distcp_reads(proxy, killed_at, max(e["time"] for e in restored)), "the worker's heal read S3"
            # a rank's worker_started follows its live_restored: wait for each of the other node's
            serving = wait_for(
                lambda: len(_serving(job, other, 2)) == len(kept) and _serving(job, other, 2),
                60,
                "the other node's workers in round 2",
            )
            assert serving == kept, "the other node's workers were restarted"

            job.wait_step(70)
            _wait_tier_covers_commits(job, 4, 70)
            kept = _serving(job, node, 2)
            lost_at = time.time()
            _lose_and_bring_back(job, other, worker_round=2)

            def healed() -> list[dict] | None:
                rounds = [e["round"] for e in job.events("live_restored") if e["round"] > 2]
                newest = [e for e in job.events("live_restored") if rounds and e["round"] == max(rounds)]
                return newest if len(newest) == 4 else None

            restored = wait_for(healed, 120, "a round after the node loss with every rank restored")
            assert {e["source"] for e in restored} == {"memory_tier"}, restored
            assert not _distcp_reads(proxy, lost_at, max(e["time"] for e in restored)), "the node's heal read S3"
            assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
            assert _serving(job, node, restored[0]["round"]) == kept, "the survivor's workers were restarted"
            assert job.events("memory_snapshot") and not job.events("memory_refused"), job.events("memory_refused")
            _assert_bitwise_golden(tmp_path / "final.pt", golden_llama_fsdp)
        finally:
            job.close()
