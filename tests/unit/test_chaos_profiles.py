"""Soak profiles: a failure mix (``[random.weights]``) and a rate (``every_s``, exponential waits)
in the scenario format, checked when the file loads (an error names the key and the file); the
profiles' scenario files load and hold the published mix; ``--fault-every-s`` overrides the rate;
and the report splits the lost time by the fault kind that cost it."""

from __future__ import annotations

import statistics
from collections import Counter
from random import Random
from typing import Any

import pytest

from ftrain.chaos.faults import KINDS
from ftrain.chaos.invariants import corruption_outcomes, fault_timings, goodput, lost_by_kind, lost_time
from ftrain.chaos.runner import with_fault_every_s
from ftrain.chaos.scenario import RandomSpec, ScenarioError, load_scenario
from ftrain.cli import build_parser
from ftrain.testbed.procs import REPO

SCENARIOS = REPO / "chaos" / "scenarios"


def _scenario(tmp_path, random_table: str, name: str = "mix.toml"):
    (tmp_path / "tiny.toml").write_text("")
    path = tmp_path / name
    path.write_text(random_table)
    return load_scenario(path)


def test_weights_draw_each_kind_at_its_share_seeded(tmp_path):
    scenario = _scenario(
        tmp_path,
        "[random]\ncount = 4000\nevery_s = 10.0\n[random.weights]\nagent_kill = 60\nworker_kill = 30\n"
        "bit_flip = 10\netcd_pause = 0\n",
    )
    spec = scenario.random
    assert spec.mix == {"agent_kill": 0.6, "worker_kill": 0.3, "bit_flip": 0.1}
    drawn = scenario.random_faults(Random(3))
    assert drawn == scenario.random_faults(Random(3))  # seeded: the same campaign again
    counts = Counter(s.kind for _, s in drawn)
    assert set(counts) == {"agent_kill", "worker_kill", "bit_flip"}  # weight 0: never drawn
    assert counts["agent_kill"] / 4000 == pytest.approx(0.6, abs=0.03)
    assert counts["bit_flip"] / 4000 == pytest.approx(0.1, abs=0.02)
    waits = [w for w, _ in drawn]
    # exponential: mean every_s, median every_s * ln 2, and no upper bound
    assert statistics.mean(waits) == pytest.approx(10.0, rel=0.08)
    assert statistics.median(waits) == pytest.approx(10.0 * 0.6931, rel=0.1)
    assert max(waits) > 40


def test_the_uniform_form_draws_as_it_always_did(tmp_path):
    """Old seeds replay old campaigns: a kind, then its uniform wait, from the same generator."""
    scenario = _scenario(tmp_path, "[random]\ncount = 50\nkinds = ['worker_kill', 'etcd_pause']\ninterval_s = [1, 4]\n")
    rng = Random(7)
    before = [(k, rng.uniform(1.0, 4.0)) for k in (rng.choice(["worker_kill", "etcd_pause"]) for _ in range(50))]
    assert [(s.kind, w) for w, s in scenario.random_faults(Random(7))] == before
    assert scenario.random.mix == {"worker_kill": 0.5, "etcd_pause": 0.5}


def test_fault_params_follow_the_drawn_kind(tmp_path):
    scenario = _scenario(
        tmp_path,
        "[random]\ncount = 20\nevery_s = 1\n[random.weights]\nagent_kill = 1\n"
        "[random.fault_params.agent_kill]\nrestart_after_s = 5.0\n",
    )
    assert all(s.params == {"restart_after_s": 5.0} for _, s in scenario.random_faults(Random(1)))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[random]\nkinds = ['worker_kill']\n[random.weights]\nworker_kill = 1\n", "random.weights: give random.kinds"),
        ("[random]\nevery_s = 5\ninterval_s = [1, 2]\n", "random.every_s: give random.interval_s"),
        ("[random]\nevery_s = 0\n", "random.every_s: 0 must be a number of seconds > 0"),
        ("[random]\nevery_s = 'often'\n", "random.every_s: 'often' must be"),
        ("[random]\ninterval_s = [3, 1]\n", r"random.interval_s: \[3, 1\]: need 0 <= low <= high"),
        ("[random]\ninterval_s = 2\n", "random.interval_s: 2 is not"),
        ("[random.weights]\nworker_kill = -1\n", "random.weights.worker_kill: -1 must be a number >= 0"),
        ("[random.weights]\nworker_kill = true\n", "random.weights.worker_kill: True must be"),
        ("[random.weights]\nworker_kill = 0\n", "random.weights: no kind has a weight > 0"),
        ("[random]\nweights = 3\n", "random.weights: must be a table"),
        ("[random.weights]\nmeteor = 1\n", "random.weights.meteor: unknown fault kind 'meteor': one of "),
        ("[random.fault_params.meteor]\nx = 1\n", "random.fault_params.meteor: unknown fault kind 'meteor'"),
        ("[random]\ncount = -1\n", "random.count: -1 must be an integer >= 0"),
        ("[random]\nduration_s = -5\n", "random.duration_s: -5 must be"),
        ("[random]\nrate = 5\n", "random.rate: unknown key"),
    ],
)
def test_a_wrong_campaign_is_refused_naming_the_key_and_the_file(tmp_path, table, message):
    with pytest.raises(ScenarioError, match=r"bad\.toml: " + message):
        _scenario(tmp_path, table, name="bad.toml")


def test_fault_every_s_overrides_the_mean_and_refuses_a_scenario_without_a_campaign(tmp_path):
    soak = load_scenario(SCENARIOS / "soak.toml")
    assert soak.random.every_s == 0 and soak.random.interval_s == (1.0, 4.0)
    faster = with_fault_every_s(soak, 7.5)
    assert faster.random.every_s == 7.5 and faster.random.kinds == soak.random.kinds and soak.random.every_s == 0
    waits = [w for w, _ in faster.random_faults(Random(1))]
    assert statistics.mean(waits) == pytest.approx(7.5, rel=0.2)
    with pytest.raises(ScenarioError, match="--fault-every-s: every_s: -1 must be > 0"):
        with_fault_every_s(soak, -1)
    with pytest.raises(ScenarioError, match=r"--fault-every-s: .*processes\.toml has no random campaign"):
        with_fault_every_s(load_scenario(SCENARIOS / "processes.toml"), 5)
    args, _ = build_parser(["chaos"]).parse_known_args(
        ["chaos", "run", "chaos/scenarios/soak-realistic.toml", "--fault-every-s", "15"]
    )
    assert args.fault_every_s == 15.0


#: the published failure mix (Llama 3 405B, 54 days): the shares the realistic profile must hold
PUBLISHED = {"node lost": 0.60, "software crash": 0.13, "drain": 0.08, "hang": 0.02, "silent corruption": 0.015}
GROUPS = {
    "node lost": {"agent_kill"},
    "software crash": {"worker_kill"},
    "drain": {"node_drain"},
    "hang": {"worker_hang", "worker_stuck"},
    "silent corruption": {"bit_flip"},
}


@pytest.mark.parametrize("name", ["soak-realistic.toml", "soak-stress.toml"])
def test_the_profiles_hold_the_published_mix(name):
    scenario = load_scenario(SCENARIOS / name)
    spec = scenario.random
    assert spec.weights and spec.every_s > 0 and set(spec.weights) <= set(KINDS)
    mix = spec.mix
    for group, share in PUBLISHED.items():
        assert sum(mix.get(k, 0.0) for k in GROUPS[group]) == pytest.approx(share, abs=0.005), group
    assert scenario.job.nodes == 2 and spec.min_steps_between > 0
    assert "--consistency.interval=1" in scenario.job.overrides  # bit_flip needs the replica check
    assert "--consistency.on_mismatch=rollback" in scenario.job.overrides
    assert spec.fault_params["agent_kill"].get("restart_after_s") and spec.fault_params["node_drain"].get(
        "restart_after_s"
    )
    minutes = 45 if name == "soak-realistic.toml" else 30
    assert spec.duration_s >= minutes * 60 and scenario.job.timeout_s > spec.duration_s
    assert spec.count * spec.every_s > spec.duration_s  # the campaign lasts its duration


def test_the_profiles_are_the_soaks_mix_at_two_rates():
    realistic, stress = (load_scenario(SCENARIOS / n).random for n in ("soak-realistic.toml", "soak-stress.toml"))
    assert realistic.weights == stress.weights and (realistic.every_s, stress.every_s) == (60.0, 15.0)
    assert load_scenario(SCENARIOS / "soak.toml").random == RandomSpec(
        count=400,
        kinds=load_scenario(SCENARIOS / "soak.toml").random.kinds,
        interval_s=(1.0, 4.0),
        duration_s=1800,
        min_steps_between=10,
        fault_params=load_scenario(SCENARIOS / "soak.toml").random.fault_params,
    )  # make soak PROFILE=uniform: today's campaign, unchanged


def _ev(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": t, "rank": fields.pop("rank", 0), "round": fields.pop("round", 0), **fields}


def _metrics(steps: range, t0: float, step_s: float, round_: int) -> list[dict[str, Any]]:
    return [
        {"step": s, "time": t0 + step_s * (i + 1), "step_time_s": step_s, "round": round_} for i, s in enumerate(steps)
    ]


def test_lost_time_is_split_by_the_fault_that_cost_it():
    # steps 1-10 from t=2 (startup 2 s); a worker_kill at 12.5: steps 9-10 are redone after a
    # 2.5 s stall; an etcd_pause at 20 costs nothing; a bit_flip at 22.2: the rollback redoes
    # steps 14-15 of the same round after a 0.8 s stall; the job ends 1 s after its last step
    events = [
        _ev("chaos_fault", 12.5, kind="worker_kill", step=10),
        _ev("round_formed", 13.0, rank=-1, new_round=2),
        _ev("chaos_fault", 20.0, kind="etcd_pause", step=15),
        _ev("chaos_fault", 22.2, kind="bit_flip", step=15),
        _ev("replica_mismatch", 23.0, step=16),
        _ev("ckpt_committed", 21.0, step=12),
        _ev("rolled_back", 23.1, step=13),
        _ev("job_final", 28.2, rank=-1, status="succeeded"),
    ]
    metrics = _metrics(range(1, 11), 2.0, 1.0, 1)  # steps 1..10 end at 3..12
    metrics += _metrics(range(9, 17), 15.0, 1.0, 2)  # steps 9..16 end at 16..23: 9 starts at 15
    metrics += _metrics(range(14, 18), 23.2, 1.0, 2)  # steps 14..17 end at 24.2..27.2
    split = lost_time(events, metrics, started_at=0.0)
    # worker_kill: the first 9-10 (2 s, redone) + idle 12..15 (3 s); bit_flip: idle 23..23.2 and the
    # superseded 14..16 (3 s); etcd_pause: nothing; startup 0..2; shutdown 27.2..28.2
    assert split["by_fault"] == [5.0, 0.0, pytest.approx(3.2)]
    assert (split["startup_s"], split["shutdown_s"], split["unattributed_s"]) == (2.0, 1.0, 0.0)
    g = goodput(events, metrics, started_at=0.0)
    assert g["productive_s"] == 17.0 and g["wall_s"] == 28.2 and g["lost_s"] == pytest.approx(11.2)
    assert sum(g["lost_by_cause"].values()) == pytest.approx(g["lost_s"])
    assert g["lost_by_cause"] == {
        "startup": 2.0,
        "shutdown": 1.0,
        "worker_kill": 5.0,
        "etcd_pause": 0.0,
        "bit_flip": pytest.approx(3.2),
    }
    timings = fault_timings(events, metrics)
    for timing, lost_s in zip(timings, split["by_fault"], strict=True):
        timing["lost_s"] = lost_s
    assert lost_by_kind(timings)["worker_kill"] == {"faults": 1, "total_s": 5.0, "median_s": 5.0, "worst_s": 5.0}
    [flip] = corruption_outcomes(events, timings)
    assert flip["detected"] and flip["detection_s"] == pytest.approx(0.8) and flip["detection_steps"] == 1
    assert flip["corrupted_commits"] == 0


def test_a_stall_between_rounds_is_lost_even_when_no_step_is():
    """Live recovery that loses no step: the next round's first step is not credited with the stall."""
    events = [_ev("chaos_fault", 5.5, kind="worker_hang", step=5), _ev("job_final", 16.0, rank=-1)]
    metrics = _metrics(range(1, 6), 0.0, 1.0, 1) + _metrics(range(6, 11), 11.0, 1.0, 2)
    g = goodput(events, metrics, started_at=0.0)
    assert g["productive_s"] == 10.0 and g["lost_by_cause"]["worker_hang"] == 6.0


def test_a_script_jobs_stall_is_lost_to_its_fault_though_its_first_steps_have_no_time():
    """A script job's progress comes from its ledger: no step time, so each round's first step
    is an attempt of no length. It must not stay "in flight": the stall after the next fault is
    that fault's, and the lost time adds up to wall time less productive time."""
    events = [_ev("chaos_fault", 5.5, kind="agent_kill", step=5), _ev("job_final", 16.0, rank=-1)]
    metrics = _metrics(range(1, 6), 0.0, 1.0, 1) + _metrics(range(6, 11), 11.0, 1.0, 2)
    for m in metrics:
        m["step_time_s"] = 0.0
    g = goodput(events, metrics, started_at=0.0)
    assert g["productive_s"] == 8.0, g  # steps 2-5 and 7-10: the first of each round has no length
    assert g["lost_by_cause"] == {"startup": 1.0, "shutdown": 0.0, "agent_kill": 7.0}, g
    assert sum(g["lost_by_cause"].values()) == pytest.approx(g["lost_s"])


def test_an_undetected_flip_counts_every_commit_after_it_as_corrupted():
    events = [
        _ev("chaos_fault", 10.0, kind="bit_flip", step=5),
        _ev("ckpt_committed", 12.0, step=10),
        _ev("ckpt_committed", 14.0, step=15),
        _ev("ckpt_committed", 14.0, step=15, rank=1),
    ]
    timings = fault_timings(events, _metrics(range(1, 16), 5.0, 0.6, 1))
    [flip] = corruption_outcomes(events, timings)
    assert not flip["detected"] and flip["detection_steps"] is None and flip["corrupted_commits"] == 2
