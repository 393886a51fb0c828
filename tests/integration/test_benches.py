"""Every benchmark's ``--smoke`` run keeps working and ends with its JSON line: a benchmark that
nothing runs rots."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import run

pytestmark = pytest.mark.timeout(400)


def test_the_recovery_bench_smoke_run_times_live_and_restart_recovery_and_a_users_loop():
    proc = run([sys.executable, "bench/recovery.py", "--smoke"], timeout_s=380)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    live = summary["results"]["worker_kill"]["ftrain_live"]
    restart = summary["results"]["worker_kill"]["ftrain_restart"]
    session = summary["results"]["worker_kill"]["session_live"]
    assert live["recovered"] == restart["recovered"] == session["recovered"] == 1
    assert live["load_start_by"] == ["live_restored (live_peer)"]  # the replacement healed from its peer
    assert summary["live_worker_kill_s"] == live["total_s"] and summary["live_speedup_vs_restart"] > 1
    # the user's loop (ftrain.Session.run): the spare took the lost rank and its state from the survivor
    assert session["load_start_by"] == ["live_restored (live_peer)"] and session["world_size_after"] == [2]
    assert summary["session_live_worker_kill_s"] == session["total_s"] > 0


def test_the_steady_state_bench_smoke_run_compares_the_agent_with_torchrun():
    proc = run([sys.executable, "bench/steady_state.py", "--smoke"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "steady_state" and len(summary["ratios"]) == 1
    assert summary["agent_step_s"] > 0 and summary["torchrun_step_s"] > 0
    ratio = summary["agent_step_s"] / summary["torchrun_step_s"]
    assert summary["steady_state_vs_torchrun"] == pytest.approx(ratio, abs=1e-3)
    assert isinstance(summary["target_met"], bool)


def _smoke(script: str, *, timeout_s: float) -> dict:
    """Run ``bench/<script> --smoke``; it exits 0 and its last line of output is its JSON summary."""
    proc = run([sys.executable, f"bench/{script}", "--smoke"], timeout_s=timeout_s)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(360)
def test_the_strategies_bench_smoke_run_measures_each_strategy_and_its_plan():
    summary = _smoke("strategies.py", timeout_s=340)
    assert summary["bench"] == "strategies" and summary["smoke"] and summary["model_size"] == "tiny"
    results = {r["strategy"]: r for r in summary["results"]}
    assert list(results) == ["ddp", "fsdp", "hsdp"]
    for name, r in results.items():
        assert r["ok"] and r["ranks"] == (4 if name == "hsdp" else 2), r
        assert r["steps_measured"] == summary["steps"] - summary["warmup"] > 0
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and 0 < r["final_loss"] < 10
        assert len(r["peak_rss_per_rank"]) == r["ranks"] and r["peak_rss_bytes"] == max(r["peak_rss_per_rank"])
        # every rank pays ftrain.planning.memory.CPU_BASELINE_BYTES (~385 MB) before the model: both sides include it
        assert r["peak_rss_bytes"] > 100e6 and r["plan_bytes"] > 100e6
        assert abs(r["plan_bytes"] - r["peak_rss_bytes"]) < 0.2 * r["peak_rss_bytes"], r


@pytest.mark.timeout(300)
def test_the_plan_vs_measured_bench_smoke_run_compares_the_estimate_with_the_peak():
    summary = _smoke("plan_vs_measured.py", timeout_s=280)
    assert summary["bench"] == "plan_vs_measured" and summary["model_size"] == "tiny" and summary["num_params"] > 0
    rows = {r["strategy"]: r for r in summary["results"]}
    assert list(rows) == ["ddp", "fsdp"]
    for row in rows.values():
        assert row["ok"] and row["failed_attempts"] == [], row
        parts = ("model_state_bytes", "activation_bytes", "transient_bytes", "init_bytes", "overhead_bytes")
        assert all(row[k] >= 0 for k in parts) and row["estimate_bytes"] > row["model_state_bytes"] > 0
        assert row["measured_bytes"] == max(row["measured_per_rank"]) > 0
        assert row["relative_error"] == pytest.approx(
            (row["estimate_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
        )
        assert abs(row["relative_error"]) < 0.2, row
        # the start-up phase, from each rank's model_built event, beside the plan's init term
        assert row["startup_measured_bytes"] > 0 and row["startup_estimate_bytes"] == row["init_bytes"], row
    # fsdp shards the model states across the 2 ranks: the plan gives it less than ddp
    assert rows["fsdp"]["model_state_bytes"] < rows["ddp"]["model_state_bytes"]


@pytest.mark.timeout(300)
def test_the_equivalence_bench_smoke_run_lands_each_strategy_where_one_process_does():
    summary = _smoke("equivalence.py", timeout_s=280)
    assert summary["bench"] == "equivalence" and summary["steps_run"] == summary["steps"] > 0
    rows = {r["strategy"]: r for r in summary["vs_single_process"]}
    assert list(rows) == ["ddp", "fsdp"] and rows["ddp"]["ranks"] == rows["fsdp"]["ranks"] == 2
    for row in rows.values():
        # within tests/distributed/test_strategies.py's tolerances (2e-4 parameters, 1e-4 loss)
        assert 0 <= row["param"] < 2e-4 and 0 <= row["optim"] < 2e-4 and 0 <= row["loss"] < 1e-4, row


@pytest.mark.timeout(360)
def test_the_checkpoint_bench_smoke_run_saves_and_loads_on_s3_and_times_training_beside_it():
    summary = _smoke("checkpoint.py", timeout_s=340)
    assert summary["bench"] == "checkpoint" and summary["smoke"] and summary["repeats"] == 1
    assert summary["errors"] == {} and set(summary["modes"]) == {"thread", "process"}
    assert summary["bytes"] > 1e6 and len(summary["state_bytes_per_rank"]) == 2  # FSDP: each rank's half
    for key in ("sync_save_s", "raw_put_s", "load_s", "raw_get_s", "blocked_ratio", "save_vs_raw", "load_vs_raw"):
        assert summary[key] > 0, key
    assert summary["blocked_ratio"] == summary["modes"]["thread"]["blocked_ratio"]
    assert summary["save_vs_raw"] == pytest.approx(summary["raw_put_s"] / summary["sync_save_s"])
    assert summary["step_slowdown_during_upload"] == summary["modes"]["thread"]["step_slowdown"] > 0
    for mode in summary["modes"].values():
        assert mode["steps_idle"] > 0 and mode["steps_inflight"] > 0 and mode["upload_s"] > 0
    cache = summary["local_cache"]  # each rank reads its own shard from its cache, its share of the rest from S3
    assert cache["save_s"] > 0 and cache["load_s"] > 0 and 0.3 < cache["share_read_from_cache"] <= 1, cache
    assert summary["local_cache_load_speedup_vs_s3"] == pytest.approx(summary["load_s"] / cache["load_s"])
    assert summary["memory_tier"]["restore_s"] > 0 and summary["memory_tier_load_speedup_vs_s3"] > 0


@pytest.mark.timeout(200)
def test_the_flight_recorder_bench_smoke_run_compares_the_recorder_on_and_off():
    summary = _smoke("flight_recorder.py", timeout_s=180)
    assert summary["bench"] == "flight_recorder" and summary["settings"]["entries"] == 2000
    assert summary["on_step_s"] > 0 and summary["off_step_s"] > 0 and len(summary["ratios"]) == 1
    assert summary["recorder_on_vs_off"] == pytest.approx(summary["on_step_s"] / summary["off_step_s"], abs=1e-3)
    assert isinstance(summary["target_met"], bool)


@pytest.mark.timeout(200)
def test_the_pipeline_bench_smoke_run_measures_each_schedule_beside_its_formula_and_plan():
    summary = _smoke("pipeline.py", timeout_s=180)
    assert summary["bench"] == "pipeline" and summary["smoke"] and summary["ok"]
    runs = {(r["pp"], r["schedule"]): r for r in summary["runs"]}
    assert set(runs) == {(1, "none"), (2, "gpipe"), (2, "1f1b"), (2, "interleaved_1f1b")}
    for (pp, schedule), r in runs.items():
        assert r["tokens_per_s"] > 0 and len(r["peak_per_rank"]) == len(r["plan_per_rank"]) == pp
        if pp > 1:
            assert 0 < r["bubble"] < 1 and len(r["bubble_per_rank"]) == 2
            assert r["formula"] == pytest.approx(1 / (8 * (2 if schedule == "interleaved_1f1b" else 1) + 1))
    assert isinstance(summary["plan_within_10pct"], bool) and summary["install_baseline_bytes"] > 100e6
    assert all("plan_error_here_max" in r for r in summary["runs"])


@pytest.mark.timeout(240)
def test_the_control_plane_bench_smoke_run_measures_16_agents_on_a_real_etcd():
    summary = _smoke("control_plane.py", timeout_s=220)
    assert summary["bench"] == "control_plane" and summary["smoke"] and summary["nodes_max"] == 16
    for key in ("agent_cpu_core_per_s", "leader_cpu_core_per_s", "etcd_requests_per_s", "etcd_tx_bytes_per_s"):
        assert f"{key}_at_1024" in summary and f"old_{key}_at_1024" in summary, key
    for key in ("node_loss_to_round_s", "join_to_round_s", "status_s"):
        assert f"{key}_at_1024" in summary and f"old_{key}_at_1024" in summary, key
    assert "decide_ms_at_4096" in summary
    run = summary["per_size"]["16"]["new"]
    assert "error" not in run, run.get("error")
    assert run["lease_ttl_s"] == 2 and run["layout"].startswith("leader + 4 sampled followers")
    assert run["leader_cpu_core_per_s"] > 0 and run["follower_cpu_core_per_s"] > 0
    assert run["hosted_follower_cpu_core_per_s"] > 0
    assert run["etcd"]["requests_per_s"] > 0 and run["etcd"]["tx_bytes_per_s"] > 0
    assert run["etcd"]["requests_per_s_by_method"].get("LeaseKeepAlive", 0) > 0  # counted server side
    assert run["tick_errors"] == 0, run["tick_error_sample"]
    assert run["status_nodes_shown"] == 16 and run["status_s"] > 0 and run["status_call_s"] > 0
    # a follower was killed: a round without it; then a new agent joined: a round with it
    assert run["round_after"] > run["round_before"] and run["node_loss_to_round_s"] > 0
    assert run["join_round"] > run["round_after"] and run["join_to_round_s"] > 0


@pytest.mark.timeout(200)
def test_the_models_bench_smoke_run_sets_the_llama_under_ftrain_beside_a_plain_loop():
    summary = _smoke("models.py", timeout_s=180)
    assert summary["bench"] == "models" and summary["smoke"] and summary["ok"]
    assert summary["model"]["arch"] == "llama" and summary["num_params"] > 0
    rows = {r["strategy"]: r for r in summary["results"]}
    assert list(rows) == ["ddp", "fsdp"]
    for row in rows.values():
        [pair] = row["pairs"]
        for side in ("ftrain", "plain"):
            assert pair[side]["ok"] and pair[side]["tokens_per_s"] > 0 and len(pair[side]["peak_rss_per_rank"]) == 2
            assert 0 < pair[side]["final_loss"] < 10
        assert row["ratio"] == pytest.approx(pair["ftrain"]["tokens_per_s"] / pair["plain"]["tokens_per_s"])
        assert row["plan_bytes"] > 100e6  # the per-process baseline dominates the debug model
        assert abs(row["plan_error"]) < 0.2, row
    assert isinstance(summary["ratio_target_met"], bool) and isinstance(summary["plan_target_met"], bool)


@pytest.mark.timeout(300)
def test_the_goodput_bench_smoke_run_splits_the_lost_time_by_fault_kind():
    summary = _smoke("goodput.py", timeout_s=280)
    assert summary["bench"] == "goodput" and summary["smoke"] and summary["profile"] == "realistic"
    assert summary["modes"] == ["live"] and summary["goodput_restart"] is None
    assert summary["invariants_held"], summary["runs"]["live"]["failed_invariants"]
    run = summary["runs"]["live"]
    assert 0 < run["goodput"] == summary["goodput_live"] <= 1 and isinstance(summary["target_met"]["live"], bool)
    assert run["lost_s"] == pytest.approx(run["wall_s"] - run["productive_s"], abs=0.01)
    assert sum(run["lost_by_cause"].values()) == pytest.approx(run["lost_s"], abs=0.05)
    assert {"worker_kill", "bit_flip", "agent_kill", "s3_faults", "etcd_pause"} <= set(run["per_kind"])
    for kind in run["per_kind"].values():
        assert kind["faults"] >= 1 and 0 <= kind["median_s"] <= kind["worst_s"] <= kind["total_s"] + 1e-9, kind
    assert run["per_kind"]["agent_kill"]["total_s"] > 0  # a node lost costs time, whatever recovers it
    flips = run["bit_flip"]
    assert flips["occurrences"] >= 1 and flips["detected_every_time"] and summary["bit_flip_detected_every_time"]
    assert flips["detection_s_max"] is not None and flips["detection_steps_max"] is not None
    assert flips["corrupted_commits"] == summary["corrupted_commits"] == 0


def test_the_session_bench_smoke_run_times_the_example_with_and_without_the_session():
    summary = _smoke("session.py", timeout_s=300)
    assert summary["bench"] == "session" and len(summary["ratios"]) == 1
    assert summary["session_step_s"] > 0 and summary["plain_step_s"] > 0
    ratio = summary["session_step_s"] / summary["plain_step_s"]
    assert summary["session_vs_plain"] == pytest.approx(ratio, abs=1e-3)
