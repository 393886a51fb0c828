"""What a :class:`ftrain.Session` saves of a loop's state, and how it puts a saved step back.

A state is a mapping of names to objects. :class:`StateParts` splits it into what DCP saves (at
most one ``nn.Module`` and its optimizers, through ``torch.distributed.checkpoint.state_dict``:
each rank its own shards) and the loop's other objects (every entry with
``state_dict()``/``load_state_dict()``: a scheduler, a ``GradScaler``, a sampler, counters;
rank 0's), kept in the step's own file :data:`STATE_FILE` in :mod:`ftrain.state_codec`'s
encoding (exact round trips of what torch's schedulers hold: ``inf``, NaN, int keys, tuples,
``Counter``), listed in the manifest with its size and digest like every other file, written
before the manifest and verified before a byte of it is parsed (:class:`StateReader`). Steps
saved before that file existed keep the entries in the manifest (``trainer.user_state``, plain
JSON) and still load. Misuse is a :class:`SessionError` whose message names the entry and the fix.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor

from ftrain import optim_state, session_per_rank, state_codec
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.loading import WRITER_KEY, writer_of
from ftrain.checkpoint.manifest import Manifest, parse_json_bounded

log = logging.getLogger(__name__)

#: the manifest's ``trainer`` key under which steps saved before :data:`STATE_FILE` keep the
#: entries (plain JSON); newer steps leave it empty (an older reader then asks for the entries
#: it misses, and marks nothing)
USER_STATE = "user_state"
#: the manifest's ``trainer`` key naming the step's state file
STATE_FILE_KEY = "user_state_file"
#: the step's file of the loop's non-tensor state (:mod:`ftrain.state_codec`)
STATE_FILE = "user_state.json"
#: a manifest's ``layout`` says which kind of loop wrote it
WRITER = "session"


class SessionError(RuntimeError):
    """A misuse of the session, or a state it cannot save or restore; the message says the fix."""


def _unstorable(key: str, obj: Any, step: int, e: state_codec.StateEncodeError) -> SessionError:
    return SessionError(
        f"the state's {key!r} ({type(obj).__name__}): its state_dict() at step {step} cannot be saved ({e}); the "
        "session stores a loop's non-tensor state (schedulers, scalers, samplers, counters) in a file of the step: "
        "docs/library.md, 'What a session stores'"
    )


def _encoded(entries: Mapping[str, Any], step: int) -> dict[str, str]:
    """Each entry's ``state_dict()``, encoded (name -> text); SessionError naming what cannot be stored."""
    out = {}
    for key, obj in entries.items():
        try:
            out[key] = state_codec.encode(obj.state_dict())
        except state_codec.StateEncodeError as e:
            raise _unstorable(key, obj, step, e) from None
    return out


def _one_optimizer_per_parameter(state: Mapping[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
    """SessionError when two optimizers of the state update one parameter: torch's distributed
    state dict keys optimizer state by parameter name, so theirs would be mixed on load."""
    if len(optimizers) < 2:  # torch itself refuses a parameter twice in one optimizer
        return
    owner: dict[int, str] = {}
    names = {id(obj): key for key, obj in state.items()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                other = owner.setdefault(id(param), names[id(optimizer)])
                if other != names[id(optimizer)]:
                    raise SessionError(
                        f"the state's optimizers {other!r} and {names[id(optimizer)]!r} update the same parameter: "
                        "their states are saved by parameter name and would be mixed on load; give each parameter "
                        "one optimizer"
                    )


def manifest_fields(
    round_: int, world_size: int, step: int, per_rank: dict[str, int], loop: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A session's manifest fields of a save besides its files: the writer, the optimizer state's
    form, and the trainer state (the step; its entries in :data:`STATE_FILE`; ``per_rank``: the
    capacities of the per-rank entries, :mod:`ftrain.session_per_rank`); ``loop``: the loop's own
    fields (:func:`loop_fields`), beside those."""
    loop = loop or {}
    return {
        "round": round_,
        "world_size": world_size,
        "layout": {**loop.get("layout", {}), WRITER_KEY: WRITER, optim_state.FORMAT_KEY: optim_state.PER_PARAM},
        "config": dict(loop.get("config", {})),
        "config_hash": loop.get("config_hash", ""),
        "trainer": {
            **loop.get("trainer", {}),
            "step": step,
            USER_STATE: {},
            STATE_FILE_KEY: STATE_FILE,
            session_per_rank.CAPACITY_KEY: per_rank,
        },
    }


#: what a loop's own manifest fields (``Session(manifest_fields=...)``) may hold
LOOP_FIELDS = ("config", "config_hash", "layout", "trainer")


def loop_fields(own: Callable[[], Mapping[str, Any]] | None, step: int) -> dict[str, Any]:
    """The loop's own manifest fields (``own()``: some of :data:`LOOP_FIELDS`, its ``config``,
    ``layout`` and ``trainer`` objects beside the session's keys, which it may not set), checked:
    SessionError, before anything is written, naming the key, for what a manifest could not hold
    or its reader would refuse (past its bounds: the step would be corrupt)."""
    if own is None:
        return {}
    extra = own()
    where = f"Session(manifest_fields=...) at step {step}"
    if not isinstance(extra, Mapping) or set(extra) - set(LOOP_FIELDS):
        raise SessionError(f"{where}: return a dict with some of {', '.join(LOOP_FIELDS)}")
    session_own = manifest_fields(0, 1, step, {})
    for key, value in extra.items():
        if key == "config_hash":
            if not isinstance(value, str):
                raise SessionError(f"{where}: config_hash is text, not {type(value).__name__}")
            continue
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise SessionError(f"{where}: {key} is an object with text keys")
        taken = sorted(set(value) & set(session_own[key]))
        if taken:
            raise SessionError(f"{where}: {key}.{taken[0]} is the session's own; name yours otherwise")
    try:
        parse_json_bounded(json.dumps({**session_own, **extra}, allow_nan=False).encode())
    except (TypeError, ValueError, ManifestError) as e:
        raise SessionError(f"{where}: not what a manifest holds (plain JSON within its bounds): {e}") from e
    return dict(extra)


def validate(manifest: Manifest) -> None:
    """What a readable step's manifest holds for a session (else it is corrupt: marked, fall back)."""
    if writer_of(manifest) != WRITER:
        return  # another kind of loop's step: the load refuses it before this (ForeignStepError)
    trainer = manifest.trainer
    if STATE_FILE_KEY in trainer:
        name = trainer[STATE_FILE_KEY]
        if not isinstance(name, str) or name not in manifest.files:
            raise ManifestError(f"step {manifest.step}: trainer.{STATE_FILE_KEY} names no file of the step")
    elif not isinstance(trainer.get(USER_STATE), dict):
        raise ManifestError(f"step {manifest.step}: trainer.{USER_STATE} is not an object")
    session_per_rank.capacities(manifest)


def replicated(module: nn.Module | None) -> bool:
    """Whether every rank holds the whole of ``module`` (no parameter is a DTensor shard)."""
    return module is not None and not any(isinstance(p, DTensor) for p in module.parameters())


class StateReader:
    """The loader's :class:`~ftrain.checkpoint.loading.SideFile` for a session's step: its
    :data:`STATE_FILE`, verified, decoded; :meth:`saved` gives a step's entries (from that file, or
    from the manifest for a step saved before it existed)."""

    max_bytes = state_codec.MAX_STATE_BYTES

    def __init__(self) -> None:
        self._read: dict[int, dict[str, Any]] = {}

    def name(self, manifest: Manifest) -> str | None:
        name = manifest.trainer.get(STATE_FILE_KEY)
        return name if isinstance(name, str) and name else None

    def read(self, manifest: Manifest, data: bytes) -> None:
        try:
            self._read[manifest.step] = state_codec.load_file(data)
        except state_codec.StateDecodeError as e:
            raise ManifestError(f"{STATE_FILE} of step {manifest.step}: {e}") from e

    def saved(self, manifest: Manifest) -> dict[str, Any] | None:
        """The entries ``manifest``'s step holds (None: none usable; :func:`validate` refuses it)."""
        if self.name(manifest) is not None:
            return self._read.get(manifest.step)
        entries = manifest.trainer.get(USER_STATE)
        return entries if isinstance(entries, dict) else None


class StateParts:
    """A state mapping split into what DCP saves (one module, its optimizers, each rank's own
    entries: :mod:`ftrain.session_per_rank`) and what goes into the step's state file (everything
    else with ``state_dict``)."""

    def __init__(
        self,
        module: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        others: dict[str, Any],
        per_rank: dict[str, Any] | None = None,
        spread: bool = False,
    ):
        self.module, self.optimizers, self.others = module, optimizers, others
        #: the loop said its ranks hold different parameters (pipeline stages): not replicas, DTensors or not
        self.spread = spread
        self.per_rank = per_rank or {}  #: name -> object of each per-rank entry
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.capacities: dict[str, int] = {}  #: of the per-rank entries, as the last save's state dict agreed
        self._target: dict[str, Any] = {}

    @functools.cached_property
    def replicated(self) -> bool:
        """Whether every rank holds the whole module (:func:`replicated`, unless the loop said
        otherwise); asked once (a scan of the parameters, at each step boundary otherwise)."""
        return not self.spread and replicated(self.module)

    @classmethod
    def of(cls, state: Mapping[str, Any], *, spread: bool = False) -> StateParts:
        if not isinstance(state, Mapping) or not state:
            raise SessionError("the state: a dict of name -> object to save (model, optimizer, scheduler, ...)")
        module, module_key, optimizers, others, per_rank = None, "", [], {}, {}
        for key, obj in state.items():
            if not isinstance(key, str) or not key:
                raise SessionError(f"the state's key {key!r}: a non-empty str")
            if session_per_rank.unwrap(obj) is not None:
                per_rank[key] = session_per_rank.unwrap(obj)
            elif isinstance(obj, nn.Module):
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
        _one_optimizer_per_parameter(state, optimizers)
        return cls(module, optimizers, others, per_rank, spread)

    def state_dict(self, manifest: Manifest | None = None) -> dict[str, Any]:
        """What DCP saves (collective when the state has per-rank entries: their capacities are
        agreed; :attr:`capacities` holds them for the manifest), or loads into, for ``manifest``'s step."""
        sd: dict[str, Any] = {}
        if self.module is not None:
            form = optim_state.PER_PARAM if manifest is None else manifest.layout.get(optim_state.FORMAT_KEY)
            model_sd, optim_sd = optim_state.model_and_optim(self.module, self.optimizers, form)
            sd = {"model": model_sd, **({"optim": optim_sd} if self.optimizers else {})}
        if manifest is None:
            tensors, self.capacities = session_per_rank.pack(self.own_state(-1), self.rank)
        else:
            tensors = session_per_rank.targets(sorted(self.per_rank), manifest, self.rank)
        sd.update(tensors)
        self._target = sd
        return sd

    def own_state(self, step: int) -> dict[str, str]:
        """This rank's per-rank entries, encoded (name -> text); SessionError naming what cannot be stored."""
        return _encoded(self.per_rank, step)

    def apply_own(self, encoded: dict[str, str]) -> None:
        """Put this rank's per-rank entries back as :meth:`own_state` encoded them (its own, held in memory)."""
        for key, obj in self.per_rank.items():
            if key in encoded:
                obj.load_state_dict(state_codec.decode(encoded[key]))

    def check_storable(self, step: int) -> None:
        """SessionError, as :meth:`user_state` raises it, for an entry that could never be stored
        (its size aside: that grows as the loop runs), without encoding it."""
        for key, obj in self.others.items():
            try:
                state_codec.check(obj.state_dict())
            except state_codec.StateEncodeError as e:
                raise _unstorable(key, obj, step, e) from None
        self.own_state(step)

    def user_state(self, step: int) -> dict[str, str]:
        """Each other entry's ``state_dict()``, encoded (:func:`ftrain.state_codec.encode`): name ->
        JSON text. SessionError, naming the entry and where in it, for what can never be stored
        (a tensor, a NumPy value, an object; nesting past the bound; a state file past its size)."""
        out = _encoded(self.others, step)
        size = state_codec.entries_size_bytes(out)
        if size > state_codec.MAX_STATE_BYTES:
            biggest = sorted(out, key=lambda k: -len(out[k]))[:3]
            raise SessionError(
                f"the state's non-tensor entries at step {step} take {size} bytes, more than the "
                f"{state_codec.MAX_STATE_BYTES} a session stores ("
                + ", ".join(f"{k!r}: {len(out[k])} bytes" for k in biggest)
                + "): keep what grows without bound (a metrics log) out of the state, or trim it"
            )
        return out

    def check_fits(self, manifest: Manifest, saved: dict[str, Any] | None) -> None:
        """SessionError unless this state can take ``manifest``'s step, whose entries are
        ``saved`` (None: unusable, which :func:`validate` reports as corruption, as it does a
        malformed record of the per-rank entries): an entry for each of ours (a part added since
        is the caller's to decide about)."""
        own = session_per_rank.held(manifest)
        if saved is None or own is None:
            return
        missing = sorted(set(self.others) - set(saved)) + sorted(set(self.per_rank) - set(own))
        if missing:
            raise SessionError(
                f"step {manifest.step} holds no {', '.join(repr(m) for m in missing)} (it holds "
                f"{sorted(saved) or 'no entry besides the model and optimizer'}): it was saved before that part "
                "joined the state; load without it once (session.load({...})), then save with it"
            )
        if self.module is None and manifest.files:
            log.warning("step %d holds model state that this load has no module for", manifest.step)

    def apply(self, manifest: Manifest, saved: dict[str, Any]) -> None:
        """Put the loaded step into the objects (after DCP filled :meth:`state_dict`'s target);
        ``saved``: the step's other entries (:meth:`StateReader.saved`)."""
        sd = self._target
        if self.module is not None:
            if not self.optimizers:
                set_model_state_dict(self.module, sd["model"])
            else:
                form = manifest.layout.get(optim_state.FORMAT_KEY)
                optim_state.load_into(self.module, self.optimizers, sd["model"], sd["optim"], form)
        for key, obj in self.others.items():
            obj.load_state_dict(saved[key])
        for key, obj in self.per_rank.items():
            held = sd.get(session_per_rank.dcp_key(key, self.rank))
            if held is not None:  # else: this rank did not exist when the step was saved
                obj.load_state_dict(session_per_rank.unpack(held, key, manifest.step))


def warn_if_large(entries: dict[str, str], step: int, warned: bool) -> bool:
    """Warn once (``warned``: already) when the encoded non-tensor ``entries`` pass half of what a
    session stores: they grow, and a save past the bound is refused. Returns whether it warned."""
    size = state_codec.entries_size_bytes(entries)
    if warned or size <= state_codec.MAX_STATE_BYTES // 2:
        return warned
    biggest = max(entries, key=lambda k: len(entries[k]))
    log.warning(
        "the state's non-tensor entries take %d bytes at step %d (%r: %d), over half of the %d a session stores: "
        "a save past that is refused; keep what grows without bound out of the state, or trim it",
        size,
        step,
        biggest,
        len(entries[biggest]),
        state_codec.MAX_STATE_BYTES,
    )
    return True


def say(message: str, *, rank: int, verbose: bool, logger: logging.Logger) -> None:
    """A session's line about what it restored or committed, on rank 0: on stderr when ``verbose``
    and the program configured no logging that ``logger`` reaches, else to ``logger`` at INFO."""
    if rank > 0:
        return
    if verbose and not logging_configured(logger):
        print(f"ftrain: {message}", file=sys.stderr, flush=True)
    else:
        logger.info("%s", message)


def logging_configured(logger: logging.Logger) -> bool:
    """Whether the program set up logging that ``logger`` reaches (a handler on it, on ``ftrain``
    or on the root): then a session says things through it, not on stderr itself."""
    current: logging.Logger | None = logger
    while current is not None:
        if current.handlers:
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


__all__ = [
    "STATE_FILE",
    "STATE_FILE_KEY",
    "SessionError",
    "StateParts",
    "StateReader",
    "USER_STATE",
    "WRITER",
    "logging_configured",
    "manifest_fields",
    "say",
    "validate",
    "warn_if_large",
]
