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

A global id means a sample only under the blend it was drawn from, so each line also carries the
``data`` digest of that blend (:func:`~ftrain.data.identity.data_digest`). Steps drawn from
another blend than the check replays are reported (:attr:`LedgerReport.data_mismatch`), never
passed: a run resumed on reordered or reweighted sources fails the check. A run that changed its
data on purpose (``data.on_mixture_change=new_blend``) is checked by replaying its ``blends`` (the
cursor state of its last checkpoint): the cursor replays each change as its resume did, and the
coverage counts each source by content across the blends.
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

from ftrain.contract.local_files import open_append
from ftrain.data.cursor import DataCursor, GlobalBatch, MicroBatch
from ftrain.data.errors import DataError
from ftrain.data.identity import blend_of, content_key, data_digest

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

    def __init__(self, directory: str | os.PathLike, dp_rank: int, round_: int, *, data: str = ""):
        """``data``: the digest of the blend the ids are drawn from (:attr:`DataCursor.data_digest`)."""
        self.directory = Path(directory)
        self.dp_rank = int(dp_rank)
        self.round = int(round_)
        self.data = str(data)
        self.attempt = 0  #: rollbacks to a checkpoint within this round so far (:meth:`rolled_back`)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"ledger-round{self.round}-rank{self.dp_rank}-pid{os.getpid()}.jsonl"
        # line-buffered; a regular file of this user's, never a link planted in a shared directory
        self._file: TextIO | None = os.fdopen(open_append(self.path), "a", buffering=1, encoding="utf-8")
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
        if self.data:
            line["data"] = self.data
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
    """Every entry of every ledger file in ``directory``; a torn last line is skipped. Each entry
    is checked (the files sit where others may write): DataError naming the file and line."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"ledger directory {str(directory)!r} does not exist; check data.ledger_dir")
    entries: list[dict[str, Any]] = []
    for path in sorted(directory.glob("ledger-*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"ledger {path} cannot be read ({e})") from e
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
            except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
                raise DataError(f"ledger {path}:{lineno} is not a ledger entry ({str(e)[:200]})") from e
            problem = _entry_problem(entry)
            if problem:
                raise DataError(f"ledger {path}:{lineno} is not a ledger entry: {problem}")
            entries.append(entry)
    return entries


def _entry_problem(entry: Any) -> str:
    """Why ``entry`` is not a line :meth:`Ledger.record` writes ("" if it is one)."""
    if not isinstance(entry, dict) or any(k not in entry for k in _ENTRY_KEYS):
        return f"needs {', '.join(_ENTRY_KEYS)}"
    for key in ("step", "epoch", "start", "round", "dp_rank", "attempt"):
        if key in entry and not _index(entry[key]):
            return f"{key} must be an integer in [0, 2**63), got {str(entry[key])[:40]}"
    for key in ("micro", "sample_ids"):
        values = entry[key]
        if not isinstance(values, list) or not all(_index(v) for v in values):
            return f"{key} must be a list of integers in [0, 2**63)"
    if not isinstance(entry.get("data", ""), str) or len(entry.get("data", "")) > 64:
        return "data must be a blend digest (a short string)"
    return ""


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


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
    #: step -> (the data digest its entries carry, the one the replay expected): drawn from another blend
    data_mismatch: dict[int, tuple[str, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        problems = (
            self.missing_steps,
            self.missing,
            self.duplicates,
            self.unexpected,
            self.out_of_order,
            self.data_mismatch,
        )
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
        if self.data_mismatch:
            first = min(self.data_mismatch)
            found, expected = self.data_mismatch[first]
            lines.append(
                f"  steps drawn from another data blend than the check replays: {_ids(sorted(self.data_mismatch))} "
                f"(step {first}: data {found}, expected {expected}); their ids are other samples. A run resumed with "
                "data.on_mixture_change=new_blend is checked with blends= (its last checkpoint's cursor state)"
            )
        return "\n".join(lines + coverage)


def check_exactly_once(
    entries: list[dict[str, Any]],
    *,
    num_samples: int,
    global_batch_size: int,
    seed: int,
    steps: int,
    sources: SourceDecoder | None = None,
    data: str | None = None,
    blends: list[dict[str, Any]] | None = None,
) -> LedgerReport:
    """Check each step ``< steps``: its last attempt consumed exactly the cursor's ids, once each,
    drawn from the blend the replay is at.

    ``data``: the digest every step's entries must carry (:attr:`DataCursor.data_digest` of the
    run's data; None: they must all carry the same one). ``blends``: the ``blends`` of the run's
    last cursor state, to replay its data changes (then ``num_samples`` and ``seed`` are the
    first blend's, and ``data`` is not used). Entries that carry no digest (an older ledger's) are
    not judged by it. With ``sources`` (the run's mixture), the ids of those last attempts are
    decoded to ``(source, sample)`` and counted per source into :attr:`LedgerReport.sources`
    (with ``blends``: each step's through its own blend, counted per file content)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    report = LedgerReport(steps_checked=steps)
    for entry in entries:
        if int(entry["step"]) < steps:
            by_step[int(entry["step"])].append(entry)
        else:
            report.ignored_entries += 1
    replay = _Replay(num_samples, global_batch_size, seed, blends)
    read: list[int] = []  # the ids of every step's last attempt
    read_by_blend: dict[int, list[int]] = defaultdict(list)
    expected_data = data
    for step in range(steps):
        expected = replay.next_batch(step).sample_ids
        attempts = by_step.get(step)
        if not attempts:
            report.missing_steps.append(step)
            continue
        last = max(_attempt(e) for e in attempts)
        final = [e for e in attempts if _attempt(e) == last]
        report.superseded_entries += len(attempts) - len(final)
        consumed = [int(i) for e in final for i in e["sample_ids"]]
        digests = {str(e["data"]) for e in final if e.get("data")}
        want = replay.digest if blends else expected_data
        if want is None and digests:
            want = expected_data = min(digests)  # without a reference: the first one recorded
        wrong = sorted(d for d in digests if d != want)
        if wrong and want is not None:
            report.data_mismatch[step] = (wrong[0], want)
        if sources is not None:
            read.extend(consumed)
            read_by_blend[replay.blend].extend(consumed)
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
    if sources is not None and blends:
        report.sources = _coverage_by_content(replay.cursor.blends, read_by_blend)
    elif sources is not None:
        report.sources = _coverage(sources, np.asarray(read, dtype=np.int64))
    return report


class _Replay:
    """The cursor a run's steps followed: a plain one, or, given its ``blends``, one that changes
    its data at each blend's first step exactly as a resume with ``data.on_mixture_change=new_blend``
    does (through :meth:`DataCursor.load_state_dict`)."""

    def __init__(self, num_samples: int, batch: int, seed: int, blends: list[dict[str, Any]] | None):
        self.batch = batch
        self.blends = list(blends or [])
        first = self.blends[0]["data"] if self.blends else None
        if first is not None:
            num_samples, seed = int(first["num_samples"]), int(first["seed"])
        self.cursor = DataCursor(num_samples, batch, seed, data=first, on_change="new_blend")
        self.blend = 0  #: index in ``blends`` of the blend in force
        self.digest = data_digest(first)

    def next_batch(self, step: int) -> GlobalBatch:
        while self.blend + 1 < len(self.blends) and int(self.blends[self.blend + 1]["step"]) <= step:
            self.blend += 1
            identity = self.blends[self.blend]["data"]
            changed = DataCursor(
                int(identity["num_samples"]), self.batch, int(identity["seed"]), data=identity, on_change="new_blend"
            )
            changed.load_state_dict(self.cursor.state_dict())
            self.cursor = changed
            self.digest = data_digest(identity)
        return self.cursor.next_global_batch()


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


def _coverage_by_content(blends: list[dict[str, Any]], read: dict[int, list[int]]) -> list[SourceCoverage]:
    """Reads per file content across blends: each blend's ids decoded through that blend."""
    samples: dict[str, list[np.ndarray]] = defaultdict(list)
    names: dict[str, tuple[str, int]] = {}
    for k, blend in enumerate(blends):
        identity = blend["data"]
        keys = [content_key(e, identity["seq_len"]) for e in identity["sources"]]
        for key, entry in zip(keys, identity["sources"], strict=True):
            names[key] = (entry["path"], int(entry["num_samples"]))  # the latest blend's path
        ids = np.asarray(read.get(k, []), dtype=np.int64)
        if ids.size:
            which, sample = blend_of(identity).decode(ids)
            for i, key in enumerate(keys):
                samples[key].append(sample[which == i])
    return [
        SourceCoverage.of(name, size, np.concatenate(samples[key]) if samples[key] else np.empty(0, np.int64))
        for key, (name, size) in names.items()
    ]


def _ids(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:_SHOW])
    return "[" + shown + (f", ... {len(values) - _SHOW} more" if len(values) > _SHOW else "") + "]"
