"""The memory tier across runs, as a user runs it: plain ``torchrun --standalone --nproc-per-node=2
-m ftrain train`` under fsdp with ``checkpoint.memory_dir`` set. A snapshot is bound to the run
that took it: a run killed for good leaves its snapshots, and a new run of the job — the same
config launched anew, or another seed — skips them (an event naming each directory and what
differs) and trains from the start; the same run, its workers all SIGKILLed and restarted by
torchrun, resumes from them.

Steps are slowed (``FTRAIN_FAULT_STEP_SLEEP_S``) and the job is long, so that every kill lands
mid-run; the test waits on what the workers write (snapshot directories, events), never on time.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ftrain.agents.workers import descendants, signal_pids
from ftrain.testbed.etcd import free_ports
from ftrain.testbed.jobs import TINY_CONFIG, worker_env
from ftrain.testbed.procs import REPO, kill_tree
from ftrain.testbed.wait import wait_for

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

STEP_SLEEP_S = "0.2"


class Job:
    """One directory's runs of the same job: config, memory_dir and event log shared by all."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.config = tmp_path / "config.toml"
        self.config.write_text(TINY_CONFIG)
        self.shm = tmp_path / "shm"
        self.events_path = tmp_path / "events.jsonl"
        self.node_dir = self.shm / "ftrain-tier-nojob" / socket.gethostname()

    def start(self, *overrides: str, max_restarts: int = 0, standalone: bool = True) -> tuple[subprocess.Popen, int]:
        """A run, in its own session; and where its events begin in the shared log. Not
        ``standalone``: static rendezvous without ``--rdzv-id`` (torchrun says run id ``none``)."""
        offset = self.events_path.stat().st_size if self.events_path.exists() else 0
        rdzv = (
            ["--standalone"]
            if standalone
            else ["--nnodes=1", "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_ports(1)[0]}"]
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node=2",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "-m", "ftrain", "train", str(self.config),
            "--train.steps=100000", "--parallel.strategy=fsdp", "--checkpoint.memory_interval=1",
            f"--checkpoint.memory_dir={self.shm}", f"--logging.events_path={self.events_path}", *overrides,
        ]  # fmt: skip
        # restarted workers bootstrap their own store (torchrun's shared one hands them stale peers)
        env = worker_env(
            FTRAIN_FAULT_STEP_SLEEP_S=STEP_SLEEP_S, FTRAIN_LOG_LEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
        )
        log = open(self.tmp / f"run-{offset}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        log.close()
        return proc, offset

    def events(self, offset: int, name: str) -> list[dict]:
        if not self.events_path.exists():
            return []
        with open(self.events_path, "rb") as fh:
            fh.seek(offset)
            lines = fh.read().decode(errors="replace").splitlines()
        out = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line torn by a kill
            if e.get("event") == name:
                out.append(e)
        return out

    def snapshot_steps(self) -> dict[str, set[int]]:
        """local<n> -> the steps of the complete snapshot directories it holds."""
        out: dict[str, set[int]] = {}
        for local in sorted(self.node_dir.glob("local*")):
            out[local.name] = {int(p.name.split("-")[1]) for p in local.glob("step-*")}
        return out

    def log(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.tmp.glob("run-*.log")))

    def log_tail(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.tmp.glob("run-*.log")))


def _wait_snapshots(job: Job, at_least: int, proc: subprocess.Popen) -> None:
    def both_hold() -> bool:
        assert proc.poll() is None, job.log_tail()
        held = job.snapshot_steps()
        return len(held) == 2 and all(any(s >= at_least for s in steps) for steps in held.values())

    wait_for(both_hold, 180, f"both workers' snapshots of step {at_least} in memory_dir")


def _wait_three_steps(job: Job, proc: subprocess.Popen, metrics: Path) -> None:
    """Until the job (which must stay up) has written three steps' metrics."""

    def trained() -> bool:
        assert proc.poll() is None, job.log_tail()
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    wait_for(trained, 180, "three steps without the on-disk tier")


def _trained_from_scratch(job: Job, proc: subprocess.Popen, offset: int, old_dirs: set[str]) -> list[dict]:
    """Wait until the run took three snapshots of its own; its memory_skipped events, which
    must name every directory of the run before it."""

    def trained() -> bool:
        assert proc.poll() is None, job.log_tail()
        return len({e["step"] for e in job.events(offset, "memory_snapshot")}) >= 3

    wait_for(trained, 180, "the new run's first snapshots")
    assert not job.events(offset, "memory_restored"), "a new run resumed from another run's snapshot"
    assert min(e["step"] for e in job.events(offset, "memory_snapshot")) == 1, "it did not start from step 0"
    skipped = job.events(offset, "memory_skipped")
    assert old_dirs <= {e["path"] for e in skipped}, (old_dirs, skipped)
    return skipped


def test_a_new_run_never_resumes_from_a_killed_runs_snapshots(tmp_path):
    job = Job(tmp_path)
    procs: list[subprocess.Popen] = []
    try:
        first, _ = job.start()
        procs.append(first)
        _wait_snapshots(job, 5, first)
        kill_tree(first)  # every process of the tree: the run is gone for good, its snapshots stay
        old = {str(p) for p in job.node_dir.glob("local*/step-*")}
        assert old

        # the same config, launched anew (torchrun --standalone: a new run id)
        again, offset = job.start()
        procs.append(again)
        skipped = _trained_from_scratch(job, again, offset, old)
        assert all("another run" in e["why"] and "another config" not in e["why"] for e in skipped if e["path"] in old)
        kill_tree(again)
        old = {str(p) for p in job.node_dir.glob("local*/step-*")}

        # another seed: the config differs too, and says where
        seeded, offset = job.start("--train.seed=4")
        procs.append(seeded)
        skipped = _trained_from_scratch(job, seeded, offset, old)
        assert all("train.seed: 3 -> 4" in e["why"] for e in skipped if e["path"] in old), skipped
        assert all(Path(p).is_dir() for p in old), "another run's snapshots are reported, not deleted"
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)


def test_the_same_run_resumes_from_its_snapshots_after_all_its_workers_were_killed(tmp_path):
    job = Job(tmp_path)
    proc, offset = job.start(max_restarts=1)
    try:
        _wait_snapshots(job, 5, proc)
        workers = descendants(proc.pid)
        assert len(workers) >= 2
        signal_pids(workers, signal.SIGKILL)  # torchrun restarts them: the same run (TORCHELASTIC_RUN_ID)

        def resumed() -> bool:
            assert proc.poll() is None, job.log_tail()
            return len(job.events(offset, "memory_restored")) == 2

        wait_for(resumed, 180, "the restarted workers to resume from the memory tier")
        restored = job.events(offset, "memory_restored")
        assert len({e["step"] for e in restored}) == 1 and restored[0]["step"] >= 5, restored
        assert not job.events(offset, "memory_skipped") and not job.events(offset, "memory_refused")
        assert "WITHOUT an HMAC key" in job.log(), "no warning that the tier runs unsigned"
    finally:
        kill_tree(proc)


def test_without_a_run_id_the_on_disk_tier_stays_off_and_says_how_to_give_one(tmp_path):
    job = Job(tmp_path)
    proc, offset = job.start(f"--logging.metrics_path={tmp_path / 'metrics.jsonl'}", standalone=False)
    try:
        _wait_three_steps(job, proc, tmp_path / "metrics.jsonl")
        skipped = job.events(offset, "memory_skipped")
        assert {e["rank"] for e in skipped} == {0, 1}, skipped
        assert all("no rank knows the run id" in e["why"] and "FTRAIN_RUN_ID" in e["why"] for e in skipped), skipped
        assert not job.events(offset, "memory_snapshot") and not list(job.node_dir.glob("local*/step-*"))
    finally:
        kill_tree(proc)


def test_a_tier_directory_others_can_write_is_not_used_and_training_goes_on(tmp_path):
    job = Job(tmp_path)
    planted = job.shm / "ftrain-tier-nojob"
    planted.mkdir(parents=True)
    planted.chmod(0o777)  # as if another local user had made it, for the job to use
    proc, offset = job.start(f"--logging.metrics_path={tmp_path / 'metrics.jsonl'}")
    try:
        _wait_three_steps(job, proc, tmp_path / "metrics.jsonl")
        skipped = job.events(offset, "memory_skipped")
        assert {e["path"] for e in skipped} == {str(planted)} and {e["rank"] for e in skipped} == {0, 1}, skipped
        assert all("writable by group or others" in e["why"] for e in skipped), skipped
        assert not job.events(offset, "memory_snapshot"), "snapshots nobody could keep were taken"
        assert list(planted.iterdir()) == []
    finally:
        kill_tree(proc)
