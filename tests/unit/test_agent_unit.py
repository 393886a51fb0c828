"""The node agent assembled from in-memory parts and driven tick by tick on a fake clock: a
worker failure, a worker crash, a node loss, a join, the end of a job and a drain.

Every agent of a test shares one :class:`MemoryJobStore` (etcd's semantics: revisions, CAS,
leases; see tests/integration/test_jobstore_contract.py) and one :class:`FakeClock`; each has
its own heartbeat channel and a launcher whose workers are no processes: the test says what they
report and when they exit. Nothing sleeps: the clock moves by one tick between passes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import pytest

from ftrain.agents import agent_status
from ftrain.agents.agent import TICK_S, Agent
from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.heartbeat import Beat, RankTotals, carried
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.jobstore import JobStore
from ftrain.agents.leader import round_has_cause
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.records import (
    DRAINING,
    FAILED,
    NODE_LEFT,
    NODE_LOST,
    SCALE_UP,
    START,
    STOPPED,
    SUCCEEDED,
    WORKER_EXIT,
    YIELDED,
    JobState,
)
from ftrain.agents.supervision import left_ranks
from ftrain.agents.workers import Launch
from ftrain.chaos.cluster import FAST_AGENT_SETTINGS
from ftrain.contract import exits
from ftrain.contract.events import EventLog, read_jsonl
from tests.memory_jobstore import FakeClock, MemoryJobStore, MemorySession

JOB = "job"
KEYS = JobKeys(JOB)


class MemoryHeartbeats:
    """The agent's end of the heartbeat channel, fed by :class:`FakeWorkers` instead of a socket
    (the same rule as the real one: only beats of the current round are kept)."""

    def __init__(self, path: str):
        self.path = path
        self._round = -1
        self._beats: dict[int, Beat] = {}

    def reset(self, round_: int) -> None:
        self._round, self._beats = round_, {}

    def carry(self, beats: Mapping[int, Beat], now: float) -> None:
        for local_rank, beat in beats.items():
            self._beats.setdefault(local_rank, carried(beat, now))

    def beats(self) -> dict[int, Beat]:
        return dict(self._beats)

    def take_totals(self) -> dict[int, RankTotals]:
        totals = {lr: RankTotals(b.rank) for lr, b in self._beats.items() if b.phases_s}
        for lr, t in totals.items():
            t.add(self._beats[lr].phases_s, judged=True)
        return totals

    def receive(self, round_: int, beat: Beat) -> None:
        if round_ == self._round:
            self._beats[beat.local_rank] = beat

    def close(self) -> None:
        pass


class FakeWorkers:
    """One round's workers (one per local rank) as the test makes them behave."""

    def __init__(
        self,
        launch: Launch,
        env: dict[str, str],
        log_path: str,
        clock: FakeClock,
        heartbeats: MemoryHeartbeats,
        pid: int,
    ):
        self.launch, self.env, self.log_path = launch, env, log_path
        self.clock, self.heartbeats = clock, heartbeats
        self.started_at = clock.monotonic()
        self.terminating = False
        self.pid = pid
        self.rc: int | None = None
        self.killed = False
        self.crashed: set[int] = set()  #: local ranks whose process died without a word

    @property
    def round(self) -> int:
        return self.launch.round

    def worker_pid(self, local_rank: int) -> int:
        return self.pid + 1 + local_rank

    # -- what the agent calls -----------------------------------------------------------------
    def poll(self) -> int | None:
        return self.rc

    def note_pids(self, pids: Iterable[int]) -> None:
        pass

    def gone(self, pid: int) -> bool:
        return self.rc is not None or pid in {self.worker_pid(r) for r in self.crashed}

    def terminate(self) -> None:
        self.terminating = True

    def kill(self, timeout_s: float = 5.0) -> int | None:
        if self.rc is None:
            self.rc, self.killed = -9, True
        return self.rc

    def wait(self, timeout_s: float) -> int | None:
        return self.rc

    def dump_stacks(self, stack_dir: str) -> dict[int, str]:
        return {self.worker_pid(r): "File train.py, line 1, in step" for r in range(self.launch.nproc_per_node)}

    # -- what the test makes them do ------------------------------------------------------------
    def beat(self, step: int, *, committed_step: int = -1, step_time_s: float = 0.1, **fields: object) -> None:
        """Every local rank finished ``step`` (and knows ``committed_step`` is committed); a
        ``ftrain.Session`` loop's beats carry no step time (``step_time_s=0``)."""
        for r in range(self.launch.nproc_per_node):
            now = self.clock.monotonic()
            self.heartbeats.receive(
                self.round,
                Beat(
                    local_rank=r,
                    rank=r,
                    pid=self.worker_pid(r),
                    step=step,
                    step_time_s=step_time_s,
                    committed_step=committed_step,
                    received_at=now,
                    alive_at=now,
                    **fields,
                ),
            )  # type: ignore[arg-type]

    def fail(self, error: str, *, step: int) -> None:
        """Local rank 0 raises ``error`` at ``step``: its exit message, then torchrun exits 1."""
        self.beat(step, finished=False, error=error, phase="exiting")
        self.rc = 1

    def crash(self, local_rank: int = 0) -> None:
        """A worker is SIGKILLed: no exit message; torchrun has not noticed yet."""
        self.crashed.add(local_rank)

    def finish(self, step: int, rc: int = 0) -> None:
        """Training is over: every rank says it finished, torchrun exits ``rc`` (non-zero: a
        process crashed in its teardown, after its exit message)."""
        self.beat(step, committed_step=step, finished=True, phase="exiting")
        self.rc = rc

    def stop(self, step: int) -> None:
        """A graceful stop before the end (drain): every rank leaves unfinished, torchrun exits 0."""
        self.beat(step, committed_step=step, finished=False, phase="exiting")
        self.rc = 0


class Node:
    """One node: its agent and the parts a test reaches into."""

    def __init__(
        self,
        node_id: str,
        store: JobStore,
        clock: FakeClock,
        tmp_path: Path,
        pids: Iterator[int],
        **settings: object,
    ):
        run_dir = tmp_path / node_id
        run_dir.mkdir()
        self.node_id = node_id
        self.started: list[FakeWorkers] = []
        self.heartbeats = MemoryHeartbeats(str(run_dir / "hb.sock"))

        def launch(launch: Launch, env: dict[str, str], log_path: str) -> FakeWorkers:
            workers = FakeWorkers(launch, env, log_path, clock, self.heartbeats, next(pids))
            self.started.append(workers)
            return workers

        opts = AgentOptions.of(
            etcd=["http://etcd.invalid:2379"],
            job=JOB,
            node_id=node_id,
            worker_args=["cfg.toml"],
            **{**FAST_AGENT_SETTINGS, "recovery": "restart", **settings},
        )  # lease_ttl_s 2, settle_s 1, hang_timeout_s 5; the fake launcher is the restart path's
        self.agent = Agent(
            opts,
            store=store,
            clock=clock,
            heartbeats=self.heartbeats,
            metrics=AgentMetrics(JOB, node_id, clock=clock.monotonic),
            events=EventLog(str(tmp_path / "events.jsonl"), rank=-1),
            launcher=launch,
            run_dir=str(run_dir),
        )
        self.agent.start()
        self.alive = True
        self.closed = False

    @property
    def workers(self) -> FakeWorkers:
        """The workers of the newest round this node started."""
        assert self.started, f"{self.node_id} started no workers"
        return self.started[-1]

    def die(self) -> None:
        """SIGKILL: the agent stops ticking and its lease runs out; its workers die with it."""
        session = self.agent.session
        assert isinstance(session, MemorySession)
        session.halt()
        for workers in self.started:
            workers.kill()
        self.alive = False

    def close(self) -> None:
        """The agent's way out (kill workers, flush reports, revoke its lease), once."""
        if not self.closed:
            self.closed = True
            self.alive = False
            self.agent.close()


class Job:
    """The nodes of one job on one store and clock; ``stores`` (a real etcd's, say) gives each
    agent a store of its own (an agent closes its store on the way out) and the test one to read,
    in place of the one in-memory store they all share."""

    def __init__(self, tmp_path: Path, stores: Callable[[], JobStore] | None = None):
        self.tmp_path = tmp_path
        self.clock = FakeClock()
        self.store: JobStore = stores() if stores is not None else MemoryJobStore(self.clock)
        self._stores = stores or (lambda: self.store)
        self.nodes: dict[str, Node] = {}
        self._pids = itertools.count(10_000, 100)

    def join(self, node_id: str, **settings: object) -> Node:
        self.nodes[node_id] = node = Node(node_id, self._stores(), self.clock, self.tmp_path, self._pids, **settings)
        return node

    def state(self) -> JobState:
        listing = self.store.list_prefix(KEYS.prefix)
        return JobState.parse(KEYS, listing.kvs, listing.revision)

    def tick(self) -> None:
        """One pass of every live agent, then the clock moves one tick on."""
        for node in self.nodes.values():
            if node.alive and node.agent.exit_code is None:
                node.agent.tick()
        self.clock.advance(TICK_S)
        if isinstance(self.store, MemoryJobStore):  # etcd's leases run out on etcd's own clock
            self.store.expire_leases()

    def run_until(self, condition: Callable[[], object], what: str, *, within_s: float = 30.0) -> None:
        """Tick until ``condition()`` holds, failing after ``within_s`` of fake time."""
        for _ in range(int(within_s / TICK_S)):
            if condition():
                return
            self.tick()
        raise AssertionError(f"not within {within_s:.0f}s of fake time: {what}")

    def running(self, round_: int, *node_ids: str) -> bool:
        """Each of ``node_ids`` runs workers of ``round_``."""
        return all(
            self.nodes[n].started and self.nodes[n].workers.round == round_ and self.nodes[n].workers.rc is None
            for n in node_ids
        )

    def events(self, name: str, **match: object) -> list[dict]:
        return [
            e
            for e in read_jsonl(self.tmp_path / "events.jsonl")
            if e["event"] == name and all(e.get(k) == v for k, v in match.items())
        ]

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
        self.store.close()


def start_round_1(job: Job, *node_ids: str, **settings: object) -> None:
    """``node_ids`` join (the first is the oldest: leader and node rank 0) and run round 1."""
    for node_id in node_ids:
        job.join(node_id, **settings)
    job.run_until(lambda: job.running(1, *node_ids), f"round 1 running on {node_ids}")


def test_the_first_round_forms_after_settle_s_with_the_oldest_agent_as_leader_and_rank_0(job: Job) -> None:
    job.join("a", nnodes="2:2")
    job.tick()
    assert job.state().leader == "a" and job.state().round == 0  # alone: waits for a second node
    job.join("b", nnodes="2:2")
    joined_at = job.clock.monotonic()
    job.run_until(lambda: job.state().round == 1, "round 1 formed")
    assert job.clock.monotonic() - joined_at >= 1.0  # settle_s of quiet membership first
    record = job.state().current
    assert record is not None and record.reason == START and [m.node_id for m in record.members] == ["a", "b"]
    job.run_until(lambda: job.running(1, "a", "b"), "round 1 running")
    a, b = job.nodes["a"].workers.launch, job.nodes["b"].workers.launch
    assert (a.node_rank, b.node_rank, a.nnodes, b.nnodes) == (0, 1, 2, 2)
    assert (a.master_addr, a.master_port) == (b.master_addr, b.master_port)  # a's rendezvous, for both
    env = job.nodes["b"].workers.env
    assert env["FTRAIN_ROUND"] == "1" and env["FTRAIN_NODE"] == "b" and env["FTRAIN_FENCE_KEY"] == KEYS.round
    assert env["FTRAIN_HEARTBEAT"] == job.nodes["b"].heartbeats.path
    assert job.state().started[1] == {"a", "b"}


def test_a_worker_failure_is_reported_and_both_nodes_restart_in_a_new_round(job: Job) -> None:
    start_round_1(job, "a", "b", nnodes="2:2")
    first_a, first_b = job.nodes["a"].workers, job.nodes["b"].workers
    first_a.beat(7, committed_step=5)
    first_b.fail("ValueError: bad batch", step=7)
    job.run_until(lambda: job.running(2, "a", "b"), "round 2 running on both")

    report = job.state().reports[1]["b"]
    assert (report.outcome, report.reason, report.step) == (FAILED, WORKER_EXIT, 7)
    assert report.error == "ValueError: bad batch"
    record = job.state().current
    assert record is not None and record.reason == WORKER_EXIT and len(record.failure_times) == 1
    assert record.restarts_by_cause == {WORKER_EXIT: 1}
    assert first_a.killed and not first_b.killed  # a's healthy workers were stopped for the new round
    assert job.events("workers_exited", node="b", worker_round=1, outcome=FAILED)
    assert job.events("workers_stopped", node="a", worker_round=1)
    assert [e["reason"] for e in job.events("round_formed")] == [START, WORKER_EXIT]


def test_a_worker_killed_without_a_word_is_noticed_before_torchrun_exits(job: Job) -> None:
    start_round_1(job, "a", nnodes="1:1")
    workers = job.nodes["a"].workers
    workers.beat(3)
    workers.crash(local_rank=0)
    job.run_until(lambda: job.running(2, "a"), "round 2 after the crash")
    assert workers.killed  # the agent killed torchrun rather than wait for it
    report = job.state().reports[1]["a"]
    assert report.outcome == FAILED and report.reason == WORKER_EXIT and report.step == 3
    assert "torchrun exited with -9" in report.detail  # torchrun as the agent killed it


def test_losing_the_leader_node_moves_leadership_and_rank_0_to_the_survivor(job: Job) -> None:
    start_round_1(job, "a", "b", nnodes="1:2")
    survivor_round_1 = job.nodes["b"].workers
    job.nodes["a"].die()
    died_at = job.clock.monotonic()
    job.run_until(lambda: job.running(2, "b"), "round 2 running on b")

    state = job.state()
    assert state.leader == "b" and "a" not in state.nodes
    record = state.current
    assert record is not None and record.reason == NODE_LOST and [m.node_id for m in record.members] == ["b"]
    assert record.failure_times == []  # a lost node is no failure of the job
    assert job.clock.monotonic() - died_at >= 2.0  # not before the lease ran out
    assert survivor_round_1.killed
    launch = job.nodes["b"].workers.launch
    assert (launch.node_rank, launch.nnodes) == (0, 1)
    assert job.events("leader_elected", node="b")


def test_a_node_that_joins_enters_at_the_next_committed_checkpoint(job: Job) -> None:
    start_round_1(job, "a", nnodes="1:2")
    job.nodes["a"].workers.beat(12, committed_step=10)
    job.join("c", nnodes="1:2")
    job.run_until(
        lambda: (s := job.state().status.get("a")) and s.updated_at >= job.state().nodes["c"].registered_at,
        "a's status written after c joined",
    )
    for _ in range(int(30 / TICK_S)):  # no new checkpoint: c waits, however long
        job.tick()
        job.nodes["a"].workers.beat(12, committed_step=10)
    assert job.state().round == 1 and not job.nodes["c"].started

    job.nodes["a"].workers.beat(21, committed_step=20)
    job.run_until(lambda: job.running(2, "a", "c"), "round 2 running on a and c")
    record = job.state().current
    assert record is not None and record.reason == SCALE_UP and [m.node_id for m in record.members] == ["a", "c"]
    launches = [job.nodes[n].workers.launch for n in ("a", "c")]
    assert [(x.node_rank, x.nnodes) for x in launches] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("b_exit_code", [0, -6], ids=["clean", "abort-at-teardown"])
def test_every_node_finishing_ends_the_job_with_exit_code_0(job: Job, b_exit_code: int) -> None:
    """Node b's workers all said they finished; with -6 one then aborted in its interpreter's
    teardown (gloo's threads on CPU): the run is done all the same, nothing to restart."""
    start_round_1(job, "a", "b", nnodes="2:2")
    job.nodes["a"].workers.finish(step=100)
    job.nodes["b"].workers.finish(step=100, rc=b_exit_code)
    job.run_until(lambda: all(n.agent.exit_code is not None for n in job.nodes.values()), "both agents done")
    final = job.state().final
    assert final is not None and final.status == SUCCEEDED and final.round == 1
    assert [n.agent.exit_code for n in job.nodes.values()] == [exits.OK, exits.OK]
    assert job.state().status["b"].state == "done"
    assert len(job.nodes["b"].started) == 1  # no second round was launched


def test_a_drained_node_leaves_and_the_others_continue_without_it(job: Job) -> None:
    start_round_1(job, "a", "b", nnodes="1:2")
    b = job.nodes["b"]
    b.agent.drain("test")
    job.tick()
    assert b.workers.terminating  # asked to finish the step and save
    b.workers.stop(step=40)  # they did, and exited 0 before the end of training
    job.nodes["a"].workers.stop(step=40)  # a's too: the ranks agree to stop together
    job.run_until(lambda: b.agent.exit_code is not None, "b drained")
    assert b.agent.exit_code == exits.DRAINED
    assert job.state().reports[1]["b"].outcome == STOPPED
    job.run_until(lambda: "a" in job.state().reports.get(1, {}), "a's report")
    assert job.state().reports[1]["a"].outcome == YIELDED  # stopped for b's drain: a stays
    b.close()  # the process exits: its lease is revoked
    job.run_until(lambda: job.running(2, "a"), "round 2 on a alone")
    record = job.state().current
    assert record is not None and record.reason == NODE_LEFT and [m.node_id for m in record.members] == ["a"]
    assert record.failure_times == []  # a drain is no failure


def test_a_draining_leader_forms_the_next_round_without_itself(job: Job) -> None:
    start_round_1(job, "a", "b", nnodes="1:2")
    a, b = job.nodes["a"], job.nodes["b"]
    a.agent.drain("test")  # a leads; its workers are asked to stop but take their time
    job.tick()
    assert a.workers.terminating
    b.workers.fail("RuntimeError: boom", step=12)
    job.run_until(lambda: job.state().round >= 2, "round 2")
    record = job.state().current
    assert record is not None and [m.node_id for m in record.members] == ["b"], record


def test_a_drain_that_times_out_still_reports_the_node_left(job: Job) -> None:
    start_round_1(job, "a", "b", nnodes="1:2", drain_timeout_s=3.0)
    b = job.nodes["b"]
    b.agent.drain("test")
    job.tick()
    assert b.workers.terminating  # and they never stop: the drain's deadline kills them
    job.run_until(lambda: b.agent.exit_code is not None, "b drained", within_s=10)
    assert b.agent.exit_code == exits.DRAINED
    assert job.state().reports[1]["b"].outcome == STOPPED  # a departure, not a node loss
    b.close()
    job.nodes["a"].workers.stop(step=40)  # a's ranks lost their peer
    job.run_until(lambda: job.running(2, "a"), "round 2 on a alone")
    record = job.state().current
    assert record is not None and record.reason == NODE_LEFT, record


@pytest.mark.parametrize(
    ("nnodes", "nproc", "degrees", "refused"),
    [
        ("1:1", 1, (2,), "a multiple of 2 ranks"),
        ("1:2", 1, (2,), "or use --nnodes 2:2"),  # its minimum can never run: refused, naming the fix
        ("1:3", 1, (2,), "or use --nnodes 2:3"),
        ("1:2", 1, (2, 1), ""),  # a fallback runs one node alone
        ("2:2", 1, (2,), ""),
        ("1:1", 2, (2,), ""),
    ],
)
def test_an_agent_whose_node_counts_give_no_usable_world_size_is_refused_at_start(nnodes, nproc, degrees, refused):
    """A pipeline of 2 stages needs an even rank count: one node of one worker can never run it,
    so a node range whose minimum is one such node is refused at start (a round of it would be
    formed after a node loss and stall), naming --nnodes, the layout and the fallback."""
    opts = AgentOptions.of(
        etcd=["http://etcd.invalid:2379"],
        job=JOB,
        node_id="a",
        worker_args=["cfg.toml"],
        nnodes=nnodes,
        nproc_per_node=nproc,
        pipeline_degrees=degrees,
    )
    if not refused:
        opts.validate()
        return
    with pytest.raises(ValueError, match=refused) as e:
        opts.validate()
    assert "--nnodes" in str(e.value) and "parallel.pp_size" in str(e.value)
    assert "pp_fallback" in str(e.value)


def _rank_beat(workers: FakeWorkers, *, stepped_at: float, in_flight_since: float | None = None) -> None:
    """Local rank 0 of ``workers`` (global rank: its node rank) stepped at ``stepped_at`` and says
    alive now, waiting since ``in_flight_since`` in collective #12 (None: in none)."""
    now = workers.clock.monotonic()
    waiting = in_flight_since is not None
    workers.heartbeats.receive(
        workers.round,
        Beat(
            local_rank=0,
            rank=workers.launch.node_rank,
            pid=workers.worker_pid(0),
            step=7,
            step_time_s=0.1,
            committed_step=-1,
            received_at=stepped_at,
            alive_at=now,
            recording=True,
            in_flight_since=in_flight_since or 0.0,
            in_flight_seq=12 if waiting else -1,
            in_flight_group="0" if waiting else "",
            in_flight="gloo:all_reduce [1] Float" if waiting else "",
        ),
    )


def test_a_hang_found_on_one_node_keeps_its_workers_until_every_other_node_took_its_records(job: Job) -> None:
    """b's worker goes silent (frozen); a's waits in a collective, entered a second later. b
    reports the hang at once but ends its workers only after a took its own workers' flight
    records (ending them first makes a's collective fail, and a failed collective looks
    completed in torch's recorder); a takes them on seeing b's report."""
    start_round_1(job, "a", "b", nnodes="2:2")
    a, b = job.nodes["a"], job.nodes["b"]
    t0 = job.clock.monotonic()
    _rank_beat(b.workers, stepped_at=t0)  # its last word
    order: list[str] = []
    for _ in range(int(20 / TICK_S)):
        now = job.clock.monotonic()
        if now >= t0 + 1:
            _rank_beat(a.workers, stepped_at=t0 + 1, in_flight_since=t0 + 1)
        else:
            _rank_beat(a.workers, stepped_at=now)
        job.tick()
        reports = job.state().reports.get(1, {})
        if "b" in reports and not order:
            order.append("b reported")
            assert not b.workers.killed, "b ended its workers before the others took their records"
        if job.state().status["a"].hang_dumped_round == 1 and "a dumped" not in order:
            order.append("a dumped")
        if b.started[0].killed and "b killed" not in order:
            order.append("b killed")
            break
    assert order == ["b reported", "a dumped", "b killed"], order
    assert "a" not in job.state().reports.get(1, {}), "a's worker only waited: b found the hang"
    report = job.state().reports[1]["b"]
    assert report.reason == "hang" and "no heartbeat" in report.detail
    [found] = job.events("hang", node="b", worker_round=1)
    assert found["frozen"] == [1] and found["local_ranks"] == [0]
    [seen] = job.events("hang", node="a", worker_round=1)
    assert seen["why"] == "a hang reported by b" and seen["time"] <= found["time"]  # b's stacks came after
    assert found["verdict"].startswith("rank 1 (node b, host 127.0.0.1) is frozen"), found["verdict"]
    job.run_until(lambda: job.running(2, "a", "b"), "round 2 running on both")
    assert job.state().current.reason == "hang"


@pytest.mark.parametrize("gap_s", [0.1, 0.3, 0.4, 1.0])
def test_a_hang_dumped_for_another_members_report_is_not_found_again_here(job: Job, gap_s: float) -> None:
    """Restart recovery: b's worker goes silent, a's waits in a collective from ``gap_s`` later.
    However close a's own timeout comes after b's report (0.3 and 0.4 s: between a's dump for b's
    report and the next round), a dumps that round once: a second dump, once the round moved on,
    caught workers on their way out (stacks without the training loop in them: stop 57's CI)."""
    start_round_1(job, "a", "b", nnodes="2:2")
    a, b = job.nodes["a"], job.nodes["b"]
    t0 = job.clock.monotonic()
    _rank_beat(b.workers, stepped_at=t0)
    for _ in range(int(30 / TICK_S)):
        now = job.clock.monotonic()
        if now >= t0 + gap_s:
            _rank_beat(a.workers, stepped_at=t0 + gap_s, in_flight_since=t0 + gap_s)
        else:
            _rank_beat(a.workers, stepped_at=now)
        job.tick()
        if job.running(2, "a", "b"):
            break
    assert job.running(2, "a", "b") and job.state().current.reason == "hang"
    assert len(job.events("hang", node="a", worker_round=1)) == 1, job.events("hang", node="a")


def test_followers_follow_the_member_keys_only_and_the_leader_every_nodes_status(job: Job) -> None:
    start_round_1(job, "a", "b", "c", nnodes="3:3")
    leader, followers = job.nodes["a"].agent, [job.nodes[n].agent for n in ("b", "c")]
    job.run_until(lambda: set(leader.view.snapshot().status) == {"a", "b", "c"}, "the leader to see every status")
    assert leader.view.following_leader_keys and leader.view.snapshot().started[1] == {"a", "b", "c"}
    for agent in followers:
        state = agent.view.snapshot()
        assert not agent.view.following_leader_keys
        assert state.status == {} and state.started == {} and state.reports == {}
        assert set(state.nodes) == {"a", "b", "c"} and state.current == job.state().current


def test_a_status_goes_out_at_once_when_it_changes_and_otherwise_at_the_rate_the_job_size_allows(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert agent_status.status_interval_s(16) == 1.0 and agent_status.status_interval_s(1024) == pytest.approx(10.24)
    monkeypatch.setattr(agent_status, "STATUS_WRITES_PER_S", 0.5)  # 2 nodes: a routine status every 4 s
    start_round_1(job, "a", "b", nnodes="2:2")
    workers = job.nodes["b"].workers

    def writes() -> int:
        kv = job.store.get(KEYS.status("b"))
        return kv.version if kv else 0

    job.run_until(lambda: job.state().status["b"].state == "running", "b's status says running")
    before = writes()
    for step in range(40):  # 8 s of steps, nothing else changing
        workers.beat(step)
        job.tick()
    assert 1 <= writes() - before <= 3, "only steps changed: about one write per 4 s"
    before = writes()
    workers.beat(41, committed_step=40)  # a commit is news: out within a second
    job.run_until(lambda: job.state().status["b"].committed_step == 40, "the commit in b's status", within_s=1.2)
    assert writes() == before + 1


@pytest.mark.parametrize("held_by", [b"[" * 100_000, b"\xff\xfe not utf-8"], ids=["deep", "bytes"])
def test_a_node_id_held_by_a_hostile_value_is_refused_by_name_never_a_crash(job: Job, held_by: bytes):
    """``nodes/<id>`` held by another lease with a value nested 100,000 deep (RecursionError out
    of json.loads) or bytes that are not UTF-8 (UnicodeDecodeError in the message) ended the
    agent with a traceback; it is someone else's key: NodeIdTakenError names it."""
    from ftrain.agents.errors import NodeIdTakenError

    other = job.store.session(60, on_lost=lambda why: None)
    job.store.put(KEYS.node("a"), held_by, lease=other.lease_id)
    with pytest.raises(NodeIdTakenError, match="node id 'a' is already registered"):
        job.join("a")


def test_a_round_has_a_cause_once_a_member_drains_or_reports_and_a_left_rank_waits_only_without_one(job: Job) -> None:
    """What an agent whose live rank left the round on its own waits for before it reports the
    round over itself (``rank_left``): a cause the leader acts on. A carried beat (a kept
    process not heard from in the new round yet) is not a rank that left."""
    start_round_1(job, "a", "b", "c", nnodes="1:3")
    assert not round_has_cause(job.state(), 1)  # all live, nobody reported or drains
    assert round_has_cause(job.state(), 0)  # not the current round: a newer one formed
    job.nodes["c"].agent.drain("test")  # its workers are asked to stop, and take their time
    job.run_until(lambda: job.state().status["c"].state == DRAINING, "c's drain in its status")
    assert job.state().round == 1 and round_has_cause(job.state(), 1)
    job.nodes["c"].workers.stop(step=12)
    job.run_until(lambda: job.running(2, "a", "b"), "round 2 without c")
    assert not round_has_cause(job.state(), 2)
    job.nodes["b"].workers.fail("RuntimeError: boom", step=20)
    job.run_until(lambda: job.state().member_reports(2), "b's report")
    assert round_has_cause(job.state(), 2)
    now = job.clock.monotonic()
    beat = Beat(0, 0, 1, step=5, step_time_s=0.1, committed_step=-1, received_at=now - 11, phase="recovering")
    assert left_ranks({0: beat}, now=now, grace_s=10) == [0]
    assert left_ranks({0: beat}, now=now, grace_s=12) == []  # within the grace
    assert left_ranks({0: carried(beat, now - 11)}, now=now, grace_s=10) == []  # kept, not heard from yet
    assert left_ranks({0: dataclasses.replace(beat, phase="training")}, now=now, grace_s=10) == []
