"""The fault registry: every kind is one module that registers one :class:`Fault`; every kind the
scenario files name is registered and declares what the job owes after it; an unknown kind is
refused naming the choices; the invariants read a kind's behaviour from its registration."""

from __future__ import annotations

import importlib
import pkgutil
import tomllib
from typing import Any

import pytest

import ftrain.chaos.faults.kinds as fault_kinds
from ftrain.chaos.faults import FAULTS, KINDS, Fault, FaultRegistry, FaultSpec, Outcome, UnknownFaultKind
from ftrain.chaos.invariants import fault_timings, faults_handled
from ftrain.chaos.scenario import ScenarioError, load_scenario
from ftrain.testbed.procs import REPO

SCENARIOS = REPO / "chaos" / "scenarios"

#: What each kind owed before the registry (``faults.RESTARTING`` and the names special-cased in
#: ``invariants.py`` and ``runner.py``); the registry keeps it.
OWED_BEFORE = {
    "worker_kill": Outcome.NEW_ROUND,
    "agent_kill": Outcome.NEW_ROUND,
    "worker_hang": Outcome.NEW_ROUND,
    "ckpt_corrupt": Outcome.NEW_ROUND,
    "kill_during_save": Outcome.NEW_ROUND,
    "kill_during_load": Outcome.NEW_ROUND,
    "worker_slow": Outcome.RIDDEN_OUT,
    "etcd_pause": Outcome.RIDDEN_OUT,
    "etcd_restart": Outcome.RIDDEN_OUT,
    "s3_outage": Outcome.RIDDEN_OUT,
    "s3_faults": Outcome.RIDDEN_OUT,
    "duplicate_node": Outcome.REFUSED,
    "zombie_commit": Outcome.REFUSED,
}


def _ev(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": t, "rank": fields.pop("rank", 0), "round": fields.pop("round", 0), **fields}


def _scenario_kinds() -> set[str]:
    """Every kind a scenario file names: its faults, its random kinds and random fault params."""
    kinds: set[str] = set()
    for path in SCENARIOS.glob("*.toml"):
        data = tomllib.loads(path.read_text())
        kinds |= {f["kind"] for f in data.get("faults", [])}
        campaign = data.get("random", {})
        kinds |= set(campaign.get("kinds", [])) | set(campaign.get("fault_params", {}))
    return kinds


def test_every_kind_in_the_scenario_files_is_registered():
    named = _scenario_kinds()
    assert named and named <= set(KINDS), sorted(named - set(KINDS))
    for path in SCENARIOS.glob("*.toml"):
        if "job" in tomllib.loads(path.read_text()):  # tiny.toml is the scenarios' training config
            load_scenario(path)


def test_each_kind_is_one_module_named_after_it():
    modules = {m.name for m in pkgutil.iter_modules(fault_kinds.__path__)}
    assert modules == set(KINDS)
    for kind in KINDS:
        module = importlib.import_module(f"ftrain.chaos.faults.kinds.{kind}")
        assert module.FAULT is FAULTS.get(kind)
        assert module.__doc__ and module.__doc__.startswith(f"``{kind}``: "), kind


def test_every_kind_declares_its_restart_and_invariant_behaviour():
    for fault in FAULTS:
        assert isinstance(fault.outcome, Outcome), fault.kind
        assert fault.restarts is (fault.outcome is Outcome.NEW_ROUND)
        assert callable(fault.act)
        assert isinstance(fault.damages_commit, bool) and isinstance(fault.kills_agent, bool)
        assert fault.detected_by and all(isinstance(event, str) for event in fault.detected_by)
    assert {kind: FAULTS.get(kind).outcome for kind in OWED_BEFORE} == OWED_BEFORE
    assert {kind for kind in OWED_BEFORE if FAULTS.get(kind).damages_commit} == {"ckpt_corrupt"}
    assert {kind for kind in OWED_BEFORE if FAULTS.get(kind).kills_agent} == {"agent_kill"}


def test_an_unknown_kind_is_refused_naming_it_and_the_choices(tmp_path):
    with pytest.raises(UnknownFaultKind) as refused:
        FaultSpec("meteor", at_step=3)
    message = str(refused.value)
    assert message.startswith("unknown fault kind 'meteor': one of ") and all(k in message for k in KINDS)
    with pytest.raises(UnknownFaultKind, match="'meteor'"):
        FAULTS.get("meteor")

    (tmp_path / "tiny.toml").write_text("")
    listed = tmp_path / "listed.toml"
    listed.write_text("[[faults]]\nkind = 'worker_kill'\n\n[[faults]]\nkind = 'meteor'\n")
    with pytest.raises(ScenarioError, match=r"listed\.toml: faults\[1\]: unknown fault kind 'meteor': one of "):
        load_scenario(listed)
    campaign = tmp_path / "campaign.toml"
    campaign.write_text("[random]\ncount = 1\nkinds = ['worker_kill', 'meteor']\n")
    with pytest.raises(ScenarioError) as refused_scenario:
        load_scenario(campaign)
    message = str(refused_scenario.value)
    assert "campaign.toml: random.kinds: unknown fault kind 'meteor': one of " in message
    assert all(k in message for k in KINDS)


def test_a_kind_is_registered_once():
    registry = FaultRegistry()
    fault = Fault(kind="meteor", act=lambda ctx, spec: {}, outcome=Outcome.RIDDEN_OUT)
    assert registry.register(fault) is fault
    with pytest.raises(ValueError, match="'meteor' is registered twice"):
        registry.register(Fault(kind="meteor", act=lambda ctx, spec: {}, outcome=Outcome.NEW_ROUND))
    assert registry.kinds() == ("meteor",) and registry.get("meteor") is fault and list(registry) == [fault]


def test_faults_handled_asks_each_kind_what_the_job_owes():
    events = [
        _ev("chaos_fault", 10.0, kind="worker_kill", step=5),
        _ev("round_formed", 11.0, rank=-1, new_round=2),
        _ev("chaos_fault", 20.0, kind="etcd_pause", step=9),  # ridden out: no round owed
        _ev("chaos_fault", 30.0, kind="duplicate_node", refused=True),
    ]
    check = faults_handled(events)
    assert check.ok and check.detail == "3 fault(s) handled"
    check = faults_handled([*events, _ev("chaos_fault", 40.0, kind="worker_hang", step=12)])
    assert not check.ok and check.detail == "worker_hang #3 at step 12 was never followed by a new round"
    check = faults_handled([*events, _ev("chaos_fault", 40.0, kind="zombie_commit", refused=False)])
    assert not check.ok and check.detail.startswith("zombie_commit #3 was not refused")


def test_only_a_kind_that_restarts_owns_the_round_after_it():
    events = [
        _ev("chaos_fault", 10.0, kind="etcd_pause", step=4),
        _ev("lease_lost", 11.0, rank=-1),
        _ev("round_formed", 12.0, rank=-1, new_round=2),
        _ev("resumed", 13.0, round=2, step=3),
        _ev("chaos_fault", 20.0, kind="worker_kill", step=8),
        _ev("workers_exited", 20.5, rank=-1, outcome="failed"),
        _ev("round_formed", 21.0, rank=-1, new_round=3),
        _ev("resumed", 22.0, round=3, step=6),
    ]
    metrics = [{"step": s, "time": 5.0 + s} for s in range(1, 5)]
    metrics += [{"step": s, "time": 10.0 + s} for s in range(4, 9)]
    metrics += [{"step": s, "time": 16.0 + s} for s in range(7, 9)]
    pause, kill = fault_timings(events, metrics)
    assert (pause["detected_by"], pause["detection_s"]) == ("lease_lost", 1.0)
    assert pause["new_round"] is None and pause["recovery_s"] is None and pause["lost_steps"] is None
    assert (kill["detected_by"], kill["detection_s"]) == ("workers_exited", 0.5)
    assert (kill["new_round"], kill["resumed_step"], kill["recovery_s"], kill["lost_steps"]) == (3, 6, 3.0, 2)


def test_a_slowdown_owes_its_detection_only_when_the_record_says_so_and_no_round_restarted_judging():
    slow = {"kind": "worker_slow", "step": 30, "duration_s": 8.0}
    owed = [_ev("chaos_fault", 10.0, **slow, detection_owed=True)]
    check = faults_handled(owed)
    assert not check.ok and "worker_slow #0 at step 30 was not detected (straggler_detected)" in check.detail
    assert faults_handled([*owed, _ev("straggler_detected", 16.0, rank=-1)]).ok
    assert not faults_handled([*owed, _ev("straggler_detected", 28.5, rank=-1)]).ok  # after 8 s + the grace
    # the kind said the agents' rule does not flag it (a 3 s slowdown, say): riding it out is enough
    assert faults_handled([_ev("chaos_fault", 10.0, **slow, detection_owed=False, why="too short")]).ok
    # a round formed while it lasted starts the judging over: not owed either
    assert faults_handled([*owed, _ev("round_formed", 12.0, rank=-1, new_round=3)]).ok
