"""examples/hf_trainer/train.py, a Hugging Face ``Trainer`` with ftrain's checkpoints through
``ftrain.integrations.hf_trainer``, run as a user runs it (``torchrun --standalone``, 2 processes,
DDP on gloo; and plain ``python``, its loss in ftrain's metrics lines). A run SIGKILLed after a
commit and started again resumes after the newest committed step with the optimizer and scheduler
state the straight run had there, and ends bitwise equal to it; a Trainer set up to write its own
checkpoints is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrain.checkpoint.storage import Storage
from ftrain.contract import exits
from ftrain.testbed.jobs import run, worker_env
from ftrain.testbed.procs import REPO, kill_tree
from ftrain.testbed.wait import wait_for
from tests.script_agents import assert_agents_exit, rounds_formed, script_workers, served_by, start_agent

pytestmark = pytest.mark.timeout(300)

EXAMPLE = REPO / "examples" / "hf_trainer" / "train.py"
PROBE = REPO / "tests" / "integration" / "hf_trainer_probe.py"
STEPS, EVERY = 60, 5
#: 64 sequences are 8 steps of 2 x 4: the run crosses epochs, and resumes inside one
ARGS = ("--steps", str(STEPS), "--save-every", str(EVERY), "--samples", "64", "--final-weights", "final.pt")


def _torchrun(dumps: str, *args: str) -> list[str]:
    """The example under the probe (it writes the optimizer and scheduler states to ``dumps``)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return [*launch, str(PROBE), dumps, str(EVERY), "--", *args]


def _finished(cwd: Path, cmd: list[str]) -> str:
    out = run(cmd, timeout_s=120, cwd=cwd, env=worker_env())
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


def _committed(cwd: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (cwd / "runs/hf_trainer/ckpt").glob("step-*/manifest.json"))


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal nested state: tensors bit for bit, the rest by ==."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b)
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """The probed example on 2 processes without a fault: its directory and output."""
    where = tmp_path_factory.mktemp("straight")
    return where, _finished(where, _torchrun("dumps", *ARGS))


@pytest.mark.dist
def test_a_killed_run_resumes_after_the_newest_commit_and_ends_as_the_straight_one(tmp_path, straight):
    (straight, out), stopped = straight, tmp_path / "stopped"
    stopped.mkdir()
    assert f"trained steps 1..{STEPS} on 2 process(es)" in out, out
    assert _committed(straight)[-1] == STEPS
    losses = [float(x) for x in re.findall(r"'loss': '([0-9.]+)'", out)]
    assert losses[-1] < losses[0] / 2, losses  # it learns the counting pattern

    proc = subprocess.Popen(
        _torchrun("dumps-1", *ARGS), cwd=stopped, env=worker_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: 10 in _committed(stopped), 120, "step 10's commit", alive=lambda: proc.poll() is None)
        kill_tree(proc)  # SIGKILL, every process of the run, while it trains on
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    newest = _committed(stopped)[-1]
    assert 10 <= newest < STEPS, _committed(stopped)

    out = _finished(stopped, _torchrun("dumps-2", *ARGS))
    assert f"resumed after step {newest}; trained steps {newest + 1}..{STEPS} on 2 process(es)" in out, out
    assert out.count(f"ftrain: resumed after step {newest}, loaded from") == 1, out  # rank 0 says it, once
    resumed = torch.load(stopped / "dumps-2" / "begin.pt", weights_only=True)  # what training went on from
    saved = torch.load(straight / "dumps" / f"step-{newest}.pt", weights_only=True)
    assert resumed["step"] == saved["step"] == newest
    assert resumed["optim"]["state"], "AdamW's moments were restored"
    _assert_same(resumed["optim"], saved["optim"], "optim")
    _assert_same(resumed["sched"], saved["sched"], "sched")  # its step count and learning rate
    a, b = (torch.load(d / "final.pt", weights_only=True) for d in (straight, stopped))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
@pytest.mark.parametrize("recovery", ["restart", "live"])
def test_under_two_agents_a_killed_worker_is_replaced_and_the_trainer_resumes(tmp_path, etcd, straight, recovery):
    """Supervision by the node agents: a SIGKILLed worker of node b is seen; under restart
    recovery both nodes' workers restart and the Trainer resumes after the newest commit; under
    live recovery node a's process keeps its PID, a spare takes node b's rank, and the new round's
    Trainers go on from the step node a's process held (a live peer, not storage). Either way
    the run ends bitwise equal to the straight one."""
    options = ("--recovery", recovery)
    agents = {n: start_agent(tmp_path, etcd.endpoint, n, EXAMPLE, *options, script_args=ARGS[:-2]) for n in "ab"}
    try:
        wait_for(lambda: 10 in _committed(tmp_path), 180, "step 10's commit")
        if recovery == "restart":
            victims = script_workers(agents["b"], EXAMPLE)
        else:
            (_, victims), *_ = served_by(tmp_path, "b")[-1:]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        assert_agents_exit(tmp_path, agents)
        assert rounds_formed(tmp_path) == ["start", "worker_exit"]
        if recovery == "restart":
            second = "".join(p.read_text() for p in tmp_path.glob("*/round-0002.log"))
            resumed = re.findall(r"resumed after step (\d+); trained steps", second)
            assert resumed and 10 <= int(resumed[0]) < STEPS, second[-3000:]
        else:
            served = served_by(tmp_path, "a")
            assert len(served) == 2 and len({pid for _, (pid,) in served}) == 1, served  # one process, both rounds
            logs = "".join((tmp_path / n / "workers.log").read_text() for n in "ab")  # rank 0 says it
            healed = re.findall(r"resumed after step (\d+), from rank \d's memory \(a live peer\)", logs)
            assert healed and 10 <= int(healed[0]) < STEPS, logs[-3000:]
            assert "Traceback" not in logs, logs[-3000:]
        a, b = (torch.load(d / "final.pt", weights_only=True) for d in (straight[0], tmp_path))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_tree(agent)


@pytest.mark.dist
def test_under_live_agents_a_drained_node_leaves_and_the_trainer_goes_on_alone_in_the_same_process(tmp_path, etcd):
    """SIGTERM to node b's agent (a drain, --nnodes 1:2): b's Trainer stops at a committed step
    and its agent exits 75; node a's process builds the next round's Trainer at world size 1
    (accelerate's process state of the 2-process round is replaced) and finishes the job."""
    options = ("--recovery", "live", "--nnodes", "1:2")
    agents = {n: start_agent(tmp_path, etcd.endpoint, n, EXAMPLE, *options, script_args=ARGS[:-2]) for n in "ab"}
    try:
        wait_for(lambda: 10 in _committed(tmp_path), 180, "step 10's commit")
        agents["b"].send_signal(signal.SIGTERM)
        assert_agents_exit(tmp_path, agents, {"a": exits.OK, "b": exits.DRAINED})
        served = served_by(tmp_path, "a")
        assert len(served) == 2 and len({pid for _, (pid,) in served}) == 1, served  # one process, both rounds
        logs = (tmp_path / "a" / "workers.log").read_text()
        alone = re.findall(r"resumed after step (\d+); trained steps \d+\.\.(\d+) on 1 process\(es\)", logs)
        assert alone and 10 <= int(alone[0][0]) < STEPS and int(alone[0][1]) == STEPS, logs[-3000:]
        assert "Traceback" not in logs, logs[-3000:]
        assert _committed(tmp_path)[-1] == STEPS
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_tree(agent)


def test_plain_python_runs_the_example_as_one_process_with_its_checkpoints_on_s3(tmp_path, seaweed, s3_prefix):
    cmd = [sys.executable, str(EXAMPLE), "--steps", "10", "--save-every", "5", "--samples", "64"]
    cmd += ["--ckpt", seaweed.url(s3_prefix), "--metrics", "metrics.jsonl"]
    out = run(cmd, timeout_s=120, cwd=tmp_path, env=worker_env(**seaweed.env()))
    assert out.returncode == 0, out.stdout[-4000:]
    assert "trained steps 1..10 on 1 process(es)" in out.stdout, out.stdout
    # a metrics line per step with its loss: the Trainer's own log (every 10 steps) is their mean
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 11)) and {line["world_size"] for line in lines} == {1}
    logged = [float(x) for x in re.findall(r"'loss': '([0-9.]+)'", out.stdout)]
    assert len(logged) == 1 and abs(sum(line["loss"] for line in lines) / 10 - logged[0]) < 1e-3, (logged, lines)
    storage = Storage(seaweed.url(s3_prefix), seaweed.storage_options())
    assert [s for s in (5, 10) if storage.exists(f"step-{s:09d}/manifest.json")] == [5, 10]


def test_a_trainer_that_writes_its_own_checkpoints_or_an_unstarted_session_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import ftrain
    from ftrain.integrations.hf_trainer import FtrainTrainer, HFTrainerError

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)

    def args(**more: Any) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **more)

    session = ftrain.Session(str(tmp_path / "ckpt"))  # not started: nothing happens yet
    with pytest.raises(HFTrainerError, match=r"save_strategy='steps'.*pass save_strategy='no'"):
        FtrainTrainer(session, model=model, args=args())  # the Trainer's default saves every 500 steps
    with pytest.raises(HFTrainerError, match=r"not started.*ftrain\.Session\(\.\.\.\)\.start\(\)"):
        FtrainTrainer(session, model=model, args=args(save_strategy="no"))
    assert not (tmp_path / "ckpt").exists()


def test_a_log_history_past_16_mib_with_a_nan_loss_is_committed_and_comes_back(tmp_path, monkeypatch):
    """``logging_steps=1`` for 160k steps: a TrainerState past the 16 MiB that a manifest holds,
    committed and loaded back exactly (a NaN loss too), in one process."""
    import math

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import ftrain
    from ftrain.checkpoint.manifest import MAX_MANIFEST_BYTES
    from ftrain.integrations.hf_trainer import FtrainTrainer, _TrainerStateEntry

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FTRAIN_HEARTBEAT", "FTRAIN_JOB", "FTRAIN_CONTROL"):
        monkeypatch.delenv(key, raising=False)
    steps = 160_000
    history: list[dict[str, Any]] = [
        {
            "loss": 2.5 - i * 1e-5,
            "grad_norm": 1.0 + i * 1e-7,
            "learning_rate": 3e-4 * (1 - i / steps),
            "epoch": i / 4096,
            "step": i,
        }
        for i in range(1, steps)
    ]
    history.append(
        {"loss": math.nan, "grad_norm": math.inf, "learning_rate": 0.0, "epoch": steps / 4096, "step": steps}
    )
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path), save_strategy="no", report_to="none", use_cpu=True, logging_steps=1
    )
    try:
        with ftrain.Session(str(tmp_path / "ckpt"), verbose=False) as session:
            trainer = FtrainTrainer(session, model=LlamaForCausalLM(config), args=args)
            trainer.state.global_step, trainer.state.log_history = steps, history
            assert session.finish(steps, {"trainer": _TrainerStateEntry(trainer)}).last_committed_step == steps
        state_file = tmp_path / "ckpt" / f"step-{steps:09d}" / "user_state.json"
        assert state_file.stat().st_size > MAX_MANIFEST_BYTES
        with ftrain.Session(str(tmp_path / "ckpt"), verbose=False) as session:
            back = _TrainerStateEntry(FtrainTrainer(session, model=LlamaForCausalLM(config), args=args))
            assert session.load({"trainer": back}) == steps
            got = back.trainer_state_to_resume(steps)["log_history"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert got[:-1] == history[:-1]
    assert math.isnan(got[-1]["loss"]) and got[-1]["grad_norm"] == math.inf
