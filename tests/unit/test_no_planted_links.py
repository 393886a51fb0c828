"""Files the job creates where someone else may write (a run dir or a ledger dir under /tmp, a
report's --out) are never written through a link planted under the name (issue 38, item 11):
:func:`~ftrain.contract.local_files.replace_file` and :func:`~ftrain.contract.local_files.open_append`,
and the writers that use them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftrain.contract.local_files import open_append, replace_file
from ftrain.data import DataCursor, Ledger, micro_batches
from ftrain.observability.metrics import MetricsWriter


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    return path


def test_replace_file_replaces_a_planted_link_instead_of_writing_through_it(tmp_path, victim):
    target = tmp_path / "report.json"
    target.symlink_to(victim)
    replace_file(target, b"{}")
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"{}"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_open_append_refuses_a_link_and_a_fifo_and_appends_to_its_own_file(tmp_path, victim):
    link = tmp_path / "log"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        open_append(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        open_append(fifo)  # and it did not block waiting for a reader
    own = tmp_path / "own.log"
    for line in (b"a\n", b"b\n"):
        fd = open_append(own)
        os.write(fd, line)
        os.close(fd)
    assert own.read_bytes() == b"a\nb\n" and victim.read_bytes() == b"precious"


def test_the_ledger_does_not_write_through_a_planted_link(tmp_path, victim):
    """Its name (round, rank, pid) is predictable: a link there took the ledger's lines before."""
    (tmp_path / f"ledger-round0-rank0-pid{os.getpid()}.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        Ledger(tmp_path, dp_rank=0, round_=0)
    assert victim.read_bytes() == b"precious"
    ledger = Ledger(tmp_path / "fresh", dp_rank=0, round_=0)
    batch = DataCursor(16, 4, 0).next_global_batch()
    ledger.record(batch, micro_batches(batch, 0, 1, 4))
    ledger.close()
    assert ledger.path.read_text().count("\n") == 1


def test_the_metrics_log_does_not_write_through_a_planted_link(tmp_path, victim):
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        MetricsWriter(tmp_path / "metrics.jsonl")
    assert victim.read_bytes() == b"precious"


def test_report_files_replace_a_planted_link(tmp_path, victim, monkeypatch):
    from ftrain.observability import run_report

    monkeypatch.setattr("ftrain.observability.browser.find_browser", lambda: None)  # no screenshot here
    monkeypatch.setattr("ftrain.observability.report_page.render", lambda report: "<html></html>")
    for name in ("report.json", "report.html"):
        (tmp_path / name).symlink_to(victim)
    run_report.write(tmp_path, {"steps": []})
    assert victim.read_bytes() == b"precious"
    assert (tmp_path / "report.json").read_text().strip().startswith("{") and not (
        tmp_path / "report.json"
    ).is_symlink()
    assert (tmp_path / "report.html").read_text() == "<html></html>"


def test_the_agents_files_are_never_written_through_a_planted_link(tmp_path, victim):
    """The event log, the etcd client settings (a temporary under a predictable name, O_TRUNC),
    a worker's stack-dump file (``<pid>.txt``) and its log: each followed a link planted under
    its name into the victim before."""
    from ftrain.agent_link.heartbeat import Heartbeat
    from ftrain.agents.agent_options import write_client_file
    from ftrain.agents.live_workers import LiveWorkers
    from ftrain.contract.events import EventLog

    (tmp_path / "events.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        EventLog(str(tmp_path / "events.jsonl"), rank=-1)
    (tmp_path / f"etcd-client.json.{os.getpid()}.tmp").symlink_to(victim)
    write_client_file(str(tmp_path), {"username": "u"})
    assert (tmp_path / "etcd-client.json").read_text() == '{"username": "u"}'
    stacks = tmp_path / "stacks"
    stacks.mkdir(mode=0o700)
    (stacks / f"{os.getpid()}.txt").symlink_to(victim)
    hb = Heartbeat(str(tmp_path / "no-agent.sock"), round_=1, rank=0, local_rank=0)
    try:
        with pytest.raises(OSError):
            hb.enable_stack_dumps(str(stacks))
    finally:
        hb.close()
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "round-0001.log").symlink_to(victim)
    with pytest.raises(OSError):  # its first process is started at once, its output to that log
        LiveWorkers({}, str(run / "round-0001.log"), worker_args=(), standby=1, spares=0, script="x.py")
    assert victim.read_bytes() == b"precious"
