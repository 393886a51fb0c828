"""The fault registry: each fault kind is one :class:`Fault`, registered by its own module under
``chaos/faults/kinds/`` (one module per kind, named after it).

What must stay true: everything that treats kinds differently (scenario validation, injection,
the invariants, the runner) asks the registry for the kind's :class:`Fault` and reads its fields,
never compares kind names, so a new kind is one module in ``kinds/`` plus its tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftrain.contract.events import Event

if TYPE_CHECKING:
    from ftrain.chaos.faults.spec import Context, FaultSpec

#: How a kind acts once its trigger fired: act, emit one ``chaos_fault`` event, return its record.
Action = Callable[["Context", "FaultSpec"], dict[str, Any]]

#: Events by which agents or workers show they noticed a fault: the first one after a fault (and
#: before the next) is its detection, unless the event says ``outcome = "succeeded"``.
#: how long after a fault that must be detected (and its ``duration_s``) its detection may come
DETECT_GRACE_S = 10.0

DETECTIONS = (
    Event.WORKERS_EXITED,
    Event.HANG,
    Event.ROUND_FORMED,
    Event.LEASE_LOST,
    Event.ETCD_UNREACHABLE,
    Event.CKPT_CORRUPT,
    Event.CKPT_FAILED,
)


class Outcome(enum.Enum):
    """What the job must show after a fault (checked by ``ftrain.chaos.invariants.faults_handled``)."""

    #: training stops: the workers are restarted, so a new round must follow the fault, and the
    #: fault's recovery (time to the first step after that round resumed, lost steps) is measured
    NEW_ROUND = "new_round"
    #: training rides it out: no round is owed to it and no recovery is measured
    RIDDEN_OUT = "ridden_out"
    #: the system must refuse it: the fault's record says ``refused = true``
    REFUSED = "refused"


class UnknownFaultKind(ValueError):
    """A kind no module registered; the message names it and every registered kind."""

    def __init__(self, kind: str, choices: Iterable[str]) -> None:
        super().__init__(f"unknown fault kind {kind!r}: one of {', '.join(choices)}")
        self.kind = kind


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One fault kind: its name, how it acts, and how the invariants judge and measure it."""

    #: the name in scenario files and in the ``kind`` of its ``chaos_fault`` events
    kind: str
    #: applies the fault (its trigger has fired) and returns the ``chaos_fault`` record it emitted
    act: Action
    #: what the job must show after it; a NEW_ROUND fault restarts the workers
    outcome: Outcome
    #: its record names the commit it damaged on purpose (``ckpt_step``, ``ckpt_created_time``):
    #: that step is not verified at the end, and a load of that commit after the fault is an error
    damages_commit: bool = False
    #: its record's ``pid`` is an agent it killed: that agent's exit code is not judged
    kills_agent: bool = False
    #: the events that count as its detection
    detected_by: tuple[str, ...] = DETECTIONS
    #: one of ``detected_by`` must follow it, within its ``duration_s`` and DETECT_GRACE_S more
    #: (a fault training rides out, like a slow worker, that the job must still notice), unless
    #: its record says ``detection_owed = false`` (the kind decides, from its parameters and the
    #: job's settings, when the agents' rules do not call for it) or a round was formed meanwhile
    must_be_detected: bool = False
    #: ``FTRAIN_FAULT_*`` variables it arms in every worker from the start (a fault that must act
    #: inside a worker at a known point: see ``ftrain/faults.py``)
    worker_env: Callable[[FaultSpec], dict[str, str]] | None = None
    #: it cuts a node off the network for a while: that node must be back in a round formed
    #: after the record's ``healed_at`` (``ftrain.chaos.invariants.cut_off_nodes_rejoined``)
    cuts_node: bool = False

    @property
    def restarts(self) -> bool:
        """The workers are restarted after it (a new round follows)."""
        return self.outcome is Outcome.NEW_ROUND


class FaultRegistry:
    """Fault kinds by name; a kind is registered once."""

    def __init__(self) -> None:
        self._faults: dict[str, Fault] = {}

    def register(self, fault: Fault) -> Fault:
        if fault.kind in self._faults:
            raise ValueError(f"fault kind {fault.kind!r} is registered twice")
        self._faults[fault.kind] = fault
        return fault

    def get(self, kind: str) -> Fault:
        """The kind's fault; :class:`UnknownFaultKind` (naming the choices) if none registered it."""
        try:
            return self._faults[kind]
        except KeyError:
            raise UnknownFaultKind(kind, self.kinds()) from None

    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted(self._faults))

    def __iter__(self) -> Iterator[Fault]:
        return iter([self._faults[k] for k in self.kinds()])


#: Every fault kind of ``chaos/faults/kinds/`` (importing ``ftrain.chaos.faults`` registers them all).
FAULTS = FaultRegistry()
