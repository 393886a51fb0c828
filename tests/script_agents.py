"""``ftrain agent --script`` nodes for the tests of users' loops (examples/own_loop, examples/hf_trainer):
start one, find its script's processes, read what it logged about its rounds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from ftrain.agents.workers import descendants, dump_stacks
from ftrain.testbed.jobs import max_abs_diff, run, worker_env
from ftrain.testbed.procs import kill_tree, quiet_env


def start_agent(
    where: Path, etcd_endpoint: str, node: str, script: Path, *options: str, script_args: tuple[str, ...] = ()
) -> subprocess.Popen:
    """Node ``node`` of job ``own`` (2:2 nodes of one process each, unless ``options`` say otherwise),
    running ``script`` from ``where`` with ``--final-weights final.pt`` and ``script_args``."""
    cmd = [
        sys.executable, "-m", "ftrain", "agent", "--etcd", etcd_endpoint, "--job", "own", "--nnodes", "2:2",
        "--nproc-per-node", "1", "--node-id", node, "--run-dir", str(where / node), "--lease-ttl-s", "2",
        "--settle-s", "0.5", "--backoff-initial-s", "0.2", "--events", str(where / "events.jsonl"), *options,
        "--script", str(script), "--", "--final-weights", "final.pt", *script_args,
    ]  # fmt: skip
    with open(where / f"agent-{node}.log", "ab") as log:
        return subprocess.Popen(
            cmd, cwd=where, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=quiet_env()
        )


def torchrun_script(script: Path, cwd: Path, nproc: int, *args: str) -> str:
    """``script ARGS`` under ``torchrun --standalone`` on ``nproc`` processes, run from ``cwd`` as a
    user runs it: its output (asserted to have succeeded)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    out = run([*cmd, *args], timeout_s=180, cwd=cwd, env=worker_env())
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


def script_workers(agent: subprocess.Popen, script: Path) -> list[int]:
    """The script's processes under ``agent`` (torchrun's children, not torchrun)."""
    tail = f"{script.parent.name}/{script.name}".encode()
    out = []
    for pid in descendants(agent.pid):
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(w.endswith(tail) for w in words) and b"torch.distributed.run" not in words:
            out.append(pid)
    return out


def served_by(where: Path, node: str) -> list[tuple[int, list[int]]]:
    """(round, pids) for each round the node's live agent served, from its log."""
    text = (where / f"agent-{node}.log").read_text()
    found = re.findall(r"round (\d+): local ranks served by pids \[([\d, ]+)\]", text)
    return [(int(r), [int(p) for p in pids.split(",")]) for r, pids in found]


def events(where: Path) -> list[dict]:
    path = where / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def rounds_formed(where: Path) -> list[str]:
    """The reason of each round formed, in round order."""
    formed = [e for e in events(where) if e["event"] == "round_formed"]
    return [e["reason"] for e in sorted(formed, key=lambda e: e.get("new_round", 0))]


def committed_steps(ckpt: Path) -> list[int]:
    """The steps committed under the local checkpoint directory ``ckpt`` (those with a manifest)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in ckpt.glob("step-*/manifest.json"))


def snapshots_complete(where: Path, step: int, *, since_round: int = 0) -> bool:
    """Both ranks kept a memory-tier snapshot of ``step`` or later, in round ``since_round`` or a
    later one (their sessions' events)."""
    return {
        e["rank"]
        for e in events(where)
        if e["event"] == "memory_snapshot" and e["step"] >= step and e.get("round", 0) >= since_round
    } >= {0, 1}


def assert_ends_as(where: Path, golden: Path) -> None:
    """The run in ``where`` ended with the weights of ``golden`` (its ``final.pt``), bit for bit."""
    final = torch.load(where / "final.pt", weights_only=True)
    assert max_abs_diff(final, torch.load(golden, weights_only=True)) == 0.0


def assert_agents_exit(
    where: Path, agents: dict[str, subprocess.Popen], expected: dict[str, int] | int = 0, *, timeout_s: float = 240
) -> None:
    """Every agent exits with its expected code (``expected``: one for all, or by node) within
    ``timeout_s`` in all. One that does not fails the test with what shows why: each node's log
    tail, the Python stacks of the processes still running under it, the job's last events."""
    deadline = time.monotonic() + timeout_s
    for node, agent in agents.items():
        want = expected if isinstance(expected, int) else expected[node]
        try:
            code = agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {node} still runs after {timeout_s:.0f}s\n{_why_running(where, agents)}"
            ) from None
        assert code == want, f"agent {node} exited {code}, not {want}\n" + _log_tail(where / f"agent-{node}.log")


def _log_tail(path: Path, size_chars: int = 3000) -> str:
    return f"--- {path.name} ({path.parent.name}):\n" + (
        path.read_text(errors="replace")[-size_chars:] if path.exists() else "(none)"
    )


def _why_running(where: Path, agents: dict[str, subprocess.Popen]) -> str:
    parts = ["--- last events:\n" + "\n".join(json.dumps(e) for e in events(where)[-30:])]
    for node, agent in agents.items():
        parts += [_log_tail(where / f"agent-{node}.log"), _log_tail(where / node / "workers.log")]
        if agent.poll() is None:
            stack_dir = where / node / "stacks"
            stack_dir.mkdir(parents=True, exist_ok=True)
            stacks = dump_stacks(_dumping(descendants(agent.pid)), str(stack_dir))
            parts += [f"--- stacks on {node}, pid {pid}:\n{text[-4000:]}" for pid, text in stacks.items()]
    return "\n".join(parts)


def _dumping(pids: list[int]) -> list[int]:
    """The processes that dump their stack on SIGUSR1 (a worker's: it registered the handler where
    its agent set ``FTRAIN_STACK_DIR``); the signal would end any other."""
    out = []
    for pid in pids:
        try:
            if b"FTRAIN_STACK_DIR=" in Path(f"/proc/{pid}/environ").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def stop_agents(agents: dict[str, subprocess.Popen]) -> None:
    """Every agent still running, with every process under it."""
    for agent in agents.values():
        if agent.poll() is None:
            kill_tree(agent)
