"""Faults that act on real processes and servers, and the trigger points they wait for.

A :class:`FaultSpec` names a kind, a trigger (``at_step`` and/or ``at_time_s`` since the run
began; ``kill_during_save`` and ``kill_during_load`` then also wait for an upload in flight or a
load under way) and the kind's parameters. :func:`inject` waits for the
trigger, acts, and records a ``chaos_fault`` event in the job's event log (the time it acted,
the kind, the target, details), which the invariants later match against what the agents and
workers recorded.

Kinds: ``worker_kill`` (any signal), ``agent_kill`` (node loss; ``with_workers`` kills the
host's workers too, ``restart_after_s`` brings the node back), ``worker_hang`` (SIGSTOP),
``worker_slow`` (stop/continue duty cycle), ``etcd_pause``, ``etcd_restart``, ``s3_outage``
(server stopped, then restarted), ``s3_faults`` (the proxy injects 5xx, latency, resets and
truncated bodies), ``ckpt_corrupt`` (bit flip, truncate, delete, manifest edit on the newest
committed step, then a worker kill so that a load meets it), ``kill_during_save``,
``kill_during_load``, ``duplicate_node`` (a second agent with a live node id must be refused)
and ``zombie_commit`` (a worker of an old round tries to save into the job's checkpoints).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.etcd import EtcdClient
from agents.records import JobKeys
from chaos.cluster import Cluster, WaitTimeout, quiet_env, wait_for
from chaos.corrupt import MODES as CORRUPTION_MODES
from chaos.corrupt import corrupt_step
from chaos.s3proxy import FaultRates, S3FaultProxy
from checkpoint.catalog import list_steps, newest_committed
from checkpoint.storage import Storage
from contract.events import EventLog
from ftrain.heartbeat import process_gone

log = logging.getLogger(__name__)

KINDS = ("worker_kill", "agent_kill", "worker_hang", "worker_slow", "etcd_pause", "etcd_restart", "s3_outage",
         "s3_faults", "ckpt_corrupt", "kill_during_save", "kill_during_load", "duplicate_node", "zombie_commit")
#: Faults after which the job must restart (a new round); the others it should ride out.
RESTARTING = frozenset({"worker_kill", "agent_kill", "worker_hang", "ckpt_corrupt", "kill_during_save",
                        "kill_during_load"})
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGSEGV": signal.SIGSEGV,
           "SIGABRT": signal.SIGABRT, "SIGINT": signal.SIGINT}


class FaultError(RuntimeError):
    """A fault could not be applied (its target never appeared): the scenario is at fault."""


@dataclass(slots=True)
class FaultSpec:
    kind: str
    at_step: int | None = None
    at_time_s: float | None = None
    node: str = ""  #: target node (default: a seeded choice among live ones)
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}: one of {', '.join(KINDS)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultSpec:
        d = dict(d)
        known = {k: d.pop(k) for k in ("kind", "at_step", "at_time_s", "node") if k in d}
        return cls(**known, params=d)


@dataclass(slots=True)
class Context:
    """What faults act on."""
    cluster: Cluster
    etcd: Any  #: agents.etcd_server.EtcdServer
    s3: Any  #: checkpoint.seaweed.SeaweedS3
    proxy: S3FaultProxy
    storage: Storage  #: the job's checkpoint root
    rng: random.Random
    events: EventLog
    started_at: float
    stop: Callable[[], bool] = lambda: False  #: the run is over: stop waiting for triggers

    def emit(self, kind: str, **detail: Any) -> dict[str, Any]:
        record = {"kind": kind, **detail}
        self.events.emit("chaos_fault", **record)
        log.warning("chaos: injected %s %s", kind, detail)
        return record


# -- targets ---------------------------------------------------------------------------------
def _current_round(ctx: Context) -> int:
    rounds = ctx.cluster.events("round_formed")
    return max((e["new_round"] for e in rounds), default=0)


def _running_nodes(ctx: Context) -> list[str]:
    """Live nodes whose workers of the current round have started."""
    g = _current_round(ctx)
    return sorted(n for n in ctx.cluster.live_nodes() if ctx.cluster.worker_pids(n, g))


def _pick_node(ctx: Context, spec: FaultSpec) -> str:
    nodes = wait_for(lambda: _running_nodes(ctx), 120, "a node with running workers")
    if spec.node:
        wait_for(lambda: spec.node in _running_nodes(ctx), 120, f"node {spec.node} to run workers")
        return spec.node
    return ctx.rng.choice(nodes)


def _pick_worker(ctx: Context, spec: FaultSpec) -> tuple[str, int]:
    """A live worker of the current round (waiting while a restart is under way)."""
    def pick() -> tuple[str, int] | None:
        node = _pick_node(ctx, spec)
        pids = [p for p in ctx.cluster.worker_pids(node, _current_round(ctx)) if not process_gone(p)]
        return (node, ctx.rng.choice(sorted(pids))) if pids else None

    try:
        return wait_for(pick, 120, "a live worker", poll_s=0.1)
    except WaitTimeout:
        raise FaultError("no live worker to act on within 120 s") from None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- triggers --------------------------------------------------------------------------------
def _in_flight_upload(ctx: Context) -> int | None:
    committed = {e["step"] for e in ctx.cluster.events("ckpt_committed")}
    failed = {e["step"] for e in ctx.cluster.events("ckpt_failed")}
    staged = [e["step"] for e in ctx.cluster.events("ckpt_staged")]
    pending = [s for s in staged if s not in committed and s not in failed]
    return pending[-1] if pending else None


def _loading(ctx: Context, after: float) -> bool:
    started = [e for e in ctx.cluster.events("resume_started") if e["time"] > after]
    done = {(e["round"], e["rank"]) for e in ctx.cluster.events("resumed")}
    return any((e["round"], e["rank"]) not in done for e in started)


def wait_trigger(ctx: Context, spec: FaultSpec, timeout_s: float) -> None:
    def until(predicate: Callable[[], Any], what: str) -> Any:
        return wait_for(lambda: predicate() or ctx.stop(), timeout_s, what, poll_s=0.01)

    if spec.at_time_s is not None:
        until(lambda: time.time() - ctx.started_at >= spec.at_time_s, f"t={spec.at_time_s}s")
    if spec.at_step is not None:
        until(lambda: ctx.cluster.step() >= spec.at_step, f"step {spec.at_step}")


# -- the faults ------------------------------------------------------------------------------
def _worker_kill(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = _pick_worker(ctx, spec)
    name = spec.params.get("signal", "SIGKILL")
    _signal(pid, SIGNALS[name])
    return ctx.emit("worker_kill", node=node, pid=pid, signal=name, step=ctx.cluster.step())


def _agent_kill(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node = _pick_node(ctx, spec)
    workers = ctx.cluster.worker_pids(node)
    ctx.cluster.kill_agent(node)
    if spec.params.get("with_workers", True):  # the whole host is gone, not just its agent
        for pid in workers:
            _signal(pid, signal.SIGKILL)
    record = ctx.emit("agent_kill", node=node, pid=ctx.cluster.agents[node].pid, step=ctx.cluster.step())
    ctx.cluster.agents[node].wait()
    restart_after_s = spec.params.get("restart_after_s")
    if restart_after_s is not None:
        # the host comes back once the job has seen it gone (its lease expired: a node id whose
        # lease is alive is refused), plus restart_after_s
        with EtcdClient([ctx.cluster.etcd], timeout_s=2.0, retry_timeout_s=10.0) as client:
            key = JobKeys(ctx.cluster.job).node(node)
            wait_for(lambda: ctx.stop() or client.get(key) is None, 60, f"node {node}'s lease to expire", poll_s=0.1)
        time.sleep(float(restart_after_s))
        ctx.cluster.restart(node)
        ctx.events.emit("chaos_node_back", node=node)  # part of this fault, not a new one
    return record


def _worker_hang(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = _pick_worker(ctx, spec)
    _signal(pid, signal.SIGSTOP)
    return ctx.emit("worker_hang", node=node, pid=pid, step=ctx.cluster.step())


def _worker_slow(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = _pick_worker(ctx, spec)
    duration_s = float(spec.params.get("duration_s", 5.0))
    stop_s, run_s = float(spec.params.get("stop_s", 0.1)), float(spec.params.get("run_s", 0.2))
    record = ctx.emit("worker_slow", node=node, pid=pid, duration_s=duration_s, step=ctx.cluster.step())
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end and not process_gone(pid):
            _signal(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            _signal(pid, signal.SIGCONT)
            time.sleep(run_s)
    finally:
        _signal(pid, signal.SIGCONT)
    return record


def _outage(ctx: Context, spec: FaultSpec, default_s: float, begin: Callable[[], None],
            end: Callable[[], None]) -> dict[str, Any]:
    """A server is unavailable for ``duration_s`` (the fault's own length), then back."""
    duration_s = float(spec.params.get("duration_s", default_s))
    begin()
    record = ctx.emit(spec.kind, duration_s=duration_s, step=ctx.cluster.step())
    try:
        time.sleep(duration_s)
    finally:
        end()
    return record


def _etcd_pause(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    return _outage(ctx, spec, 4.0, ctx.etcd.pause, ctx.etcd.resume)


def _etcd_restart(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    return _outage(ctx, spec, 3.0, ctx.etcd.stop, lambda: ctx.etcd.restart(timeout_s=30))


def _s3_outage(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    return _outage(ctx, spec, 4.0, ctx.s3.stop, lambda: ctx.s3.restart(timeout_s=60))


def _s3_faults(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    duration_s = float(spec.params.get("duration_s", 8.0))
    rates = FaultRates(error=float(spec.params.get("error", 0.1)), latency=float(spec.params.get("latency", 0.1)),
                       reset=float(spec.params.get("reset", 0.05)), truncate=float(spec.params.get("truncate", 0.05)),
                       latency_s=float(spec.params.get("latency_s", 0.3)))
    before = dict(ctx.proxy.injected)
    ctx.proxy.set_faults(rates)
    record = ctx.emit("s3_faults", duration_s=duration_s, rates=str(rates), step=ctx.cluster.step())
    try:
        time.sleep(duration_s)
    finally:
        ctx.proxy.set_faults(None)
    record["injected"] = {k: v - before[k] for k, v in ctx.proxy.injected.items()}
    ctx.events.emit("chaos_fault_done", kind="s3_faults", injected=record["injected"])
    return record


def _ckpt_corrupt(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    mode = spec.params.get("mode") or ctx.rng.choice(CORRUPTION_MODES)
    info = wait_for(lambda: newest_committed(list_steps(ctx.storage)), 120, "a committed checkpoint")
    damaged = corrupt_step(ctx.storage, info.dirname, mode, ctx.rng)
    record = ctx.emit("ckpt_corrupt", ckpt_step=info.step, ckpt_created_time=info.manifest.created_time, mode=mode,
                      file=damaged, step=ctx.cluster.step())
    if spec.params.get("then_kill", True):  # make a load meet it
        node, pid = _pick_worker(ctx, FaultSpec("worker_kill", node=spec.node))
        _signal(pid, signal.SIGKILL)
        record.update(node=node, pid=pid)
    return record


def _with_slow_storage(ctx: Context, latency_s: float, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Widen the window (uploads and loads take a fraction of a second here) by slowing S3."""
    ctx.proxy.set_faults(FaultRates(latency=1.0, latency_s=latency_s))
    try:
        return action()
    finally:
        ctx.proxy.set_faults(None)


def _kill_during_save(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    def act() -> dict[str, Any]:
        step = wait_for(lambda: _in_flight_upload(ctx), 120, "a checkpoint upload in flight", poll_s=0.01)
        node, pid = _pick_worker(ctx, spec)
        _signal(pid, signal.SIGKILL)
        return ctx.emit("kill_during_save", node=node, pid=pid, ckpt_step=step, step=ctx.cluster.step())

    return _with_slow_storage(ctx, float(spec.params.get("latency_s", 0.2)), act)


def _kill_during_load(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    """A kill forces a restart (the fault starts there); the restarted workers are killed while
    they load (recorded as a ``chaos_fault_step`` of the same fault)."""
    def act() -> dict[str, Any]:
        node, pid = _pick_worker(ctx, spec)
        t0 = time.time()
        _signal(pid, signal.SIGKILL)
        record = ctx.emit("kill_during_load", node=node, pid=pid, step=ctx.cluster.step())
        wait_for(lambda: _loading(ctx, t0), 120, "a checkpoint load", poll_s=0.01)
        victim_node, victim = _pick_worker(ctx, FaultSpec("worker_kill", node=spec.node))
        _signal(victim, signal.SIGKILL)
        ctx.events.emit("chaos_fault_step", kind="kill_during_load", node=victim_node, pid=victim,
                        during="load")
        record.update(load_victim=victim)
        return record

    return _with_slow_storage(ctx, float(spec.params.get("latency_s", 0.3)), act)


def _duplicate_node(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node = _pick_node(ctx, spec)
    dup = subprocess.run([sys.executable, "-m", "ftrain", "agent", "--etcd", ctx.cluster.etcd, "--job", ctx.cluster.job,
                          "--nnodes", "1:8", "--node-id", node, "--", *ctx.cluster.worker_args],
                         capture_output=True, text=True, timeout=60, env=quiet_env(**ctx.cluster.env))
    refused = dup.returncode == 2 and "already registered" in dup.stderr
    return ctx.emit("duplicate_node", node=node, refused=refused, exit_code=dup.returncode,
                    stderr=dup.stderr.strip()[-300:])


def _zombie_commit(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    g = wait_for(lambda: _current_round(ctx) >= 2 and _current_round(ctx), 120, "a second round")
    zombie_events = ctx.cluster.workdir / "zombie-events.jsonl"
    args = [a for a in ctx.cluster.worker_args if not a.startswith(("--logging.", "--data.ledger_dir",
                                                                    "--train.save_final_path"))]
    env = quiet_env(**ctx.cluster.env, FTRAIN_ETCD=ctx.cluster.etcd, FTRAIN_FENCE_KEY=f"/ftrain/jobs/{ctx.cluster.job}/round",
                    FTRAIN_ROUND=str(g - 1), FTRAIN_JOB=ctx.cluster.job, FTRAIN_LOG_LEVEL="WARNING")
    out = _run_zombie(args, zombie_events, env)
    return ctx.emit("zombie_commit", round=g - 1, current_round=g, **out)


def _run_zombie(args: list[str], events_path: Any, env: dict[str, str]) -> dict[str, Any]:
    """One old-round worker that resumes and tries to save once; then it is stopped."""
    from contract.events import read_jsonl

    proc = subprocess.Popen([sys.executable, "-m", "ftrain", "train", *args, f"--logging.events_path={events_path}",
                             "--checkpoint.interval=1", "--checkpoint.async_mode=off", "--train.steps=100000",
                             "--logging.progress=off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        def attempted() -> list[dict[str, Any]]:
            if not os.path.exists(events_path):
                return []
            return [e for e in read_jsonl(events_path) if e["event"] in ("ckpt_failed", "ckpt_committed")]
        try:
            attempts = wait_for(attempted, 90, "the zombie's first save")
        except WaitTimeout:
            attempts = []
    finally:
        proc.kill()
        proc.wait()
    committed = [e["step"] for e in attempts if e["event"] == "ckpt_committed"]
    refused = bool(attempts) and not committed and all("StaleRoundError" in e.get("error", "") for e in attempts)
    return {"refused": refused, "attempts": len(attempts), "committed": committed}


_ACTIONS: dict[str, Callable[[Context, FaultSpec], dict[str, Any]]] = {
    "worker_kill": _worker_kill, "agent_kill": _agent_kill, "worker_hang": _worker_hang, "worker_slow": _worker_slow,
    "etcd_pause": _etcd_pause, "etcd_restart": _etcd_restart, "s3_outage": _s3_outage, "s3_faults": _s3_faults,
    "ckpt_corrupt": _ckpt_corrupt, "kill_during_save": _kill_during_save, "kill_during_load": _kill_during_load,
    "duplicate_node": _duplicate_node, "zombie_commit": _zombie_commit,
}


def inject(ctx: Context, spec: FaultSpec, *, timeout_s: float = 300) -> dict[str, Any] | None:
    """Wait for the trigger, then apply the fault; None if the run ended first."""
    wait_trigger(ctx, spec, timeout_s)
    if ctx.stop():
        return None
    return _ACTIONS[spec.kind](ctx, spec)
