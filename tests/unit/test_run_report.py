"""``ftrain report`` (ftrain.observability.run_report and report_page): the lost time by cause adds up to
the devices' wall time, each round's heal says where its state came from, logs are read as
untrusted input, and the page renders every lane and table in a real headless browser."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftrain.observability.browser import dump_dom, find_browser
from ftrain.observability.run_report import CAUSES, build, collect, heals, said_heal, write
from ftrain.testbed.procs import REPO, quiet_env

T0 = 1_000.0


def _line(step: int, t: float, *, world: int = 2, waits=(0.0, 0.0), staging: float = 0.0) -> dict:
    phases = {"data": 0.01, "forward": 0.02, "backward": 0.03, "comm_wait": 0.01, "optimizer": 0.01,
              "ckpt_staging": staging, "other": 0.02}  # fmt: skip
    return {
        "step": step,
        "time": t,
        "loss": 4.0 / step,
        "grad_norm": 1.0,
        "tokens_per_s": 1000.0,
        "step_time_s": 0.08,
        "world_size": world,
        "round": 1,
        "phases_s": phases,
        "rank_busy_s": [0.09, 0.1][:world],
        "rank_comm_wait_s": list(waits)[:world],
    }


def _job() -> tuple[list[dict], list[dict]]:
    metrics = [_line(s, T0 + 1 + 0.1 * s, waits=(0.0, 0.05) if s == 3 else (0.0, 0.0)) for s in range(1, 6)]
    metrics.append(_line(5, T0 + 3.0, staging=0.04))  # step 5 again, after going back
    events = [
        {
            "time": T0,
            "event": "round_formed",
            "new_round": 1,
            "reason": "start",
            "members": ["a", "b"],
            "world_size": 2,
        },
        {"time": T0 + 2, "event": "chaos_fault", "kind": "worker_kill", "node": "b"},
        {
            "time": T0 + 2.5,
            "event": "round_formed",
            "new_round": 2,
            "reason": "worker_exit",
            "members": ["a", "b"],
            "world_size": 2,
        },  # fmt: skip
        {"time": T0 + 1.3, "event": "ckpt_committed", "step": 3, "round": 1},
        {
            "time": T0 + 1.5,
            "event": "straggler_detected",
            "node": "b",
            "busy_rank": 1,
            "busy_s": 0.1,
            "others_s": 0.05,
            "policy": "warn",
        },  # fmt: skip
        {"time": T0 + 1.9, "event": "hang", "node": "a", "worker_round": 1, "verdict": "rank 1 never entered #9"},
        _restored(2, 0, 7, "memory", step=4, held=4, at=T0 + 2.7, seconds=0.1),
        _restored(2, 1, 8, "live_peer", step=4, held=-1, at=T0 + 2.9, seconds=0.3),
    ]
    return metrics, events


def _restored(round_: int, rank: int, pid: int, source: str, *, step: int, held: int, at: float, seconds: float):
    """A live worker's ``live_restored`` (its phases a third of its time each)."""
    third = seconds / 3
    return {"time": at, "event": "live_restored", "round": round_, "rank": rank, "pid": pid, "source": source,
            "step": step, "from_rank": 0 if source == "live_peer" else -1, "world_size": 2, "held_step": held,
            "seconds": seconds, "join_s": third, "build_s": third, "state_s": third}  # fmt: skip


def _resume(round_: int, rank: int, pid: int, *, step: int, at: float, seconds: float) -> list[dict]:
    """A load from storage: ``resume_started``, then ``resumed`` ``seconds`` later."""
    envelope = {"round": round_, "rank": rank, "pid": pid}
    resumed = {"step": step, "from_world_size": 2, "world_size": 2}
    return [{"time": at - seconds, "event": "resume_started", **envelope},
            {"time": at, "event": "resumed", **envelope, **resumed}]  # fmt: skip


def test_the_device_time_by_cause_adds_up_to_the_devices_wall_time_and_is_priced():
    metrics, events = _job()
    a = build(metrics, events, device_hour_price=3.0)["accounting"]
    causes = {c["cause"]: c for c in a["causes"]}
    assert list(causes) == list(CAUSES) and a["devices"] == 2 and a["wall_s"] == 3.0 and a["source"] == "metrics"
    assert sum(c["device_hours"] for c in causes.values()) == pytest.approx(3.0 * 2 / 3600, abs=1e-6)
    assert causes["recomputation"]["device_hours"] == pytest.approx(0.14 * 2 / 3600, abs=1e-6)  # step 5 redone
    assert causes["checkpoint_stalls"]["device_hours"] == pytest.approx(0.04 * 2 / 3600, abs=1e-6)
    assert causes["stragglers"]["device_hours"] == pytest.approx(0.05 / 3600, abs=1e-6)  # rank 1 waited once
    productive = (4 * 0.10 * 2 - 0.04 * 2 - 0.05) / 3600  # steps 2-5: the round's first is its warm-up
    assert causes["productive"]["device_hours"] == pytest.approx(productive, abs=1e-6)
    assert causes["startup"]["device_hours"] == pytest.approx(1.1 * 2 / 3600, abs=1e-6)  # to the first step
    assert causes["idle"]["device_hours"] == 0.0
    assert a["goodput"] == pytest.approx(productive / (3.0 * 2 / 3600), abs=1e-3)
    assert all(c["cost"] == pytest.approx(c["device_hours"] * 3.0, abs=1e-4) for c in causes.values())
    assert all(c["cost"] is None for c in build(metrics, events)["accounting"]["causes"]), "no price, no cost"


def test_a_smaller_round_leaves_the_largest_worlds_other_devices_idle():
    metrics = [_line(s, T0 + 0.1 * s, world=2) for s in range(1, 4)]
    metrics += [{**_line(s, T0 + 1 + 0.1 * s, world=1), "round": 2} for s in range(3, 8)]
    a = build(metrics, [])["accounting"]
    causes = {c["cause"]: c["device_hours"] for c in a["causes"]}
    # 1 of 2 devices from the end of round 1 on: the gap to round 2's first step (1.0 s), then its 4 steps
    assert causes["idle"] == pytest.approx((1.0 + 4 * 0.1) / 3600, abs=1e-6)
    assert sum(causes.values()) == pytest.approx((1.7 - 0.1) * 2 / 3600, abs=1e-6)


def test_logs_are_untrusted_input_wrong_types_count_as_nothing(tmp_path):
    metrics, events = _job()
    (tmp_path / "n0").mkdir()
    lines = [json.dumps(m) for m in metrics] + ['{"step": "x"}', "[1]", '{"step": 7, "time": "soon"', "not json"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "n0" / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + '\n{"event": 5}\n')
    (tmp_path / "n0" / "other.jsonl").write_text("{}\n")
    got_metrics, got_events, files = collect(tmp_path)
    assert len(got_metrics) == len(metrics) and len(got_events) == len(events) and len(files) == 2
    bad = [*metrics, {"step": 8, "time": "later", "phases_s": {"other": "x"}, "rank_comm_wait_s": ["a"]}]
    report = build(bad, events)
    assert report["steps"][-1]["step"] == 8 and report["accounting"]["devices"] == 2


def test_each_rounds_heal_says_where_its_state_came_from_what_it_cost_and_how_many_steps_were_redone():
    """Either loop's workers: live rounds (a survivor's memory, a live peer, storage after a
    refusal), restarts that load from storage (all in round 0 under plain torchrun) and the
    memory tier's directory; the job's fresh start is not a heal."""
    metrics = [_line(s, T0 + 0.1 * s) for s in range(1, 10)]  # steps 1-9 by T0 + 0.9
    events = [
        _restored(1, 0, 7, "fresh", step=0, held=-1, at=T0, seconds=0.5),
        _restored(1, 1, 8, "fresh", step=0, held=-1, at=T0, seconds=0.5),
        {"time": T0 + 1.0, "event": "live_round_left", "round": 1, "rank": 0, "pid": 7, "step": 9, "why": "peer"},
        _restored(2, 0, 7, "live_peer", step=9, held=9, at=T0 + 1.2, seconds=0.1),  # rank 0 sent its own
        _restored(2, 1, 9, "live_peer", step=9, held=-1, at=T0 + 1.6, seconds=0.5),
        # round 3: the peer's state refused, both ranks from storage (a load inside the live round)
        dict(time=T0 + 2, event="live_peer_refused", round=3, rank=1, pid=9, from_rank=0, step=9, problem="x"),
        *_resume(3, 0, 7, step=5, at=T0 + 2.4, seconds=0.3),
        _restored(3, 0, 7, "storage", step=5, held=9, at=T0 + 2.5, seconds=0.6),
        *_resume(3, 1, 9, step=5, at=T0 + 2.4, seconds=0.3),
        _restored(3, 1, 9, "storage", step=5, held=9, at=T0 + 2.5, seconds=0.7),
        # restarts under plain torchrun: every process logs round 0; the second load is another heal
        *_resume(0, 0, 20, step=5, at=T0 + 4.0, seconds=1.5),
        *_resume(0, 0, 30, step=5, at=T0 + 6.0, seconds=1.0),
        dict(time=T0 + 7, event="memory_restored", round=4, rank=0, pid=40, step=6, world_size=1, seconds=0.25),
    ]
    got = heals(metrics, events[::-1])  # in any order: read in time order
    assert [(h["round"], h["sources"], h["step"]) for h in got] == [
        (2, {"memory": 1, "live_peer": 1}, 9),
        (3, {"storage": 2}, 5),
        (0, {"storage": 1}, 5),
        (0, {"storage": 1}, 5),
        (4, {"memory_tier": 1}, 6),
    ]
    live, refused, *restarts, tier = got
    assert live["steps_redone"] == 0 and live["slowest_rank"] == 1 and live["seconds"] == pytest.approx(0.5)
    assert live["time"] == pytest.approx(T0 + 1.1) and live["done_at"] == pytest.approx(T0 + 1.6)
    assert live["phases_s"]["state_s"] == pytest.approx(0.5 / 3) and live["refused"] == 0
    assert refused["steps_redone"] == 4 and refused["refused"] == 1 and refused["ranks"] == 2
    assert [h["seconds"] for h in restarts] == [pytest.approx(1.5), pytest.approx(1.0)]
    assert [h["steps_redone"] for h in restarts] == [4, 4]  # steps 6-9 done before, from the metrics lines
    assert tier["seconds"] == 0.25 and tier["world_size"] == 1
    assert said_heal(refused) == (
        "round 3: state from storage x2 at step 5, slowest rank 1 in 0.70s, 4 step(s) redone, 1 refusal(s)"
    )
    # a session's loop writes no metrics lines: what the ranks held and kept says what was done
    assert [h["steps_redone"] for h in heals([], events)] == [0, 4, 4, 4, 3]  # step 9 was kept in round 1
    assert heals([], events[-1:])[0]["steps_redone"] is None  # nothing says
    hostile = [{**_restored(5, 0, 1, "live_peer", step=3, held=2, at=T0, seconds=1e300), "round": [5]},
               {**_restored(5, 1, 2, "live_peer", step="x", held=2, at=T0, seconds=0.1)},
               {"event": "resumed", "step": 2, "time": "late"}]  # fmt: skip
    wild = heals([], hostile)
    assert [(h["round"], h["step"], h["ranks"]) for h in wild] == [(None, 3, 2)]  # the step "x" is not a restore
    assert wild[0]["seconds"] == 7 * 86400 and wild[0]["slowest_rank"] == 0  # a longer one is not believed


def test_the_command_writes_the_report_and_names_a_missing_directory(tmp_path):
    metrics, events = _job()
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")

    def ftrain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ftrain", "report", *args],
            cwd=REPO,
            env=quiet_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = ftrain(str(tmp_path), "--device-hour-price", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "report.html").exists() and json.loads(out.stdout.splitlines()[-1])["device_hour_price"] == 2
    assert "recovery" in out.stdout and "device-hours" in out.stdout and "restarts" not in out.stdout
    assert "heal: round 2: state from memory x1, live_peer x1 at step 4, slowest rank 1 in 0.30s" in out.stdout
    missing = ftrain(str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    negative = ftrain(str(tmp_path), "--device-hour-price", "-1")
    assert negative.returncode == 2 and "accounting.device_hour_price" in negative.stderr


@pytest.mark.skipif(
    find_browser() is None, reason="no headless Chromium installed (apt-get install chromium; .ci/run installs it)"
)
def test_the_report_renders_every_lane_chart_and_table_in_a_real_browser(tmp_path):
    metrics, events = _job()
    write(tmp_path, build(metrics, events, title="job-1", device_hour_price=3.0))
    dom = dump_dom(tmp_path / "report.html")
    for lane in ("rounds", "faults", "heals", "hangs", "checkpoints", "stragglers", "steps"):
        assert f'data-lane="{lane}"' in dom, lane
    assert 'data-rendered="7"' in dom and dom.count('class="round"') == 2
    for chart in ("loss", "grad norm", "tokens/s", "heatmap"):
        assert f'data-chart="{chart}"' in dom, chart
    assert dom.count('class="cell"') == 2 * 6  # 2 ranks x 6 step lines
    for table, text in (("lost", "recomputation"), ("rounds", "worker_exit"), ("stragglers", "warn"),
                        ("hangs", "rank 1 never entered #9"), ("checkpoints", "<td>3</td>"),
                        ("heals", "memory x1, live_peer x1"), ("heals", "0.10 / 0.10 / 0.10")):  # fmt: skip
        assert f'id="{table}"' in dom and text in dom, table
    assert "job-1" in dom and "goodput" in dom
    png = tmp_path / "report.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
