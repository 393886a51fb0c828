"""One process of simulated node agents for the control-plane benchmark (``bench/control_plane.py``
starts it): real :class:`ftrain.agents.agent.Agent` objects on a real etcd, with fake workers
(:mod:`control_plane_fakes`), ticked by one driver thread the way :meth:`Agent.run` ticks one.

    python bench/lib/control_plane_sim.py --etcd URL --job J --node-ids a,b,c --nnodes MIN:MAX ...

It is run with ``PYTHONPATH`` naming the tree to measure (today's, or the code at an older
commit), so it imports ``ftrain`` from there and uses only what both trees have: the Agent's
constructor, ``start()``, ``tick()``, ``wake``, ``exit_code`` and ``workers``; ``AgentOptions.of``,
``EtcdJobStore``, ``EtcdClient``, ``AgentMetrics``, ``SystemClock``.

Protocol (one JSON object a line): on stdout ``{"event": "started", ...}`` once every agent is
registered, then one answer per command read from stdin: ``stats`` (ticks, their lag behind
schedule and their time since the last ``stats``, and the round each agent's workers run),
``quit``. A SIGKILL is how the benchmark takes a node away: its lease runs out.

What must stay true:

- each agent is ticked every ``tick_s`` after its previous tick ended, and at once when its
  ``wake`` is set (what ``Agent.run`` does: tick, ``wake.wait(TICK_S)``, clear); a tick that
  cannot start on time is counted as lag, never skipped;
- ``Agent.run`` is never called (it installs signal handlers); no metrics server is started
  (``metrics_port`` -1); nothing is written but this process's stderr log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from control_plane_fakes import NullEvents, SteadyHeartbeats, idle_launcher  # this script's folder

import ftrain
from ftrain.agents.agent import Agent
from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.errors import EtcdUnavailableError
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.jobstore import EtcdJobStore
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.parts import SystemClock

TICK_S = 0.2  #: ftrain.agents.agent.TICK_S at both commits: Agent.run's wait between ticks


class WakeEvent(threading.Event):
    """An agent's ``wake`` that also wakes the driver hosting it."""

    def __init__(self, driver_wake: threading.Event):
        super().__init__()
        self._driver_wake = driver_wake

    def set(self) -> None:
        super().set()
        self._driver_wake.set()


class HostedAgent(Agent):
    """The real agent, whose ``wake`` (made in ``Agent.__init__``, before anything binds its
    ``set``) is a :class:`WakeEvent` of this process's driver: the one difference."""

    driver_wake = threading.Event()  #: set by main() to the driver's before any agent is made

    @property
    def wake(self) -> threading.Event:
        return self.__dict__["_hosted_wake"]

    @wake.setter
    def wake(self, _event: threading.Event) -> None:
        self.__dict__["_hosted_wake"] = WakeEvent(HostedAgent.driver_wake)


@dataclass
class Hosted:
    """One agent of this process and its schedule."""

    node_id: str
    agent: Agent
    due_at: float = 0.0  #: monotonic: when its next tick is due (it may start earlier, woken)
    errors: int = 0


@dataclass
class TickStats:
    """Ticks since the last ``stats`` command."""

    ticks: int = 0
    woken: int = 0  #: ticks started early because the agent's wake was set
    busy_s: float = 0.0  #: wall time inside tick()
    lags_s: list[float] = field(default_factory=list)  #: how late each scheduled tick started
    errors: int = 0
    last_error: str = ""


class Driver:
    """One thread that ticks every hosted agent (see the module docstring for the schedule)."""

    def __init__(self, tick_s: float):
        self.tick_s = tick_s
        self.wake = threading.Event()
        self.hosted: list[Hosted] = []
        self.stats = TickStats()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def add(self, hosted: Hosted) -> None:
        with self.lock:
            hosted.due_at = time.monotonic()
            self.hosted.append(hosted)
        self.wake.set()

    def take_stats(self) -> TickStats:
        with self.lock:
            taken, self.stats = self.stats, TickStats()
        return taken

    def run(self) -> None:
        while not self.stop.is_set():
            self.wake.clear()  # before the scan: a wake set during it ends the wait below at once
            with self.lock:
                hosted = list(self.hosted)
            next_due = time.monotonic() + self.tick_s
            for h in hosted:
                if h.agent.exit_code is None:
                    self._maybe_tick(h)
                    next_due = min(next_due, h.due_at)
            self.wake.wait(max(0.0, next_due - time.monotonic()))

    def _maybe_tick(self, h: Hosted) -> None:
        now, due_at = time.monotonic(), h.due_at
        woken = h.agent.wake.is_set()
        if not woken and now < due_at:
            return
        h.agent.wake.clear()
        started = time.monotonic()
        error = ""
        try:
            h.agent.tick()
        except Exception:  # Agent.run would have died here; the benchmark counts it and goes on
            error = traceback.format_exc(limit=3)
            h.errors += 1
        ended = time.monotonic()
        h.due_at = ended + self.tick_s
        with self.lock:
            s = self.stats
            s.ticks += 1
            s.busy_s += ended - started
            if now < due_at:
                s.woken += 1
            else:
                s.lags_s.append(now - due_at)
            if error:
                s.errors, s.last_error = s.errors + 1, error[-600:]


def build(args: argparse.Namespace, node_id: str) -> Agent:
    """An agent as ``ftrain.agents.assemble.build_agent`` wires one, with fake workers."""
    opts = AgentOptions.of(
        etcd=[args.etcd],
        job=args.job,
        node_id=node_id,
        worker_args=["control-plane-bench.toml"],
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        lease_ttl_s=args.lease_ttl_s,
        settle_s=args.settle_s,
        recovery="restart",
        scale_up="immediate",
        metrics_port=-1,
        run_dir=args.run_dir,
        hang_timeout_s=600.0,
        start_timeout_s=600.0,
    )
    clock = SystemClock()
    heartbeats = SteadyHeartbeats(os.path.join(args.run_dir, f"{node_id}.sock"), step_s=args.step_s)
    agent = HostedAgent(
        opts,
        store=EtcdJobStore(EtcdClient([args.etcd], timeout_s=1.0, retry_timeout_s=1.0)),
        clock=clock,
        heartbeats=heartbeats,
        metrics=AgentMetrics(args.job, node_id, clock=clock.monotonic, devices=args.nproc_per_node),
        events=NullEvents(),
        launcher=idle_launcher(heartbeats),
        run_dir=args.run_dir,
    )
    return agent


def start_agent(args: argparse.Namespace, node_id: str, retries: int, attempts: int = 5) -> tuple[Agent, int]:
    """A started agent; a start that etcd did not answer in time (``ftrain agent`` would exit 2
    and its supervisor start it again) is retried with a new agent after a pause."""
    for attempt in range(attempts):
        agent = build(args, node_id)
        try:
            agent.start()
            return agent, retries
        except EtcdUnavailableError:
            if attempt == attempts - 1:
                raise
            with contextlib.suppress(Exception):
                agent.close()
            retries += 1
            time.sleep(1.0 + attempt)  # a supervisor's restart delay, not synchronisation
    raise AssertionError("unreachable")


def stats_reply(driver: Driver) -> dict:
    s = driver.take_stats()
    lags = sorted(s.lags_s)
    with driver.lock:
        rounds = {h.node_id: (h.agent.workers.round if h.agent.workers is not None else -1) for h in driver.hosted}
        exited = {h.node_id: h.agent.exit_code for h in driver.hosted if h.agent.exit_code is not None}
    return {
        "event": "stats",
        "ticks": s.ticks,
        "woken": s.woken,
        "tick_busy_s": round(s.busy_s, 6),
        "lag_p50_s": round(lags[len(lags) // 2], 4) if lags else None,
        "lag_p99_s": round(lags[int(len(lags) * 0.99)], 4) if lags else None,
        "lag_max_s": round(lags[-1], 4) if lags else None,
        "errors": s.errors,
        "last_error": s.last_error,
        "rounds": rounds,
        "exited": exited,
        "at": time.monotonic(),
    }


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--node-ids", required=True, help="comma-separated: the agents this process hosts")
    p.add_argument("--nnodes", required=True)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--lease-ttl-s", type=int, required=True)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--step-s", type=float, default=0.5, help="the fake workers' step time")
    p.add_argument("--tick-s", type=float, default=TICK_S)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # two sockets and two threads per agent
    os.makedirs(args.run_dir, exist_ok=True)

    driver = Driver(args.tick_s)
    HostedAgent.driver_wake = driver.wake
    thread = threading.Thread(target=driver.run, name="driver", daemon=True)
    thread.start()
    registered_at, retries = {}, 0
    for node_id in args.node_ids.split(","):
        agent, retries = start_agent(args, node_id, retries)
        registered_at[node_id] = time.time()
        driver.add(Hosted(node_id, agent))
    say(
        {
            "event": "started",
            "pid": os.getpid(),
            "agents": len(registered_at),
            "ftrain": os.path.dirname(os.path.realpath(ftrain.__file__)),
            "registered_at": registered_at,
            "start_retries": retries,
        }
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "stats":
            say(stats_reply(driver))
        elif command == "quit":
            break
    driver.stop.set()
    driver.wake.set()
    thread.join(timeout=5)
    sys.stdout.flush()
    os._exit(0)  # no Agent.close(): leases run out as a lost node's would (the bench kills etcd anyway)


if __name__ == "__main__":
    raise SystemExit(main())
