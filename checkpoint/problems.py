"""What can be wrong with one file of a step directory: found by verification
(:mod:`ftrain.checkpoint.verify`) and by a load's fetch of the bytes it needs
(:mod:`ftrain.checkpoint.fetch`), which both report in these terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ProblemKind = Literal["missing", "size", "digest", "manifest", "unsafe", "unreadable"]
#: Problem kinds that prove the step's bytes are not what was committed (``unsafe``: a
#: ``.metadata`` that asks the unpickler for anything but DCP metadata or points outside the
#: manifest's files, or a pickled item in a shard that torch's weights-only unpickler refuses).
CORRUPTION_KINDS = frozenset({"missing", "size", "digest", "manifest", "unsafe"})


@dataclass(slots=True)
class Problem:
    """One thing wrong with one file of a step directory."""

    file: str
    """Name relative to the step directory (``manifest.json`` for manifest problems)."""
    kind: ProblemKind
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.kind}: {self.detail}"


__all__ = ["CORRUPTION_KINDS", "Problem", "ProblemKind"]
