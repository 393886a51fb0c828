"""``ftrain chaos run SCENARIO.toml [--seed N]``: boot the local stack and K agents, run (or
reuse) a fault-free golden run, run the job under the scenario's faults, check the invariants,
and write the report. Exit code 0 only if every invariant holds; the failing ones are named.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos import invariants, script_job
from ftrain.chaos.cluster import FAST_AGENT_OPTIONS, Cluster
from ftrain.chaos.faults import FAULTS, Context, FaultError, FaultSpec, inject
from ftrain.chaos.hosts import open_hosts
from ftrain.chaos.report import write_report
from ftrain.chaos.scenario import Scenario, ScenarioError, load_scenario
from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.storage import Storage
from ftrain.config import load_config
from ftrain.contract.events import Event, EventLog
from ftrain.contract.worker_env import LEDGER_DIR
from ftrain.testbed.procs import REPO, quiet_env
from ftrain.testbed.wait import WaitTimeout, wait_for

log = logging.getLogger(__name__)

JOB = "chaos"


@dataclass(slots=True)
class RunResult:
    ok: bool
    checks: list[invariants.Check]
    report: dict[str, Any]
    out_dir: Path

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]


def worker_overrides(scenario: Scenario) -> list[str]:
    job = scenario.job
    return [
        f"--train.steps={job.steps}",
        f"--parallel.deterministic={'true' if job.deterministic else 'false'}",
        *job.overrides,
    ]


def golden_run(scenario: Scenario, cache_dir: Path) -> Path:
    """The fault-free run's final state, computed once per (config, overrides) and reused."""
    overrides = worker_overrides(scenario)
    cfg = load_config(scenario.config_path, overrides)
    key = hashlib.sha256(f"{cfg.digest()}|{scenario.job.steps}".encode()).hexdigest()[:16]
    final = cache_dir / f"golden-{key}" / "final.pt"
    if final.exists():
        log.info("golden run %s reused", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    print(f"chaos: golden run ({scenario.job.steps} steps, one process) -> {final}", flush=True)
    partial = final.with_suffix(".partial")
    cmd = [
        sys.executable,
        "-m",
        "ftrain",
        "train",
        str(scenario.config_path),
        *overrides,
        "--checkpoint.uri=",
        f"--train.save_final_path={partial}",
        "--logging.progress=off",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, cwd=REPO, env=quiet_env(FTRAIN_LOG_LEVEL="WARNING")
    )
    if out.returncode != 0:
        raise RuntimeError(f"golden run failed (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    partial.rename(final)
    return final


class CommitWatcher(threading.Thread):
    """Records every commit (step, manifest ``created_time``) as it appears, with the time it
    was first seen (independent of what the workers say), so the invariants can tell whether the
    commit a load read existed — a step re-committed after chaos damaged it is a new commit.

    A commit is what a reader trusts: a manifest on storage whose commit record in etcd (the
    fence's, read first) names its digest. A manifest stored by a worker killed before it could
    record the commit, or by a zombie whose record was refused, is not one (counting it made a
    round that rightly went on from the step before look like it went back past a commit)."""

    def __init__(self, storage: Storage, recorded: Callable[[], dict[int, str] | None], interval_s: float = 0.25):
        super().__init__(name="chaos-commit-watcher", daemon=True)
        self.storage, self.recorded, self.interval_s = storage, recorded, interval_s
        self.commits: dict[tuple[int, float], float] = {}
        self.rounds: dict[tuple[int, float], int] = {}  #: commit -> the round its manifest names
        self.closing = threading.Event()

    def run(self) -> None:
        while not self.closing.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """One look: the records, then the manifests they name."""
        try:
            steps = [s for s in list_steps(self.storage, recorded=self.recorded()) if s.state == "committed"]
        except Exception:  # noqa: BLE001 - storage and etcd outages are part of the scenario
            return
        now = time.time()
        for info in steps:
            if info.manifest is not None:
                self.commits.setdefault((info.step, info.manifest.created_time), now)
                self.rounds.setdefault((info.step, info.manifest.created_time), info.manifest.round)


class _Campaign(threading.Thread):
    """Fires the scenario's faults in order, then the seeded random ones, until the job ends."""

    def __init__(self, ctx: Context, scenario: Scenario, rng: random.Random):
        super().__init__(name="chaos-faults", daemon=True)
        self.ctx, self.scenario, self.rng = ctx, scenario, rng
        self.records: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            for spec in self.scenario.faults:
                self._fire(spec)
            limit_s = self.scenario.random.duration_s
            gap = self.scenario.random.min_steps_between
            # every_s: waits drawn from an exponential, counted from the previous fault (a Poisson
            # process of faults); interval_s: counted from the end of the previous recovery
            from_previous_fault = self.scenario.random.every_s > 0
            high = self.ctx.cluster.step()
            previous = time.monotonic()
            for delay_s, spec in self.scenario.random_faults(self.rng):
                if gap:
                    try:
                        self._wait_past(high + gap)
                    except WaitTimeout as e:
                        self.errors.append(f"no progress between faults: {e}")
                        return
                deadline = (previous if from_previous_fault else time.monotonic()) + delay_s
                while time.monotonic() < deadline and not self.ctx.stop():
                    time.sleep(0.05)
                if limit_s and time.time() - self.ctx.started_at > limit_s:
                    break
                previous = time.monotonic()
                self._fire(spec)
                # the high the next fault waits past is where training stood when this one was
                # done acting: a fault that acts for a while (a save it waits for, a slowdown)
                # sees training move on meanwhile, and its recovery resumes from before that
                high = self.ctx.cluster.step()
        finally:
            self.done.set()

    def _wait_past(self, target_step: int) -> None:
        """Until training reached ``target_step`` or the run stops; WaitTimeout after 600 s."""
        wait_for(
            lambda: self.ctx.stop() or self.ctx.cluster.step() >= target_step,
            600,
            f"training to pass step {target_step}",
            poll_s=0.1,
        )

    def _fire(self, spec: FaultSpec) -> None:
        if self.ctx.stop():
            return
        try:
            record = inject(self.ctx, spec)
        except (FaultError, WaitTimeout) as e:
            if not self.ctx.stop():
                self.errors.append(f"{spec.kind}: {e}")
            return
        if record is not None:
            self.records.append(record)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the run is on, SIGTERM (a ``timeout``, a CI runner giving up) raises SystemExit in
    the main thread, so the run's ``finally`` blocks remove every process, agent, etcd and S3 it
    started instead of leaving them behind (Python's default for SIGTERM runs none of them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_scenario(
    scenario: Scenario, seed: int, out_dir: Path, *, cache_dir: Path, recovery: str | None = None
) -> RunResult:
    """Run ``scenario`` and check its invariants; ``recovery``: the agents' ``--recovery`` (None:
    the scenario's agent options, else the agents' default). SIGTERM ends it cleanly."""
    with sigterm_as_exit():
        return _run_scenario(scenario, seed, out_dir, cache_dir=cache_dir, recovery=recovery)


def _run_scenario(scenario: Scenario, seed: int, out_dir: Path, *, cache_dir: Path, recovery: str | None) -> RunResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    script = scenario.script_path
    # the state a fault-free run ends with: ftrain train's golden run, or the script's reference run
    golden = golden_run(scenario, cache_dir) if script is None else script_job.reference_run(scenario, cache_dir)
    job = scenario.job
    ledger_dir, final_path = out_dir / "ledger", out_dir / "final.pt"
    memory_dir = out_dir / "shm" if job.memory_tier else None
    nodes = [f"n{i}" for i in range(job.nodes)]
    with open_hosts(job.network, out_dir / "stack", nodes, seed) as hosts:
        s3 = hosts.s3
        ckpt_uri = s3.url(JOB)
        agent_options = [*FAST_AGENT_OPTIONS, *job.agent_options, *(["--recovery", recovery] if recovery else [])]
        if script is None:
            cluster = Cluster(
                out_dir,
                hosts.etcd_endpoints,
                scenario.config_path,
                job=JOB,
                ckpt_uri=ckpt_uri,
                ckpt_interval=job.checkpoint_interval,
                step_sleep_s=job.step_sleep_s,
                # chaos corrupts checkpoints on purpose, the only committed one too:
                # starting over from step 0 then is this scenario's explicit choice
                overrides=[
                    *worker_overrides(scenario),
                    f"--data.ledger_dir={ledger_dir}",
                    f"--train.save_final_path={final_path}",
                    "--checkpoint.on_no_loadable_step=fresh",
                    *([f"--checkpoint.memory_dir={memory_dir}"] if memory_dir is not None else []),
                ],
                env={**hosts.env(), **scenario.worker_env()},
                agent_options=agent_options,
            )
        else:  # the user's script: its own arguments; its sampler writes the ledger; its progress is the ledger's
            cluster = Cluster(
                out_dir,
                hosts.etcd_endpoints,
                script,
                job=JOB,
                ckpt_uri=ckpt_uri,
                overrides=scenario.script_command_args(ckpt_uri),
                env={**hosts.env(), **scenario.worker_env(), LEDGER_DIR: str(ledger_dir)},
                agent_options=agent_options,
                script=script,
                progress=script_job.LedgerProgress(ledger_dir).records,
            )
        events = EventLog(str(cluster.events_path), rank=-2)
        started_at = time.time()
        finished = threading.Event()
        ctx = Context(
            cluster=cluster,
            etcd=hosts.etcd,
            s3=s3,
            proxy=hosts.proxy,
            net=hosts.net,
            storage=Storage(ckpt_uri, s3.storage_options()),
            rng=rng,
            events=events,
            started_at=started_at,
            stop=finished.is_set,
            memory_dir=memory_dir,
        )
        campaign = _Campaign(ctx, scenario, rng)
        keys = JobKeys(JOB)
        fence = EtcdRoundFence(cluster.etcd_endpoints, keys.round, commits_key=keys.commits, timeout_s=1.0)
        watcher = CommitWatcher(
            Storage(ckpt_uri, s3.storage_options(retry_timeout_s=1.0, max_attempts=1)), fence.recorded
        )
        watcher.start()
        timed_out = False
        try:
            for node in nodes:
                cluster.start(node, nnodes=job.nnodes, nproc=job.nproc_per_node, **hosts.placement(node))
            campaign.start()
            print(
                f"chaos: {scenario.name} (seed {seed}): {job.nodes} node(s) x {job.nproc_per_node} worker(s), "
                f"{job.steps} steps on {job.network}; output in {out_dir}",
                flush=True,
            )
            try:
                wait_for(
                    lambda: _job_ended(cluster),
                    job.timeout_s,
                    "the job to finish",
                    poll_s=0.2,
                )
            except WaitTimeout:
                timed_out = True
            finished.set()
            campaign.done.wait(timeout=120)
            if script is not None:  # the last commit, in case the job ended between two looks
                watcher.poll()
        finally:
            finished.set()
            watcher.closing.set()
            cluster.close()
            events.close()
        killed = {r.get("pid") for r in campaign.records if FAULTS.get(r["kind"]).kills_agent}
        exit_codes = {n: p.returncode for n, p in cluster.agents.items() if p.pid not in killed}
        all_events = cluster.events()
        metrics = cluster.metrics()
        if script is not None:  # the resume of each round whose script logged none, from the ledger
            all_events = sorted([*all_events, *script_job.resumes(metrics, all_events)], key=lambda e: e["time"])
        storage = Storage(ckpt_uri, s3.storage_options())
        checks = (
            _train_checks(scenario, golden, final_path, storage, ledger_dir, all_events, metrics, exit_codes, watcher)
            if script is None
            else script_job.script_checks(
                scenario,
                reference=golden,
                storage=storage,
                out_dir=out_dir,
                ledger_dir=ledger_dir,
                events=all_events,
                metrics=metrics,
                exit_codes=exit_codes,
                observed=watcher.commits,
                rounds=watcher.rounds,
            )
        )
        if timed_out:
            checks.insert(0, invariants.Check("finished_in_time", False, f"still running after {job.timeout_s:.0f}s"))
        if campaign.errors:
            checks.append(invariants.Check("faults_injected", False, "; ".join(campaign.errors)))
        proxy = hosts.proxy
    timings = invariants.fault_timings(all_events, metrics)
    for timing, lost_s in zip(timings, invariants.lost_time(all_events, metrics, started_at)["by_fault"], strict=True):
        timing["lost_s"] = lost_s
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "seed": seed,
        "steps": job.steps,
        "nodes": job.nodes,
        "nproc_per_node": job.nproc_per_node,
        "started_at": started_at,
        "ok": all(c.ok for c in checks),
        "checks": [c.as_dict() for c in checks],
        "faults": timings,
        "goodput": invariants.goodput(all_events, metrics, started_at),
        "lost_by_kind": invariants.lost_by_kind(timings),
        "silent_corruption": invariants.corruption_outcomes(all_events, timings),
        "campaign": {
            "mix": scenario.random.mix if scenario.random.count else {},
            "every_s": scenario.random.every_s or None,
            "interval_s": None if scenario.random.every_s else list(scenario.random.interval_s),
            "recovery": recovery,
        },
        "proxy": {"requests": proxy.requests, "injected": proxy.injected} if proxy is not None else None,
        "events": all_events,
        "metrics": [{k: m[k] for k in ("step", "time", "loss", "world_size")} for m in metrics],
    }
    write_report(out_dir, report)
    return RunResult(report["ok"], checks, report, out_dir)


def _job_ended(cluster: Cluster) -> bool:
    """The job's final status is out and every agent exited. Each look also reads the job's
    progress: a script job's steps are timed when first seen (:class:`script_job.LedgerProgress`),
    so they are read as they come, not only while a fault waits for a step."""
    cluster.step()
    return bool(cluster.events(Event.JOB_FINAL)) and not cluster.live_nodes()


def _train_checks(
    scenario: Scenario,
    golden: Path,
    final_path: Path,
    storage: Storage,
    ledger_dir: Path,
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    exit_codes: dict[str, int | None],
    watcher: CommitWatcher,
) -> list[invariants.Check]:
    """The invariants of an ``ftrain train`` job (a script job's: :func:`script_job.script_checks`)."""
    job = scenario.job
    cfg = load_config(scenario.config_path, worker_overrides(scenario))
    return [
        invariants.job_finished(events, metrics, job.steps, exit_codes),
        invariants.final_state_matches(golden, final_path, job.tolerance if not job.deterministic else 0.0),
        invariants.committed_checkpoints_verify(storage, events),
        invariants.loads_were_committed(events, watcher.commits),
        invariants.resumed_from_the_newest_commit(events, watcher.commits),
        invariants.exactly_once(ledger_dir, cfg, job.steps),
        invariants.faults_handled(events),
        invariants.one_round_at_a_time(metrics),
        invariants.no_commit_from_a_stale_round(events, metrics),
        invariants.cut_off_nodes_rejoined(events),
        invariants.evicted_nodes_rejoined(events),
    ]


def print_summary(result: RunResult) -> None:
    r = result.report
    print(f"\n== chaos: {r['scenario']} (seed {r['seed']}) ==")
    for c in result.checks:
        print(f"  [{'skip' if c.skipped else 'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    print(
        f"  faults: {len(r['faults'])}; goodput {r['goodput']['goodput']:.1%} "
        f"({r['goodput']['productive_s']:.0f} s productive of {r['goodput']['wall_s']:.0f} s)"
    )
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for f in r["faults"]:
        by_kind.setdefault(f["kind"], []).append(f)
    lost_by_kind = r.get("lost_by_kind", {})
    for kind, fs in sorted(by_kind.items()):
        det = sorted(f["detection_s"] for f in fs if f["detection_s"] is not None)
        rec = sorted(f["recovery_s"] for f in fs if f["recovery_s"] is not None)
        lost = [f["lost_steps"] for f in fs if f["lost_steps"] is not None]
        median = lambda xs: xs[len(xs) // 2] if xs else None  # noqa: E731
        time_lost = lost_by_kind.get(kind, {})
        print(
            f"    {kind:<17} x{len(fs):<3} detection median {_s(median(det))}  recovery median {_s(median(rec))} "
            f"max {_s(rec[-1] if rec else None)}  lost steps {sum(lost)}"
            + (
                f"  time lost median {_s(time_lost['median_s'])} worst {_s(time_lost['worst_s'])} "
                f"total {_s(time_lost['total_s'])}"
                if time_lost
                else ""
            )
        )
    causes = r["goodput"].get("lost_by_cause")
    if causes:
        split = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(causes.items(), key=lambda kv: -kv[1]))
        print(f"  time lost {r['goodput']['lost_s']:.0f} s: {split}")
    for c in r.get("silent_corruption", []):
        print(
            f"    {c['kind']} #{c['index']} at step {c['step']}: "
            + (
                f"detected in {_s(c['detection_s'])} ({c['detection_steps']} step(s))"
                if c["detected"]
                else "NOT detected"
            )
            + f", corrupted commits {c['corrupted_commits']}"
        )
    print(f"  report: {result.out_dir / 'report.html'}")
    print("chaos: OK" if result.ok else f"chaos: FAILED ({', '.join(result.failed)})")


def _s(x: float | None) -> str:
    return f"{x:.1f}s" if x is not None else "-"


def with_fault_every_s(scenario: Scenario, every_s: float) -> Scenario:
    """``scenario`` with its random campaign at a mean of ``every_s`` seconds between faults
    (``--fault-every-s``); ScenarioError where it has no random campaign to speed up."""
    if scenario.random.count == 0:
        raise ScenarioError(f"--fault-every-s: {scenario.path} has no random campaign (random.count = 0)")
    try:
        return replace(scenario, random=scenario.random.with_every_s(every_s))
    except ScenarioError as e:
        raise ScenarioError(f"--fault-every-s: {e}") from None


def run_main(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        if args.fault_every_s is not None:
            scenario = with_fault_every_s(scenario, args.fault_every_s)
    except ScenarioError as e:
        print(f"ftrain chaos: {e}", file=sys.stderr)
        return 2
    out = (
        Path(args.out)
        if args.out
        else REPO / "runs" / "chaos" / (f"{scenario.name}-{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    result = run_scenario(scenario, args.seed, out, cache_dir=Path(args.cache_dir), recovery=args.recovery)
    print_summary(result)
    return 0 if result.ok else 1
