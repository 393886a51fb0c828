"""The chaos building blocks on their own: scenario files, the S3 fault proxy against real
SeaweedFS, and the report as a real headless browser renders it."""

from __future__ import annotations

import random
import time

import pytest

from ftrain.chaos.report import dump_dom, find_browser, write_report
from ftrain.chaos.s3proxy import FaultRates, S3FaultProxy
from ftrain.chaos.scenario import ScenarioError, load_scenario
from ftrain.checkpoint.storage import Storage


def test_scenario_errors_name_the_file_and_key(tmp_path):
    (tmp_path / "tiny.toml").write_text("")
    bad_key = tmp_path / "a.toml"
    bad_key.write_text("[job]\nstepz = 3\n")
    with pytest.raises(ScenarioError, match=r"a\.toml: job\.stepz: unknown key"):
        load_scenario(bad_key)
    bad_kind = tmp_path / "b.toml"
    bad_kind.write_text("[[faults]]\nkind = 'meteor'\n")
    with pytest.raises(ScenarioError, match=r"b\.toml: faults\[0\]: unknown fault kind 'meteor'"):
        load_scenario(bad_kind)
    no_config = tmp_path / "c.toml"
    no_config.write_text("[job]\nconfig = 'missing.toml'\n")
    with pytest.raises(ScenarioError, match="job.config: .*missing.toml does not exist"):
        load_scenario(no_config)


def test_random_campaign_is_seeded(tmp_path):
    (tmp_path / "tiny.toml").write_text("")
    path = tmp_path / "r.toml"
    path.write_text("[random]\ncount = 20\nkinds = ['worker_kill', 'etcd_pause']\ninterval_s = [1.0, 2.0]\n")
    scenario = load_scenario(path)
    first = [(round(d, 6), s.kind) for d, s in scenario.random_faults(random.Random(7))]
    again = [(round(d, 6), s.kind) for d, s in scenario.random_faults(random.Random(7))]
    other = [(round(d, 6), s.kind) for d, s in scenario.random_faults(random.Random(8))]
    assert first == again != other
    assert len(first) == 20 and {k for _, k in first} == {"worker_kill", "etcd_pause"}
    assert all(1.0 <= d <= 2.0 for d, _ in first)


def test_proxy_passes_requests_through_and_storage_rides_out_its_faults(seaweed, s3_prefix):
    with S3FaultProxy(seaweed.endpoint_url, seed=3) as proxy:
        options = seaweed.storage_options(endpoint_url=proxy.endpoint_url, retry_timeout_s=30.0, max_attempts=20)
        storage = Storage(seaweed.url(s3_prefix), options)
        payload = bytes(range(256)) * 400
        storage.write_bytes("clean.bin", payload)
        assert storage.read_bytes("clean.bin") == payload
        assert storage.size_bytes("clean.bin") == len(payload)  # HEAD passes the object's size through
        assert sum(proxy.injected.values()) == 0

        proxy.set_faults(FaultRates(error=0.2, reset=0.1, truncate=0.1, latency=0.1, latency_s=0.05))
        for i in range(8):
            storage.write_bytes(f"f{i}.bin", payload[i:])
        for i in range(8):
            assert storage.read_bytes(f"f{i}.bin") == payload[i:]
        proxy.set_faults(None)
    injected = proxy.injected
    assert injected["error"] > 0 and injected["reset"] > 0 and injected["truncate"] > 0, injected
    direct = Storage(seaweed.url(s3_prefix), seaweed.storage_options())
    assert direct.read_bytes("f3.bin") == payload[3:]


def _report() -> dict:
    t0 = time.time()
    events = [
        {
            "time": t0 + 0.5,
            "event": "round_formed",
            "rank": -1,
            "node": "n0",
            "new_round": 1,
            "reason": "start",
            "members": ["n0", "n1"],
            "world_size": 2,
        },
        {"time": t0 + 1, "event": "worker_started", "rank": 0, "round": 1, "pid": 11},
        {"time": t0 + 1, "event": "worker_started", "rank": 1, "round": 1, "pid": 12},
        {"time": t0 + 3, "event": "ckpt_committed", "rank": 0, "round": 1, "step": 10},
        {"time": t0 + 4, "event": "chaos_fault", "rank": -2, "kind": "worker_kill", "node": "n1"},
        {"time": t0 + 4.5, "event": "workers_exited", "rank": -1, "node": "n1", "outcome": "failed"},
        {
            "time": t0 + 4.6,
            "event": "round_formed",
            "rank": -1,
            "node": "n0",
            "new_round": 2,
            "reason": "worker_exit",
            "members": ["n0", "n1"],
            "world_size": 2,
        },
        {"time": t0 + 9, "event": "resumed", "rank": 0, "round": 2, "step": 10},
    ]
    metrics = [{"step": s, "time": t0 + 1 + 0.2 * s, "loss": 4.0 - s / 10, "world_size": 2} for s in range(1, 16)]
    return {
        "scenario": "unit",
        "seed": 0,
        "ok": True,
        "started_at": t0,
        "events": events,
        "metrics": metrics,
        "faults": [
            {
                "index": 0,
                "kind": "worker_kill",
                "step": 15,
                "node": "n1",
                "detected_by": "workers_exited",
                "detection_s": 0.5,
                "new_round": 2,
                "recovery_s": 5.2,
                "resumed_step": 10,
                "lost_steps": 5,
            }
        ],
        "checks": [{"name": "job_finished", "ok": True, "detail": "step 15/15"}],
        "goodput": {"productive_s": 3.0, "wall_s": 10.0, "goodput": 0.3},
    }


@pytest.mark.skipif(
    find_browser() is None, reason="no headless Chromium installed (apt-get install chromium; .ci/run installs it)"
)
def test_report_renders_a_lane_per_node_and_rank_in_a_real_browser(tmp_path):
    write_report(tmp_path, _report())
    dom = dump_dom(tmp_path / "report.html")
    for lane in ("faults", "steps", "node n0", "node n1", "rank 0", "rank 1"):
        assert f'data-lane="{lane}"' in dom, lane
    assert 'data-rendered="6"' in dom
    assert dom.count('class="round"') == 4  # two rounds on two node lanes
    assert "worker_kill" in dom and "job_finished" in dom
    png = tmp_path / "report.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
