"""Ledger: per-rank JSON lines, and the exactly-once check against a fresh cursor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftrain.data import DataCursor, DataError, Ledger, check_exactly_once, micro_batches, read_ledger

N, B, SEED, MICRO = 40, 8, 3, 2
PARAMS = dict(num_samples=N, global_batch_size=B, seed=SEED)


def _run(directory: Path, *, world: int, round_: int, steps: range, skip_rank: int | None = None) -> None:
    """Simulate ``world`` ranks of one round running ``steps`` and recording them."""
    cursor = DataCursor(N, B, SEED)
    ledgers = [Ledger(directory, r, round_) for r in range(world)]
    try:
        for step in range(steps.stop):
            batch = cursor.next_global_batch()
            if step not in steps:
                continue
            for rank, ledger in enumerate(ledgers):
                if rank != skip_rank:
                    ledger.record(batch, micro_batches(batch, rank, world, MICRO))
    finally:
        for ledger in ledgers:
            ledger.close()


def test_two_ranks_all_steps_ok(tmp_path: Path) -> None:
    _run(tmp_path, world=2, round_=0, steps=range(12))  # 12 steps of 8 over 40 samples: 3 epochs
    entries = read_ledger(tmp_path)
    assert len(entries) == 24
    assert {e["dp_rank"] for e in entries} == {0, 1}
    report = check_exactly_once(entries, steps=12, **PARAMS)
    assert report.ok, report.summary()
    assert "ok" in report.summary() and "12 steps" in report.summary()


def test_file_names_and_line_format(tmp_path: Path) -> None:
    directory = tmp_path / "nested" / "ledger"
    _run(directory, world=2, round_=5, steps=range(1))
    names = sorted(p.name for p in directory.iterdir())
    assert names == [f"ledger-round5-rank{r}-pid{os.getpid()}.jsonl" for r in (0, 1)]
    line = json.loads((directory / names[1]).read_text().splitlines()[0])
    batch = DataCursor(N, B, SEED).next_global_batch()
    assert line == {
        "step": 0,
        "epoch": 0,
        "start": 0,
        "round": 5,
        "attempt": 0,
        "dp_rank": 1,
        "micro": [2, 3],
        "sample_ids": batch.sample_ids[4:8].tolist(),
    }


def test_missing_rank_reports_missing_ids(tmp_path: Path) -> None:
    _run(tmp_path, world=2, round_=0, steps=range(4), skip_rank=1)
    report = check_exactly_once(read_ledger(tmp_path), steps=4, **PARAMS)
    assert not report.ok
    cursor = DataCursor(N, B, SEED)
    for step in range(4):
        expected_missing = sorted(cursor.next_global_batch().sample_ids[4:8].tolist())
        assert report.missing[step] == expected_missing
    assert "missing" in report.summary()


def test_missing_step_is_reported(tmp_path: Path) -> None:
    _run(tmp_path, world=1, round_=0, steps=range(3))
    report = check_exactly_once(read_ledger(tmp_path), steps=5, **PARAMS)
    assert report.missing_steps == [3, 4]
    assert not report.ok and "never recorded: [3, 4]" in report.summary()


def test_duplicated_sample_is_reported(tmp_path: Path) -> None:
    _run(tmp_path, world=2, round_=0, steps=range(3))
    entries = read_ledger(tmp_path)
    victim = next(e for e in entries if e["step"] == 1 and e["dp_rank"] == 0)
    doubled = victim["sample_ids"][0]
    other = next(e for e in entries if e["step"] == 1 and e["dp_rank"] == 1)
    lost = other["sample_ids"][0]
    other["sample_ids"][0] = doubled  # rank 1 consumed rank 0's sample instead of its own
    report = check_exactly_once(entries, steps=3, **PARAMS)
    assert report.duplicates == {1: [doubled]}
    assert report.missing == {1: [lost]}
    assert not report.ok and "duplicated" in report.summary()


def test_unexpected_sample_is_reported(tmp_path: Path) -> None:
    _run(tmp_path, world=1, round_=0, steps=range(2))
    entries = read_ledger(tmp_path)
    step0 = next(e for e in entries if e["step"] == 0)
    intruder = next(i for i in range(N) if i not in step0["sample_ids"])
    step0["sample_ids"].append(intruder)
    report = check_exactly_once(entries, steps=2, **PARAMS)
    assert report.unexpected == {0: [intruder]}
    assert not report.ok


def test_same_rank_recording_a_step_twice_in_one_round_is_a_duplicate(tmp_path: Path) -> None:
    _run(tmp_path, world=1, round_=0, steps=range(2))
    _run(tmp_path / "again", world=1, round_=0, steps=range(1, 2))
    entries = read_ledger(tmp_path) + read_ledger(tmp_path / "again")
    report = check_exactly_once(entries, steps=2, **PARAMS)
    assert sorted(report.duplicates) == [1] and len(report.duplicates[1]) == B


def test_later_round_supersedes_earlier_attempt(tmp_path: Path) -> None:
    # Round 0 (2 ranks) ran steps 0-5 but rank 1 died during step 5; the last checkpoint was
    # at step 4, so round 1, at 4 ranks, re-ran steps 4-9.
    _run(tmp_path, world=2, round_=0, steps=range(5))
    _run(tmp_path, world=2, round_=0, steps=range(5, 6), skip_rank=1)
    _run(tmp_path, world=4, round_=1, steps=range(4, 10))
    entries = read_ledger(tmp_path)
    report = check_exactly_once(entries, steps=10, **PARAMS)
    assert report.ok, report.summary()
    assert report.superseded_entries == 2 + 1  # step 4 (two ranks) and step 5 (one rank) of round 0
    # Without the re-run, step 5's incomplete round-0 attempt is the last one: reported.
    only_round0 = [e for e in entries if e["round"] == 0]
    assert check_exactly_once(only_round0, steps=6, **PARAMS).missing.keys() == {5}


def test_a_rollback_within_a_round_supersedes_the_steps_it_runs_again(tmp_path: Path) -> None:
    """One rank runs steps 0-5, rolls back to the checkpoint of step 3 (a corrupt replica, a
    NaN) and runs steps 3-7 again in the same round: the second attempt of 3-5 is the one that counts."""
    cursor = DataCursor(N, B, SEED)
    batches = [cursor.next_global_batch() for _ in range(8)]
    with Ledger(tmp_path, 0, 0) as ledger:
        for step in range(6):
            ledger.record(batches[step], micro_batches(batches[step], 0, 1, MICRO))
        ledger.rolled_back()
        for step in range(3, 8):
            ledger.record(batches[step], micro_batches(batches[step], 0, 1, MICRO))
    entries = read_ledger(tmp_path)
    report = check_exactly_once(entries, steps=8, **PARAMS)
    assert report.ok, report.summary()
    assert report.superseded_entries == 3
    # without the attempt count, the replayed steps read as duplicates
    flat = [{k: v for k, v in e.items() if k != "attempt"} for e in entries]
    assert sorted(check_exactly_once(flat, steps=8, **PARAMS).duplicates) == [3, 4, 5]


def test_entries_beyond_checked_steps_are_ignored(tmp_path: Path) -> None:
    _run(tmp_path, world=2, round_=0, steps=range(6))
    report = check_exactly_once(read_ledger(tmp_path), steps=4, **PARAMS)
    assert report.ok and report.ignored_entries == 4


def test_out_of_order_is_reported(tmp_path: Path) -> None:
    _run(tmp_path, world=1, round_=0, steps=range(1))
    entries = read_ledger(tmp_path)
    entries[0]["sample_ids"].reverse()
    report = check_exactly_once(entries, steps=1, **PARAMS)
    assert report.out_of_order == [0] and not report.ok


def test_torn_last_line_is_tolerated(tmp_path: Path) -> None:
    _run(tmp_path, world=2, round_=0, steps=range(3))
    path = next(tmp_path.glob("ledger-round0-rank1-*.jsonl"))
    with open(path, "a") as fh:
        fh.write('{"step": 3, "epoch": 0, "start": 24, "round": 0, "dp_rank": 1, "micro": [2, 3], "sample_')
    entries = read_ledger(tmp_path)
    assert len(entries) == 6
    assert check_exactly_once(entries, steps=3, **PARAMS).ok


def test_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    _run(tmp_path, world=1, round_=0, steps=range(3))
    path = next(tmp_path.glob("ledger-*.jsonl"))
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=":2 is not valid JSON"):
        read_ledger(tmp_path)


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_ledger(tmp_path / "nope")


def test_closed_ledger_refuses_records(tmp_path: Path) -> None:
    batch = DataCursor(N, B, SEED).next_global_batch()
    with Ledger(tmp_path, 0, 0) as ledger:
        ledger.record(batch, micro_batches(batch, 0, 1, MICRO))
    with pytest.raises(DataError, match="closed"):
        ledger.record(batch, micro_batches(batch, 0, 1, MICRO))
    assert len(read_ledger(tmp_path)) == 1


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (
            '{"step": "3", "epoch": 0, "start": 0, "round": 0, "dp_rank": 0, "micro": [], "sample_ids": []}',
            "step must be",
        ),
        (
            '{"step": 1, "epoch": 0, "start": 0, "round": 0, "dp_rank": 0, "micro": [], "sample_ids": [1, -1]}',
            "sample_ids",
        ),
        (
            '{"step": 1, "epoch": 0, "start": 0, "round": 0, "dp_rank": 0, "micro": [], "sample_ids": [1e400]}',
            "sample_ids",
        ),
        ('{"step": 1, "epoch": 0, "start": 0, "round": 0, "dp_rank": 0, "micro": 7, "sample_ids": []}', "micro must"),
        (
            '{"step": 1, "epoch": 0, "start": 0, "round": true, "dp_rank": 0, "micro": [], "sample_ids": []}',
            "round must",
        ),
        ('{"step": ' + "9" * 5000 + "}", "is not a ledger entry"),
        ("[" * 100_000 + "]" * 100_000, "is not a ledger entry"),
    ],
)
def test_a_hostile_line_is_named_not_raised(tmp_path: Path, line: str, words: str) -> None:
    """A ledger directory is where others may write: a line of another shape is a DataError naming
    the file and line, never a TypeError or OverflowError from the checker."""
    _run(tmp_path, world=1, round_=0, steps=range(2))
    path = next(tmp_path.glob("ledger-*.jsonl"))
    path.write_text(line + "\n" + path.read_text())
    with pytest.raises(DataError, match=r"\.jsonl:1 is not a ledger entry") as info:
        read_ledger(tmp_path)
    assert words in str(info.value)
