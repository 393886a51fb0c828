"""ftrain.Session and ftrain.ResumableSampler in one process (a group of one, as when nothing
launched the loop): a save and a load give back model, optimizer, scheduler and sampler; misuse
gets errors that name the fix. The launched, multi-rank form: tests/integration/test_own_loop.py."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

import ftrain
from ftrain.session import SessionError

pytestmark = pytest.mark.usefixtures("alone")  # tests/unit/conftest.py: no launcher's variables, no group left


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 5))
    return {"model": model, "optim": optim, "sched": sched, "sampler": ftrain.ResumableSampler(100, 10, seed=3)}


def _train(state: dict, steps: int) -> None:
    model, optim, sched, sampler = state["model"], state["optim"], state["sched"], state["sampler"]
    data = torch.randn(100, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        batch = data[sampler.advance(0, 1)]
        model(batch).pow(2).mean().backward()
        optim.step()
        sched.step()
        optim.zero_grad()


def test_a_saved_step_loads_back_into_every_part_of_the_state(tmp_path):
    with ftrain.Session(str(tmp_path / "ckpt"), interval_steps=3) as session:
        state = _state()
        assert session.load(state) == 0 and (session.rank, session.world_size) == (0, 1)
        for step in range(1, 7):
            _train(state, 1)
            session.step(step, state)
        status = session.finish(6, state)
        assert status.last_committed_step == 6
        saved = {k: v.clone() for k, v in state["model"].state_dict().items()}
        moments = state["optim"].state_dict()["state"][0]["exp_avg"].clone()
        manifests = sorted(p.parent.name for p in (tmp_path / "ckpt").glob("step-*/manifest.json"))
        assert manifests == ["step-000000003", "step-000000006"]

    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        fresh = _state(seed=1)  # other weights: the load must replace them
        assert session.load(fresh) == 6
        for key, value in fresh["model"].state_dict().items():
            assert torch.equal(value, saved[key]), key
        assert torch.equal(fresh["optim"].state_dict()["state"][0]["exp_avg"], moments)
        assert fresh["sched"].last_epoch == 6 and fresh["sampler"].step == 6
        # the order goes on where it stopped: the next batch is the one a straight run takes next
        straight = ftrain.ResumableSampler(100, 10, seed=3)
        for _ in range(6):
            straight.advance(0, 1)
        assert fresh["sampler"].advance(0, 1) == straight.advance(0, 1)


def test_misuse_is_refused_with_the_fix(tmp_path):
    session = ftrain.Session(str(tmp_path / "ckpt"))
    with pytest.raises(SessionError, match=r"before Session.start\(\)"):
        session.save(1, _state())
    session.start()
    try:
        with pytest.raises(SessionError, match=r"'counter' \(int\) has no state_dict"):
            session.save(1, {**_state(), "counter": 3})
        with pytest.raises(SessionError, match="two modules"):
            session.save(1, {**_state(), "other": torch.nn.Linear(2, 2)})
        with pytest.raises(SessionError, match=r"optimizers 'optim' and 'sgd' update the same parameter"):
            state = _state()
            session.save(1, {**state, "sgd": torch.optim.SGD(state["model"][0].parameters(), lr=0.1)})
        with pytest.raises(SessionError, match="an optimizer but no module"):
            state = _state()
            session.save(1, {"optim": state["optim"]})

        class Opaque:
            def state_dict(self):
                return {"tensor": torch.zeros(2)}

            def load_state_dict(self, state):
                pass

        with pytest.raises(SessionError, match=r"'opaque' \(Opaque\).*\['tensor'\]: torch.Tensor values cannot"):
            session.save(1, {**_state(), "opaque": Opaque()})
        with pytest.raises(SessionError, match="already started"):
            session.start()
    finally:
        session.close()
    with pytest.raises(SessionError, match="interval_steps"):
        ftrain.Session(str(tmp_path), interval_steps=-1)
    for bad in (-2, True, 1.5):
        with pytest.raises(SessionError, match=r"memory_interval=.*an int >= -1"):
            ftrain.Session(str(tmp_path), memory_interval=bad)  # type: ignore[arg-type]
    with pytest.raises(SessionError, match=r"replica_check_steps=-1\): an int >= 0"):
        ftrain.Session(str(tmp_path), replica_check_steps=-1)
    with pytest.raises(SessionError, match=r"on_replica_mismatch='retry'\): one of warn, halt, rollback"):
        ftrain.Session(str(tmp_path), on_replica_mismatch="retry")


def test_run_outside_an_agent_is_one_round_that_ends_with_the_session(tmp_path):
    session = ftrain.Session(str(tmp_path / "ckpt"))

    def train(s: ftrain.Session) -> int:
        state = _state()
        start = s.load(state)
        _train(state, 2)
        s.finish(start + 2, state)
        return start + 2

    assert session.run(train) == 2 and not session.started and session.restored.source == "fresh"
    assert ftrain.Session(str(tmp_path / "ckpt")).run(train) == 4  # the next run goes on from step 2

    def broken(s: ftrain.Session) -> None:
        raise ValueError("a bug in the loop")

    failing = ftrain.Session(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="a bug in the loop"):
        failing.run(broken)
    assert not failing.started
    with pytest.raises(SessionError, match=r"started already; run\(\) starts it"):
        with ftrain.Session(str(tmp_path / "ckpt")) as started:
            started.run(train)


def test_a_live_agents_worker_must_run_its_loop_in_session_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FTRAIN_CONTROL", str(tmp_path / "control.json"))
    with pytest.raises(SessionError, match=r"--recovery live.*session.run\(train\)"):
        ftrain.Session(str(tmp_path / "ckpt")).start()


def test_what_a_rank_holds_is_its_last_boundary_unless_an_optimizer_stepped_since():
    from ftrain.session_live import BoundaryWatch
    from ftrain.session_state import StateParts

    state, watch = {**_state(), "rng": ftrain.RNGState()}, BoundaryWatch()
    _train(state, 1)
    watch.mark(1, StateParts.of(state), {"sampler": state["sampler"].state_dict()})
    held = watch.held(committed_step=0)
    assert held is not None and held.complete and held.step == 1
    assert held.cursor == {"sampler": state["sampler"].state_dict()} and held.model is not None
    rng_then = held.own["rng"]  # the rank's own entries at the boundary, kept whatever moves after
    torch.rand(3)
    state["model"](torch.randn(2, 8)).sum().backward()  # a round ending here (a backward's collective) keeps step 1
    assert watch.held(0).complete
    state["optim"].step()  # ending after the update: the objects are past step 1, none is offered
    past = watch.held(0)
    assert past.step == 1 and not past.complete and past.own == {"rng": rng_then}
    assert "own" not in past.payload()  # never sent to a peer
    watch.release()
    assert watch.held(0) is None and not state["optim"]._optimizer_step_post_hooks


def test_a_rank_the_launcher_did_not_give_is_refused(tmp_path, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SessionError, match=r"RANK=1 WORLD_SIZE=2.*rank 0 of 1"):
        ftrain.Session(str(tmp_path)).start()


def test_a_step_missing_a_part_of_the_state_is_not_loaded_into_it(tmp_path, monkeypatch):
    """... and the job's event log hears of each save and load as from ftrain train's."""
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("FTRAIN_EVENTS", str(log))
    with ftrain.Session(str(tmp_path / "ckpt"), on_no_loadable_step="fail") as session:
        state = _state()
        session.finish(2, {"model": state["model"], "optim": state["optim"]})
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        with pytest.raises(SessionError, match="holds no 'sampler', 'sched'"):
            session.load(_state())
        state = _state()
        assert session.load({"model": state["model"], "optim": state["optim"]}) == 2  # still a good step
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-*/manifest.json")).read_text())
    assert manifest["layout"]["writer"] == "session"
    assert not list((tmp_path / "ckpt").rglob("corrupt.json")), "a step of another shape was marked corrupt"
    said = [json.loads(line) for line in log.read_text().splitlines()]
    names = [e["event"] for e in said if e["event"].startswith(("resume", "ckpt_"))]
    assert names == [
        "ckpt_committed",  # the first session's (synchronous) save
        *["resume_started", "resume_failed"],  # the state of another shape
        *["resume_started", "ckpt_loaded", "resumed"],
    ], names
    failed, loaded, resumed = (
        next(e for e in said if e["event"] == n) for n in ("resume_failed", "ckpt_loaded", "resumed")
    )
    assert "holds no 'sampler', 'sched'" in failed["refused"][0]
    assert loaded["step"] == resumed["step"] == 2 and resumed["from_world_size"] == resumed["world_size"] == 1


@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_the_sampler_gives_each_rank_its_share_of_the_same_global_batches_at_any_world_size(world):
    one = ftrain.ResumableSampler(50, 20, seed=7)
    many = ftrain.ResumableSampler(50, 20, seed=7)
    for _ in range(5):  # past an epoch's end: 50 samples, batches of 20
        whole = one.advance(0, 1)
        shares = []
        for rank in range(world):
            probe = ftrain.ResumableSampler(50, 20, seed=7)
            probe.load_state_dict(many.state_dict())
            shares += probe.advance(rank, world)
        many.advance(0, world)
        assert shares == whole
    with pytest.raises(ValueError, match="does not divide by world size 3"):
        next(one.batches(0, 3))


def test_a_live_rank_waits_for_the_next_round_as_long_as_its_agent_lives(tmp_path, monkeypatch):
    """Between rounds a rank keeps what it holds while the leader cannot form the next round
    (a node short, say): it used to give up after the session's timeout (AssignmentTimeout),
    exiting with the state it held. Its agent's death is what ends it (the heartbeat watchdog)."""
    import threading

    from ftrain.contract.control import Assignment, ControlFile
    from ftrain.recovery.round_control import RoundEnded
    from ftrain.testbed.etcd import free_ports
    from ftrain.testbed.wait import wait_for

    control = ControlFile(str(tmp_path / "control.json"))
    monkeypatch.setenv("FTRAIN_CONTROL", control.path)
    ports = free_ports(2)
    rounds: list[int] = []

    def assignment(round_: int) -> Assignment:
        return Assignment(
            round=round_, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, nnodes=1,
            master_addr="127.0.0.1", master_port=ports[round_ - 1],
        )  # fmt: skip

    def train(s: ftrain.Session) -> int:
        rounds.append(s.round)
        state = _state()
        start = s.load(state)
        _train(state, 1)
        s.step(start + 1, state)
        if s.round == 1:
            raise RoundEnded("the round lost a member")  # as a failed collective would end it
        return start + 1

    session = ftrain.Session(str(tmp_path / "ckpt"), timeout_s=0.2)

    def agent() -> None:
        control.write(assignment(1))
        wait_for(lambda: rounds == [1] and session._round is None, 60, "round 1 trained and its rank left it")
        time.sleep(1.0)  # the session's timeout is 0.2 s: the next round comes five timeouts later
        control.write(assignment(2))

    writer = threading.Thread(target=agent, daemon=True)
    writer.start()
    assert session.run(train) == 2
    assert rounds == [1, 2] and session.restored.source == "memory" and session.restored.step == 1
    writer.join(timeout=10)


def test_an_event_log_that_cannot_be_opened_costs_the_events_not_the_run(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FTRAIN_EVENTS", str(tmp_path / "a-file" / "events.jsonl"))  # under a file: no directory
    with ftrain.Session(str(tmp_path / "ckpt"), verbose=False) as session:
        state = _state()
        _train(state, 2)
        session.finish(2, state)
    assert "event log" in caplog.text and "a-file" in caplog.text, caplog.text
    assert (tmp_path / "ckpt").exists()


def test_each_step_beat_says_its_interval_the_part_spent_staging_and_the_wait_for_peers(tmp_path, monkeypatch):
    """The agent accounts a user's loop as it does ftrain train's (goodput, checkpoint stalls,
    stragglers): each step's beat carries the wall time since the previous step, the part of it
    spent in the session's saves, and the part from backward's last gradient to the optimizer's
    update (where DDP's ranks wait for each other's gradients); the first step of a process has
    none (its start-up). ``metrics_path``: the same in metrics lines, with the loop's numbers."""
    import socket

    from ftrain.contract.heartbeat import Message
    from ftrain.contract.worker_env import HEARTBEAT

    path = str(tmp_path / "hb.sock")
    agent_end = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent_end.bind(path)
    agent_end.settimeout(5.0)
    monkeypatch.setenv(HEARTBEAT, path)
    lines = tmp_path / "run" / "metrics.jsonl"
    options = dict(interval_steps=2, async_save=False, verbose=False, metrics_path=str(lines))
    try:
        with ftrain.Session(str(tmp_path / "ckpt"), **options) as session:
            state = _state()
            session.load(state)
            model, optim, data = state["model"], state["optim"], torch.randn(4, 8)
            for step in range(1, 5):
                loss = model(data).pow(2).mean()
                loss.backward()
                time.sleep(0.05)  # stands for the gradient all-reduce waiting for a slower peer
                optim.step()
                optim.zero_grad()
                session.step(step, state, metrics={"loss": loss.detach(), "tokens_per_s": 100 * step})
            for wrong in ({"step": 1.0}, {"loss": "low"}, {3: 1.0}, {"loss": torch.ones(2)}):
                with pytest.raises(SessionError, match=r"Session.step\(metrics=...\)"):
                    session.step(4, state, metrics=wrong)
            session.finish(4, state)
        beats = []
        agent_end.settimeout(0.5)
        while True:
            try:
                message = Message.decode(agent_end.recv(65536))
            except TimeoutError:
                break
            if message.kind == "beat" and message.phase == "training" and message.step >= 1:
                beats.append(message)
    finally:
        agent_end.close()
    by_step = {b.step: b for b in beats if b.step_time_s > 0 or b.step == 1}
    assert sorted(by_step) == [1, 2, 3, 4], [(b.step, b.step_time_s, b.phases_s) for b in beats]
    assert by_step[1].step_time_s == 0.0 and by_step[1].phases_s == {}
    for step in (2, 3, 4):
        b = by_step[step]
        assert set(b.phases_s) == {"other", "ckpt_staging", "comm_wait"}
        assert abs(sum(b.phases_s.values()) - b.step_time_s) < 1e-6
        assert b.phases_s["comm_wait"] >= 0.05, (step, b.phases_s)  # the hooks are set at step 1's step()
    # step 2 was saved (synchronously) at its boundary: step 3's interval holds that save
    assert by_step[3].phases_s["ckpt_staging"] > 0.0
    assert by_step[3].phases_s["ckpt_staging"] > by_step[2].phases_s["ckpt_staging"]
    # the metrics lines say what the beats said, with the loop's numbers: ftrain report's steps and curves
    from ftrain.observability.run_report import build, collect

    written = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [m["step"] for m in written] == [1, 2, 3, 4], written  # a refused call writes nothing
    for m in written[1:]:
        assert m["phases_s"] == pytest.approx(by_step[m["step"]].phases_s) and m["world_size"] == 1
    report = build(*collect(tmp_path / "run")[:2])
    assert [s["tokens_per_s"] for s in report["steps"]] == [100.0, 200.0, 300.0, 400.0]
    assert all(s["loss"] > 0 for s in report["steps"]) and report["accounting"]["source"] == "metrics"
    assert all("rank_busy_s" not in m for m in written)  # no step boundary's agreement without run()


def test_the_step_boundary_carries_every_ranks_times_in_its_own_slots():
    """Under run() each rank brings its flags and its step's busy and waiting seconds to one MAX
    all-reduce; what comes back holds any rank's flags and every rank's times in rank order."""
    from ftrain.session_timing import boundary_values, read_boundary

    timings = [{"step_time_s": 1.0 + r, "phases_s": {"other": 0.5, "comm_wait": 0.5 + r / 10}} for r in range(3)]
    brought = [boundary_values((r == 2, False), t, r, 3) for r, t in enumerate(timings)]
    newer, stop, (busy, waits) = read_boundary(torch.stack(brought).max(dim=0).values.tolist(), 3)
    assert (newer, stop) == (True, False)
    assert busy == pytest.approx([0.5, 1.4, 2.3]) and waits == pytest.approx([0.5, 0.6, 0.7])


def test_a_loop_whose_ranks_hold_different_plain_parameters_says_so_and_they_are_never_offered_as_replicas(tmp_path):
    """Pipeline stages hold plain parameters, different on each stage: ``replicated=False`` keeps a
    new round from taking a peer's state for this rank's (the memory tier heals them:
    tests/distributed/test_session_tier.py's ``stages``), and refuses a replica check."""
    from ftrain.session_live import BoundaryWatch
    from ftrain.session_state import StateParts

    with pytest.raises(SessionError, match=r"replicated=True.*None .*or False"):
        ftrain.Session(str(tmp_path / "ckpt"), replicated=True)
    with pytest.raises(SessionError, match=r"replica_check_steps=5, replicated=False.*nothing the check can compare"):
        ftrain.Session(str(tmp_path / "ckpt"), replica_check_steps=5, replicated=False)
    state = _state()
    assert StateParts.of(state).replicated and not StateParts.of(state, spread=True).replicated
    watch = BoundaryWatch()
    watch.mark(1, StateParts.of(state, spread=True), {})
    held = watch.held(committed_step=0)
    assert held is not None and held.step == 1 and not held.complete  # its step, never its parameters
    watch.release()
