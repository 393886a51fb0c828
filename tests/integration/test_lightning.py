"""examples/lightning/train.py, a Lightning Fabric loop (an MLP under Fabric's DDP) with
ftrain.Session through ftrain.integrations.lightning, run as a user runs it: ``torchrun
--standalone`` from a directory of its own. Run straight, and stopped then run again, it ends with
the same weights bit for bit, and goes on at another world size. Under two ``ftrain agent
--script`` nodes, a SIGKILLed worker costs: with ``--recovery live``, nothing but a new round (the
surviving process keeps its PID and builds a new Fabric on the new round's group; the new process
takes the state from it, a live peer); with restart recovery, a restart of both from the newest
commit. Both runs end bitwise equal to the straight one. What cannot work is refused by name."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from ftrain.testbed.jobs import max_abs_diff, run, worker_env  # noqa: E402
from ftrain.testbed.procs import REPO, kill_tree  # noqa: E402
from ftrain.testbed.wait import wait_for  # noqa: E402
from tests.script_agents import (  # noqa: E402
    assert_agents_exit,
    events,
    rounds_formed,
    script_workers,
    served_by,
    start_agent,
    torchrun_script,
)

pytestmark = pytest.mark.timeout(400)

EXAMPLE = REPO / "examples" / "lightning" / "train.py"
#: ~20 ms a step on 2 CPU processes: a kill after step 40's commit lands while they train on
ARGS = ("--steps", "200", "--width", "1024", "--save-every", "40")


def _torchrun(cwd: Path, nproc: int, *args: str) -> str:
    return torchrun_script(EXAMPLE, cwd, nproc, *args)


def _committed(cwd: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (cwd / "runs/lightning/ckpt").glob("step-*/manifest.json"))


def _weights(where: Path) -> dict[str, torch.Tensor]:
    return torch.load(where / "final.pt", weights_only=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """The example on 2 processes, 200 steps, a save every 40, its metrics lines: its directory and output."""
    where = tmp_path_factory.mktemp("straight")
    return where, _torchrun(where, 2, *ARGS, "--final-weights", "final.pt", "--metrics", "metrics.jsonl")


def test_the_example_resumes_bitwise_at_another_world_size_and_refuses_what_cannot_work(tmp_path, straight):
    where, out = straight
    assert "training steps 1..200 on 2 process(es)" in out and "step 200 loss" in out, out
    assert _committed(where) == [120, 160, 200]  # keep_last=3
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0] / 2, losses  # it learns
    lines = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 201)), lines[:3]
    assert [round(line["loss"], 4) for line in lines[9::10]] == losses  # rank 0's loss, as the loop printed it
    manifest = json.loads((where / "runs/lightning/ckpt/step-000000200/manifest.json").read_text())
    assert manifest["layout"]["writer"] == "session"

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    _torchrun(stopped, 2, *ARGS, "--steps", "100")
    assert _committed(stopped) == [40, 80, 100]
    out = _torchrun(stopped, 2, *ARGS, "--final-weights", "final.pt")
    assert "resumed after step 100; training steps 101..200" in out, out
    assert "state of step 100 from storage" in out, out
    assert max_abs_diff(_weights(where), _weights(stopped)) == 0.0

    out = _torchrun(stopped, 1, *ARGS, "--steps", "210")  # one process now: Fabric's devices=1, DCP reshards
    assert "resumed after step 200; training steps 201..210 on 1 process(es)" in out and "step 210 loss" in out, out
    assert _committed(stopped)[-1] == 210

    refusals = run([sys.executable, "-c", REFUSALS], timeout_s=120, cwd=tmp_path, env=worker_env())
    assert refusals.returncode == 0, refusals.stdout[-4000:]
    said = dict(line.split(": ", 1) for line in refusals.stdout.splitlines() if line.startswith("refused "))
    assert "use strategy='ddp'" in said["refused fsdp"] and "GPUs only" in said["refused fsdp"], said
    assert "cannot join the session's process group" in said["refused ddp_spawn"], said
    assert "deepspeed and xla keep checkpoints" in said["refused deepspeed"], said
    assert "leave devices= out" in said["refused devices"], said
    assert "not started" in said["refused unstarted"], said
    assert "start_method='popen'" in said["refused start_method"], said
    assert "FSDP is only available on GPU" in said["refused fabric itself fsdp"], said  # Fabric's own refusal on CPU


#: one process, alone: each refusal's message (the session makes a group of one)
REFUSALS = """
import ftrain
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from ftrain.integrations.lightning import LightningError, session_fabric

def refused(name, call):
    try:
        call()
    except (LightningError, ValueError, RuntimeError, ImportError) as e:
        print(f"refused {name}: {type(e).__name__}: {e}".replace(chr(10), " "))
    else:
        raise SystemExit(f"{name} was not refused")

session = ftrain.Session("ckpt", verbose=False)
refused("unstarted", lambda: session_fabric(session))
with session:
    refused("fsdp", lambda: session_fabric(session, strategy="fsdp"))
    refused("ddp_spawn", lambda: session_fabric(session, strategy="ddp_spawn"))
    refused("deepspeed", lambda: session_fabric(session, strategy="deepspeed"))
    refused("devices", lambda: session_fabric(session, devices=2))
    refused("start_method", lambda: session_fabric(session, strategy=DDPStrategy(start_method="spawn")))
    try:
        Fabric(accelerator="cpu", strategy="fsdp", devices=1)
    except ValueError as e:
        print(f"refused fabric itself fsdp: {e}".replace(chr(10), " "))
    fabric = session_fabric(session)  # one process: Fabric's auto strategy, on the session's group of one
    assert (fabric.global_rank, fabric.world_size) == (0, 1)
"""


def _agent(tmp_path: Path, etcd, node: str, *options: str) -> subprocess.Popen:
    return start_agent(tmp_path, etcd.endpoint, node, EXAMPLE, *options, script_args=ARGS)


@pytest.mark.parametrize("recovery", ["live", "restart"])
def test_under_two_agents_a_killed_worker_costs_a_round_and_the_run_ends_as_the_straight_one(
    tmp_path, etcd, straight, recovery
):
    options = ("--recovery", recovery)
    agents = {n: _agent(tmp_path, etcd, n, *options) for n in ("a", "b")}
    try:
        wait_for(lambda: 40 in _committed(tmp_path), 180, "step 40's commit")
        if recovery == "live":
            (_, [victim]), *_ = served_by(tmp_path, "b")[-1:]
        else:
            [victim] = script_workers(agents["b"], EXAMPLE)
        os.kill(victim, signal.SIGKILL)
        assert_agents_exit(tmp_path, agents)
        assert rounds_formed(tmp_path) == ["start", "worker_exit"]
        assert [e["status"] for e in events(tmp_path) if e["event"] == "job_final"] == ["succeeded"]
        assert _committed(tmp_path)[-1] == 200
        manifest = json.loads((tmp_path / "runs/lightning/ckpt/step-000000200/manifest.json").read_text())
        assert manifest["job"] == "own" and manifest["round"] == 2  # written through the agent's fence, round 2
        worker_logs = "".join(p.read_text() for p in tmp_path.glob("*/workers.log"))
        if recovery == "live":
            served = served_by(tmp_path, "a")
            assert len(served) == 2 and len({pid for _, (pid,) in served}) == 1, served  # one process, both rounds
            assert "from live_peer" in worker_logs and "from storage" not in worker_logs, worker_logs[-4000:]
            assert "Traceback" not in worker_logs, worker_logs[-4000:]
        else:
            restarted = "".join(p.read_text() for p in tmp_path.glob("*/round-0002.log"))  # torchrun's, round 2
            resumed = re.findall(r"state of step (\d+) from storage", restarted)
            assert len(resumed) == 2 and len(set(resumed)) == 1 and int(resumed[0]) >= 40, restarted[-4000:]
        assert max_abs_diff(_weights(tmp_path), _weights(straight[0])) == 0.0
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_tree(agent)
