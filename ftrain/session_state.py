"""What a :class:`ftrain.Session` saves of a loop's state, and how it puts a saved step back.

A state is a mapping of names to objects. :class:`StateParts` splits it into what DCP saves (at
most one ``nn.Module`` and its optimizers, through ``torch.distributed.checkpoint.state_dict``:
each rank its own shards) and what goes into the manifest as plain JSON (every other entry with
``state_dict()``/``load_state_dict()``: a scheduler, a sampler, counters; rank 0's). Misuse is a
:class:`SessionError` whose message names the entry and the fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from ftrain import optim_state
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import Manifest

log = logging.getLogger(__name__)

#: the manifest's ``trainer`` key under which the entries kept as JSON are
USER_STATE = "user_state"
#: a manifest's ``layout`` says which kind of loop wrote it
WRITER = "session"


class SessionError(RuntimeError):
    """A misuse of the session, or a state it cannot save or restore; the message says the fix."""


def validate(manifest: Manifest) -> None:
    """What a readable step's manifest holds for a session (else it is corrupt: marked, fall back)."""
    if manifest.layout.get("writer") == WRITER and not isinstance(manifest.trainer.get(USER_STATE), dict):
        raise ManifestError(f"step {manifest.step}: trainer.{USER_STATE} is not an object")


class StateParts:
    """A state mapping split into what DCP saves (one module, its optimizers) and what goes into
    the manifest as JSON (everything else with ``state_dict``)."""

    def __init__(self, module: nn.Module | None, optimizers: list[torch.optim.Optimizer], others: dict[str, Any]):
        self.module, self.optimizers, self.others = module, optimizers, others
        self._target: dict[str, Any] = {}

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> StateParts:
        if not isinstance(state, Mapping) or not state:
            raise SessionError("the state: a dict of name -> object to save (model, optimizer, scheduler, ...)")
        module, module_key, optimizers, others = None, "", [], {}
        for key, obj in state.items():
            if not isinstance(key, str) or not key:
                raise SessionError(f"the state's key {key!r}: a non-empty str")
            if isinstance(obj, nn.Module):
                if module is not None:
                    raise SessionError(
                        f"the state holds two modules ({module_key!r} and {key!r}): give one (the model; "
                        "wrap several in one nn.ModuleDict), with its optimizers"
                    )
                module, module_key = obj, key
            elif isinstance(obj, torch.optim.Optimizer):
                optimizers.append(obj)
            elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                others[key] = obj
            else:
                raise SessionError(
                    f"the state's {key!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(): "
                    "save an object that has them (wrap plain values in one, or keep them out of the state)"
                )
        if optimizers and module is None:
            raise SessionError("the state holds an optimizer but no module: add the model it optimizes")
        return cls(module, optimizers, others)

    def state_dict(self, manifest: Manifest | None = None) -> dict[str, Any]:
        """What DCP saves (or loads into, for ``manifest``'s step)."""
        if self.module is None:
            return {}
        form = optim_state.PER_PARAM if manifest is None else manifest.layout.get(optim_state.FORMAT_KEY)
        model_sd, optim_sd = optim_state.model_and_optim(self.module, self.optimizers, form)
        sd: dict[str, Any] = {"model": model_sd, **({"optim": optim_sd} if self.optimizers else {})}
        self._target = sd
        return sd

    def user_state(self, step: int) -> dict[str, Any]:
        out = {}
        for key, obj in self.others.items():
            value = obj.state_dict()
            try:
                text = json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise SessionError(
                    f"the state's {key!r} ({type(obj).__name__}): its state_dict() at step {step} is not plain "
                    f"JSON ({e}); the session keeps such entries in the manifest: give it numbers, strings, "
                    "lists and dicts only (tensors belong to the model or the optimizer)"
                ) from None
            out[key] = json.loads(text)
        return out

    def check_fits(self, manifest: Manifest) -> None:
        """SessionError unless this state can take ``manifest``'s step: written by a session, with
        an entry for each of ours (a part added since is the caller's to decide about)."""
        if manifest.layout.get("writer") != WRITER:
            raise SessionError(
                f"step {manifest.step} under this checkpoint root was written by `ftrain train`, not by a "
                "Session: give the session a root of its own"
            )
        saved = manifest.trainer[USER_STATE]
        missing = sorted(set(self.others) - set(saved))
        if missing:
            raise SessionError(
                f"step {manifest.step} holds no {', '.join(repr(m) for m in missing)} (it holds "
                f"{sorted(saved) or 'no entry besides the model and optimizer'}): it was saved before that part "
                "joined the state; load without it once (session.load({...})), then save with it"
            )
        if self.module is None and manifest.files:
            log.warning("step %d holds model state that this load has no module for", manifest.step)

    def apply(self, manifest: Manifest) -> None:
        """Put the loaded step into the objects (after DCP filled :meth:`state_dict`'s target)."""
        if self.module is not None:
            sd = self._target
            if not self.optimizers:
                set_model_state_dict(self.module, sd["model"])
            else:
                form = manifest.layout.get(optim_state.FORMAT_KEY)
                optim_state.load_into(self.module, self.optimizers, sd["model"], sd["optim"], form)
        saved = manifest.trainer[USER_STATE]
        for key, obj in self.others.items():
            obj.load_state_dict(saved[key])


__all__ = ["SessionError", "StateParts", "USER_STATE", "WRITER", "validate"]
