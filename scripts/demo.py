"""The demo job (``make demo``): two node agents train the demo config, checkpointing to a real
local S3 server, and survive a worker crash, the loss of a node and its return.

1. A local stack starts: etcd and SeaweedFS S3 on loopback (``ftrain local up`` does the same).
2. Two agents ("nodes" a and b) join job ``demo``; the leader forms round 1, each node runs
   ``--nproc`` worker(s) under torchrun, and training starts.
3. After step 60 a worker of node b is SIGKILLed: the agents form round 2. Under live recovery
   (the default) the other workers keep their processes, a warm spare takes the dead one's
   place and gets the state from a live peer; under ``--recovery restart`` every worker
   restarts and resumes from the newest committed checkpoint on S3.
4. After step 120 node a's agent is SIGKILLed (its workers follow it within a second): node b
   forms a smaller round alone and goes on (live: from its own memory; restart: resharded
   from the checkpoint).
5. Node a comes back: it joins at the next committed checkpoint (live: once its workers are
   warm) and the job grows again.

Nothing here restarts anything: the agents do. The summary lists the rounds and, for each
fault, whether the survivors kept their processes, the time to the first step after it, where
the state came from and the steps lost, and the final loss against the entropy floor.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftrain.agents.config import agent_flags
from ftrain.config import load_config
from ftrain.contract.events import Event, read_jsonl
from ftrain.data import build_source
from ftrain.observability.run_report import heals
from ftrain.testbed.stack import LocalStack

REPO = Path(__file__).resolve().parent.parent
AGENT_OPTIONS = agent_flags({"lease_ttl_s": 2, "settle_s": 1.0, "hang_timeout_s": 30.0, "backoff_initial_s": 0.5})
#: The variable the demo puts its checkpoint signing key in.
CKPT_KEY_ENV = "FTRAIN_DEMO_CKPT_KEY"


class Demo:
    def __init__(self, work: Path, stack: LocalStack, args: argparse.Namespace):
        self.work, self.stack, self.args = work, stack, args
        self.events_path = work / "events.jsonl"
        self.metrics_path = work / "metrics.jsonl"
        self.agents: dict[str, subprocess.Popen] = {}
        # checkpoints signed with a per-demo key, bound to job "demo" (docs/security.md)
        self.ckpt_key = secrets.token_hex(32)
        self.worker_args = [
            args.config,
            f"--checkpoint.uri={stack.s3.url('demo')}",
            # a commit every 25 steps: node a, back after step 120 and warm a few seconds later,
            # joins at a commit well before the end (every 50, its first chance was step 200)
            f"--checkpoint.interval={args.checkpoint_interval}",
            f"--checkpoint.hmac_key_env={CKPT_KEY_ENV}",
            f"--logging.metrics_path={self.metrics_path}",
            f"--logging.events_path={self.events_path}",
        ]

    def start_agent(self, node: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "ftrain",
            "agent",
            "--etcd",
            self.stack.etcd_url,
            "--job",
            "demo",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            str(self.args.nproc),
            "--node-id",
            node,
            "--run-dir",
            str(self.work / node),
            "--events",
            str(self.events_path),
            *AGENT_OPTIONS,
            *(["--recovery", self.args.recovery] if self.args.recovery else []),
            "--",
            *self.worker_args,
        ]
        env = {
            **os.environ,
            **self.stack.env(),
            "OMP_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "FTRAIN_LOG_LEVEL": "WARNING",
            CKPT_KEY_ENV: self.ckpt_key,
        }
        with open(self.work / f"agent-{node}.log", "ab") as log:
            self.agents[node] = subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        print(f"demo: started agent {node} (pid {self.agents[node].pid}, log {self.work / f'agent-{node}.log'})")

    def events(self, name: str = "") -> list[dict[str, Any]]:
        """The job's events named ``name`` (every one: ``""``)."""
        every = read_jsonl(self.events_path) if self.events_path.exists() else []
        return [e for e in every if e["event"] == name or not name]

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path) if self.metrics_path.exists() else []

    def step(self) -> int:
        return max((m["step"] for m in self.metrics()), default=0)

    def wait(self, predicate, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if all(p.poll() is not None for p in self.agents.values()):
                raise RuntimeError(f"every agent exited while waiting for {what}")
            time.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    def worker_pids(self, node: str) -> list[int]:
        started = [e for e in self.events(Event.WORKER_STARTED) if e.get("node") == node]
        newest = max((e["round"] for e in started), default=None)
        return [e["pid"] for e in started if e["round"] == newest]

    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def restored_rounds(demo: Demo) -> list[int]:
    """Rounds whose workers have their state (a checkpoint load, or a live restore)."""
    return [e["round"] for name in (Event.RESUMED, Event.LIVE_RESTORED) for e in demo.events(name)]


def describe_recovery(demo: Demo, at: float) -> str:
    """How the job came back from a fault at ``at``: the round formed after it, whether the
    survivors kept their processes, where the state came from, the time to the first step after
    it and the steps lost."""
    rounds = sorted((e for e in demo.events(Event.ROUND_FORMED) if e["time"] > at), key=lambda e: e["time"])
    if not rounds:
        return "no new round"
    r = rounds[0]["new_round"]
    kept = sum(len(e["kept"]) for e in demo.events(Event.WORKERS_REASSIGNED) if e["worker_round"] == r)
    new = sum(len(e["started"]) for e in demo.events(Event.WORKERS_REASSIGNED) if e["worker_round"] == r)
    if any(e["worker_round"] == r for e in demo.events(Event.WORKERS_STARTED)):
        processes = "every worker restarted"
    else:
        processes = f"{kept} worker(s) kept their process, {new} new (spares)"
    metrics = demo.metrics()
    heal = next((h for h in heals(metrics, demo.events()) if h["round"] == r), None)  # what ftrain report says
    if heal is None:
        return f"round {r}: {processes}; not resumed"
    source = ", ".join(f"{_SOURCES.get(s, s)} ({n} rank(s))" for s, n in heal["sources"].items())
    after = [m["time"] for m in metrics if m["time"] > heal["done_at"]]
    first = f"first step {min(after) - at:.1f} s after the fault" if after else "no step after it"
    lost = heal["steps_redone"] or 0
    return f"round {r}: {processes}; state from {source} at step {heal['step']}; {first}; {lost} step(s) lost"


_SOURCES = {
    "live_peer": "a live peer",
    "memory": "their own memory",
    "memory_tier": "the memory tier (a buddy's copy)",
    "storage": "storage",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    parser.add_argument("--nproc", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--worker-kill-step", type=int, default=60)
    parser.add_argument("--node-kill-step", type=int, default=120)
    parser.add_argument("--checkpoint-interval", type=int, default=25, help="steps between commits (default 25)")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--recovery", choices=("live", "restart"), default=None, help="default: the agents' default")
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    floor = build_source(cfg.data, cfg.model).entropy_floor_nats
    work = Path(tempfile.mkdtemp(prefix="ftrain-demo-"))
    print(f"demo: working directory {work}")
    with LocalStack(work / "stack") as stack:
        print(
            f"demo: etcd at {stack.etcd_url}, S3 (SeaweedFS) at {stack.s3.endpoint_url}, "
            f"checkpoints to {stack.s3.url('demo')}"
        )
        demo = Demo(work, stack, args)
        faults: list[tuple[str, float]] = []
        try:
            demo.start_agent("a")
            demo.start_agent("b")
            demo.wait(lambda: demo.step() >= args.worker_kill_step, args.timeout_s, f"step {args.worker_kill_step}")
            victim = demo.worker_pids("b")[0]
            print(f"demo: step {demo.step()}: SIGKILL worker {victim} of node b")
            os.kill(victim, signal.SIGKILL)
            faults.append(("worker killed", time.time()))

            demo.wait(lambda: demo.step() >= args.node_kill_step, args.timeout_s, f"step {args.node_kill_step}")
            print(f"demo: step {demo.step()}: SIGKILL agent of node a (pid {demo.agents['a'].pid}): node lost")
            demo.agents["a"].send_signal(signal.SIGKILL)
            demo.agents["a"].wait()
            faults.append(("node lost", time.time()))
            demo.wait(lambda: max(restored_rounds(demo), default=0) >= 3, args.timeout_s, "the smaller round to resume")
            print(f"demo: step {demo.step()}: node a comes back")
            demo.start_agent("a")
            code = demo.agents["b"].wait(timeout=args.timeout_s)
            demo.agents["a"].wait(timeout=60)
        finally:
            demo.close()
        return summarize(demo, faults, floor, cfg.train.steps, code)


def summarize(demo: Demo, faults: list[tuple[str, float]], floor: float, steps: int, code: int) -> int:
    metrics = demo.metrics()
    final = demo.events(Event.JOB_FINAL)
    print("\n== ftrain demo summary ==")
    print(f"job: {final[0]['status'] if final else 'no final status'} (agent exit {code}); steps {demo.step()}/{steps}")
    for r in sorted(demo.events(Event.ROUND_FORMED), key=lambda e: e["new_round"]):
        print(
            f"  round {r['new_round']}: {r['reason']:<12} members {', '.join(r['members'])} "
            f"(world size {r['world_size']})"
        )
    print(f"new rounds after the first: {len(demo.events(Event.ROUND_FORMED)) - 1}")
    for name, at in faults:
        print(f"  {name}: {describe_recovery(demo, at)}")
    loss = metrics[-1]["loss"] if metrics else float("nan")
    print(f"final loss {loss:.4f} vs entropy floor {floor:.4f} (+{loss - floor:.4f} nats)")
    ok = bool(final) and final[0]["status"] == "succeeded" and demo.step() == steps and code == 0
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
