"""Faults that act on real processes and servers, and the trigger points they wait for.

A :class:`FaultSpec` names a registered kind, a trigger (``at_step`` and/or ``at_time_s`` since
the run began) and the kind's parameters. :func:`inject` waits for the trigger, then runs the
kind's action, which records a ``chaos_fault`` event in the job's event log (the time it acted,
the kind, the target, details); the invariants later match it against what the agents and
workers recorded.

Each kind is one :class:`Fault` in :data:`FAULTS`, defined and registered by its own module in
``chaos/faults/kinds/`` (the module docstring says what it does and its parameters): its action,
what the job must show after it (:class:`Outcome`: a new round, ridden out, or refused) and its
invariant hooks. Importing this package registers every kind; adding one is adding a module there.
"""

from __future__ import annotations

from ftrain.chaos.faults import kinds as _kinds  # noqa: F401  (imports, and so registers, every kind)
from ftrain.chaos.faults.registry import DETECTIONS, FAULTS, Fault, FaultRegistry, Outcome, UnknownFaultKind
from ftrain.chaos.faults.spec import Context, FaultError, FaultSpec
from ftrain.chaos.faults.trigger import inject, wait_trigger

#: Every registered kind, sorted.
KINDS = FAULTS.kinds()

__all__ = [
    "DETECTIONS",
    "FAULTS",
    "KINDS",
    "Context",
    "Fault",
    "FaultError",
    "FaultRegistry",
    "FaultSpec",
    "Outcome",
    "UnknownFaultKind",
    "inject",
    "wait_trigger",
]
