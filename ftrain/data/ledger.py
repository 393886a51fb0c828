"""The consumption ledger: proof that each sample of each committed step was used exactly once.

Each data-parallel rank of each round appends one JSON line per step to its own file,
``ledger-round{round}-rank{dp_rank}-pid{pid}.jsonl``, so writers never share a file and a killed
writer can tear at most its own last line. A line records the step, its place in the data
order (epoch, start), the writer (round, dp_rank, and ``attempt``: the rollbacks within the
round before it), the global micro-batch indices it ran and the sample ids it consumed.

:func:`check_exactly_once` replays a fresh :class:`~ftrain.data.cursor.DataCursor` and, for
every step below ``steps``, compares what the *last* attempt of the step consumed (the highest
round that ran it, and in that round the highest attempt; earlier attempts were undone by a
restart or by a rollback to a checkpoint) with what the cursor says the step must consume.

Given the run's source as ``sources=`` (a :class:`~ftrain.data.mixture.MixtureSource`, or anything
that decodes global ids to ``(source, sample)``), it also counts how often each sample of each
source those final attempts read (:class:`SourceCoverage`): the proof that a mixture read every
sample of every file exactly once, or as often as its weight says.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np

from ftrain.data.cursor import DataCursor, GlobalBatch, MicroBatch
from ftrain.data.errors import DataError

logger = logging.getLogger(__name__)

_ENTRY_KEYS = ("step", "epoch", "start", "round", "dp_rank", "micro", "sample_ids")
_SHOW = 10  # ids shown per step in a summary


class SourceDecoder(Protocol):
    """What the checker needs of a multi-source data source (:class:`~ftrain.data.mixture.MixtureSource`)."""

    @property
    def source_names(self) -> tuple[str, ...]: ...

    @property
    def source_samples(self) -> tuple[int, ...]: ...

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class SourceCoverage:
    """How often the checked steps read each sample of one source."""

    name: str
    num_samples: int
    #: samples of this source read, counted with repeats
    reads: int
    #: samples never read / read once / read more than once
    unread: int
    once: int
    repeated: int
    #: the most times any one sample was read
    max_reads: int

    @property
    def exactly_once(self) -> bool:
        """Every sample of the source was read, none twice."""
        return self.unread == 0 and self.repeated == 0

    def line(self) -> str:
        if self.exactly_once:
            return f"  {self.name}: all {self.num_samples} samples read exactly once"
        return (
            f"  {self.name}: {self.reads} reads of {self.num_samples} samples: {self.unread} unread, "
            f"{self.once} once, {self.repeated} more than once (at most {self.max_reads} times)"
        )

    @classmethod
    def of(cls, name: str, num_samples: int, samples: np.ndarray) -> SourceCoverage:
        counts = np.bincount(samples, minlength=num_samples)
        return cls(
            name=name,
            num_samples=num_samples,
            reads=int(samples.size),
            unread=int((counts == 0).sum()),
            once=int((counts == 1).sum()),
            repeated=int((counts > 1).sum()),
            max_reads=int(counts.max(initial=0)),
        )


class Ledger:
    """Appends one JSON line per step for one rank of one round; flushed every step."""

    def __init__(self, directory: str | os.PathLike, dp_rank: int, round_: int):
        self.directory = Path(directory)
        self.dp_rank = int(dp_rank)
        self.round = int(round_)
        self.attempt = 0  #: rollbacks to a checkpoint within this round so far (:meth:`rolled_back`)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"ledger-round{self.round}-rank{self.dp_rank}-pid{os.getpid()}.jsonl"
        self._file: TextIO | None = open(self.path, "a", buffering=1, encoding="utf-8")  # line-buffered
        logger.debug("ledger %s opened", self.path)

    def record(self, batch: GlobalBatch, micros: list[MicroBatch]) -> None:
        """Record that this rank consumed ``micros`` of ``batch``."""
        if self._file is None:
            raise DataError(f"ledger {self.path} is closed")
        consumed = [int(i) for m in micros for i in m.sample_ids]
        line = {
            "step": int(batch.step),
            "epoch": int(batch.epoch),
            "start": int(batch.start),
            "round": self.round,
            "attempt": self.attempt,
            "dp_rank": self.dp_rank,
            "micro": [int(m.index) for m in micros],
            "sample_ids": consumed,
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def rolled_back(self) -> None:
        """Training went back to a checkpoint within this round: the steps it runs again
        supersede what was recorded for them."""
        self.attempt += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_ledger(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every entry of every ledger file in ``directory``; a torn last line is skipped."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"ledger directory {str(directory)!r} does not exist; check data.ledger_dir")
    entries: list[dict[str, Any]] = []
    for path in sorted(directory.glob("ledger-*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for lineno, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as e:
                if lineno == len(lines):  # a writer killed mid-line
                    logger.warning("ledger %s: skipping torn last line %d", path, lineno)
                    continue
                raise DataError(f"ledger {path}:{lineno} is not valid JSON ({e}); the file is corrupt") from e
            if not isinstance(entry, dict) or any(k not in entry for k in _ENTRY_KEYS):
                raise DataError(f"ledger {path}:{lineno} is not a ledger entry (needs {', '.join(_ENTRY_KEYS)})")
            entries.append(entry)
    return entries


@dataclass
class LedgerReport:
    """What the last attempt of each step consumed versus what it had to consume."""

    steps_checked: int
    missing_steps: list[int] = field(default_factory=list)
    #: step -> expected ids no rank consumed
    missing: dict[int, list[int]] = field(default_factory=dict)
    #: step -> ids consumed more than once
    duplicates: dict[int, list[int]] = field(default_factory=dict)
    #: step -> ids consumed that the step does not contain
    unexpected: dict[int, list[int]] = field(default_factory=dict)
    #: steps whose ids were all there, once each, but not in the global order (micro index order)
    out_of_order: list[int] = field(default_factory=list)
    superseded_entries: int = 0
    ignored_entries: int = 0
    #: per source of a mixture (``check_exactly_once(sources=...)``): how often its samples were read
    sources: list[SourceCoverage] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        problems = (self.missing_steps, self.missing, self.duplicates, self.unexpected, self.out_of_order)
        return not any(problems)

    @property
    def every_sample_once(self) -> bool:
        """:attr:`ok`, and every sample of every source was read exactly once (needs ``sources=``)."""
        return self.ok and bool(self.sources) and all(c.exactly_once for c in self.sources)

    def summary(self) -> str:
        coverage = [c.line() for c in self.sources]
        if self.ok:
            return "\n".join(
                [
                    f"ledger ok: {self.steps_checked} steps, every sample consumed exactly once "
                    f"({self.superseded_entries} superseded attempts, "
                    f"{self.ignored_entries} entries past the checked steps)",
                    *coverage,
                ]
            )
        lines = [f"ledger NOT ok over {self.steps_checked} steps:"]
        if self.missing_steps:
            lines.append(f"  steps never recorded: {_ids(self.missing_steps)}")
        for label, table in (
            ("missing", self.missing),
            ("duplicated", self.duplicates),
            ("unexpected", self.unexpected),
        ):
            for step, ids in sorted(table.items()):
                lines.append(f"  step {step}: {len(ids)} {label} ids {_ids(ids)}")
        if self.out_of_order:
            lines.append(f"  steps consumed out of global order: {_ids(self.out_of_order)}")
        return "\n".join(lines + coverage)


def check_exactly_once(
    entries: list[dict[str, Any]],
    *,
    num_samples: int,
    global_batch_size: int,
    seed: int,
    steps: int,
    sources: SourceDecoder | None = None,
) -> LedgerReport:
    """Check each step ``< steps``: its last attempt consumed exactly the cursor's ids, once each.

    With ``sources`` (the run's mixture), the ids of those last attempts are decoded to
    ``(source, sample)`` and counted per source into :attr:`LedgerReport.sources`."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    report = LedgerReport(steps_checked=steps)
    for entry in entries:
        if int(entry["step"]) < steps:
            by_step[int(entry["step"])].append(entry)
        else:
            report.ignored_entries += 1
    cursor = DataCursor(num_samples, global_batch_size, seed)
    read: list[int] = []  # the ids of every step's last attempt
    for step in range(steps):
        expected = cursor.next_global_batch().sample_ids
        attempts = by_step.get(step)
        if not attempts:
            report.missing_steps.append(step)
            continue
        last = max(_attempt(e) for e in attempts)
        final = [e for e in attempts if _attempt(e) == last]
        report.superseded_entries += len(attempts) - len(final)
        consumed = [int(i) for e in final for i in e["sample_ids"]]
        if sources is not None:
            read.extend(consumed)
        counts = Counter(consumed)
        expected_set = set(expected.tolist())
        missing = sorted(expected_set - counts.keys())
        dups = sorted(i for i, c in counts.items() if c > 1)
        extra = sorted(counts.keys() - expected_set)
        if missing:
            report.missing[step] = missing
        if dups:
            report.duplicates[step] = dups
        if extra:
            report.unexpected[step] = extra
        if not (missing or dups or extra):
            by_micro = sorted(final, key=lambda e: min(e["micro"], default=0))
            in_order = [int(i) for e in by_micro for i in e["sample_ids"]]
            if not np.array_equal(np.asarray(in_order), expected):
                report.out_of_order.append(step)
    if sources is not None:
        report.sources = _coverage(sources, np.asarray(read, dtype=np.int64))
    return report


def _attempt(entry: dict[str, Any]) -> tuple[int, int]:
    """(round, attempt) of an entry: later ones supersede earlier ones (entries written before
    ledgers counted rollbacks have no attempt: 0)."""
    return int(entry["round"]), int(entry.get("attempt", 0))


def _coverage(sources: SourceDecoder, ids: np.ndarray) -> list[SourceCoverage]:
    which, sample = sources.decode(ids)
    return [
        SourceCoverage.of(name, size, sample[which == k])
        for k, (name, size) in enumerate(zip(sources.source_names, sources.source_samples, strict=True))
    ]


def _ids(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:_SHOW])
    return "[" + shown + (f", ... {len(values) - _SHOW} more" if len(values) > _SHOW else "") + "]"
