"""ftrain's checkpoints, resume, the node agent's supervision and live recovery for a Lightning
Fabric loop (docs/lightning.md).

```python
import ftrain
from ftrain.integrations.lightning import session_fabric, session_state

def train(session):                                     # the loop of one round
    fabric = session_fabric(session, strategy="ddp")    # a launched Fabric on the round's group
    model, optim = fabric.setup(build_model(), make_optimizer)
    state = session_state(model, optim, sched=sched, sampler=sampler)
    for step in range(session.load(state), total_steps):
        ...                                             # fabric.backward(loss), optim.step(), ...
        session.step(step + 1, state)
    session.finish(total_steps, state)

ftrain.Session("s3://bucket/run", interval_steps=100).run(train)
```

**Why Fabric, not Lightning's Trainer.** Fabric leaves the loop to the user, which is what
:class:`ftrain.Session` needs: under ``ftrain agent --recovery live``, :meth:`Session.run` calls the
loop of one round again, in the same process, for each new round (another world size, a new
process group), and the loop builds what depends on the world size inside it. A Fabric is cheap
to build per round. ``lightning.Trainer`` owns its loop, its checkpoints and its process group's
life; it could only be restarted.

**What the glue is, and why.** Two functions, nothing patched:

- :func:`session_fabric` builds ``Fabric(...)`` for the session's round and calls its ``launch()``.
  Fabric keeps a process group that exists (its ``_init_dist_connection`` returns early when
  ``torch.distributed.is_initialized()``), so it trains in the group the session made for the
  round. What it does *not* do by itself is agree with that group on the ranks: it picks its
  cluster environment by detection (torchelastic's ``TORCHELASTIC_RUN_ID``, else SLURM, LSF, MPI,
  else its own, which computes ``node_rank * devices + local_rank``), and it requires
  ``devices * num_nodes`` to equal the world size. A live round's worker is not started by
  torchrun (no ``TORCHELASTIC_RUN_ID``), a group of one has no ``RANK`` at all, and a SLURM job's
  variables would win over torchrun's. So the Fabric gets :class:`SessionEnvironment`, which
  reports the session's own rank, world size and local rank, and ``devices``/``num_nodes`` from
  the round (``LOCAL_WORLD_SIZE`` per node).
- :func:`session_state` builds the mapping the session saves from what ``fabric.setup`` returned:
  the underlying module (``_FabricModule.module``) and torch optimizers
  (``_FabricOptimizer.optimizer``), Fabric's public attributes. A wrapped optimizer would also pass
  the session's checks (Fabric makes it a subclass of the optimizer's class), but its
  ``state_dict`` is Fabric's strategy's, not torch's; the unwrapped objects are exactly what a
  plain loop saves, so a Fabric run's steps and a plain loop's are the same checkpoints.

**Strategies.** ``"ddp"`` (and one process: ``"auto"``), tested on CPU/gloo, live recovery
included. Fabric's ``"fsdp"`` is refused on CPU by Fabric itself ("FSDP is only available on
GPU"); it is not tested with ftrain (no GPU here), so :func:`session_fabric` refuses it too, as it
refuses strategies that start processes of their own (``"ddp_spawn"``, ``"ddp_fork"``,
``"ddp_notebook"``, ``DDPStrategy(start_method="spawn")``: they cannot join the session's group),
and ``"deepspeed"``/``"xla"`` (checkpoints and groups of their own): :class:`LightningError`,
whose message names the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer

from ftrain.session import Session, SessionError

#: the strategies :func:`session_fabric` builds (names of Fabric's registry)
SUPPORTED = ("auto", "ddp", "single_device")


class LightningError(SessionError):
    """A Fabric set up in a way ftrain cannot checkpoint or recover; the message says the fix."""


class SessionEnvironment(ClusterEnvironment):
    """Fabric's cluster environment for a :class:`ftrain.Session`'s round: the ranks of the
    process group the session joined (or made), never Fabric's own guesses. Fabric creates no
    process here (the launcher or the agent did) and no group (the session did)."""

    def __init__(self, session: Session):
        super().__init__()
        if not session.started:
            raise LightningError(
                "the session is not started: build the Fabric inside the loop that session.run(train) calls "
                "(or after session.start())"
            )
        self._rank, self._world, self._local = session.rank, session.world_size, session.local_rank
        self._local_world = local_world_size(session)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:  # read by no one here: the group exists already
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._world

    def set_world_size(self, size: int) -> None:  # Fabric's own count; the group's is the truth
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._local

    def node_rank(self) -> int:
        return self._rank // self._local_world

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self._world:
            raise LightningError(
                f"Fabric(devices={num_devices}, num_nodes={num_nodes}) is {num_devices * num_nodes} processes, but "
                f"the session's round has {self._world}: let session_fabric() set devices and num_nodes"
            )

    def teardown(self) -> None:  # the group is the session's to end
        pass


def local_world_size(session: Session) -> int:
    """Processes per node in the session's round (the launcher's ``LOCAL_WORLD_SIZE``; 1 alone)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    if local < 1 or session.world_size % local:
        raise LightningError(
            f"world size {session.world_size} is not a whole number of nodes of LOCAL_WORLD_SIZE={local} processes: "
            "Fabric needs the same number of processes on every node (ftrain agent --nproc-per-node)"
        )
    return local


def session_fabric(session: Session, *, strategy: str | Strategy = "auto", **kwargs: Any) -> Fabric:
    """A launched ``Fabric`` for the session's current round: its ranks are the session's (its
    process group), ``devices`` the round's processes per node, ``num_nodes`` the round's nodes.
    Every other argument is Fabric's (``accelerator``, ``precision``, ``loggers``, ...); build it
    inside the loop of one round, after :meth:`Session.run` or :meth:`Session.start` started it."""
    for taken in ("devices", "num_nodes", "plugins"):
        if taken in kwargs:
            raise LightningError(
                f"session_fabric() sets {taken}= from the session's round (its world size changes under live "
                f"recovery): leave {taken}= out"
            )
    env = SessionEnvironment(session)
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    if (
        strategy not in SUPPORTED
        if isinstance(strategy, str)
        else type(strategy) not in (DDPStrategy, SingleDeviceStrategy)
    ):
        raise LightningError(
            f"Fabric(strategy={name!r}) is not supported with ftrain.Session: use strategy='ddp' (or 'auto' on one "
            "process). Spawning strategies (ddp_spawn, ddp_fork, ddp_notebook) start processes that cannot join the "
            "session's process group; 'fsdp' runs on GPUs only in Fabric and is not tested with ftrain yet; "
            "deepspeed and xla keep checkpoints and groups of their own"
        )
    if "accelerator" not in kwargs and dist_backend() == "gloo":
        kwargs["accelerator"] = "cpu"  # a gloo group: CPU tensors, even on a host with GPUs
    local = local_world_size(session)
    fabric = Fabric(strategy=strategy, devices=local, num_nodes=session.world_size // local, plugins=[env], **kwargs)
    launcher = fabric.strategy.launcher  # popen's starts nothing when the processes exist (our environment says so)
    if launcher is not None and not isinstance(launcher, _SubprocessScriptLauncher):  # start_method="spawn", ...
        raise LightningError(
            f"Fabric's {type(fabric.strategy).__name__} would start processes of its own "
            f"({type(launcher).__name__}), which cannot join the session's process group: use "
            "DDPStrategy's default start_method='popen' (the launcher or ftrain agent started the processes)"
        )
    fabric.launch()  # Fabric's setup_environment: finds the group initialised and keeps it
    if (fabric.global_rank, fabric.world_size) != (session.rank, session.world_size):
        raise LightningError(
            f"Fabric sees rank {fabric.global_rank} of {fabric.world_size}, the session rank {session.rank} of "
            f"{session.world_size}: build the Fabric with session_fabric() inside the round's loop"
        )
    return fabric


def dist_backend() -> str:
    return str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else ""


def session_state(model: Any, *optimizers: Any, **others: Any) -> dict[str, Any]:
    """The state a :class:`ftrain.Session` saves for a Fabric loop: ``model`` (what
    ``fabric.setup`` returned, or the module itself) unwrapped to its ``nn.Module``, each optimizer
    to its torch optimizer, and ``others`` as they are (an LR scheduler, the sampler, counters:
    anything with ``state_dict()``/``load_state_dict()``). Keys: ``model``, ``optim`` (``optim1``,
    ... for more), then ``others``' names."""
    module = model.module if isinstance(model, _FabricModule) else model
    if not isinstance(module, torch.nn.Module):
        raise LightningError(f"session_state(model, ...): {type(model).__name__} is not an nn.Module")
    state: dict[str, Any] = {"model": module}
    for i, opt in enumerate(optimizers):
        inner = opt.optimizer if isinstance(opt, _FabricOptimizer) else opt
        if not isinstance(inner, torch.optim.Optimizer):
            raise LightningError(f"session_state(): optimizer {i} is a {type(opt).__name__}, not a torch optimizer")
        state["optim" if i == 0 else f"optim{i}"] = inner
    clash = sorted(set(others) & set(state))
    if clash:
        raise LightningError(f"session_state(): {clash} name the model or an optimizer: give those entries other names")
    state.update(_plain(others))
    return state


def _plain(others: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, obj in others.items():
        if isinstance(obj, (_FabricModule, _FabricOptimizer)):
            raise LightningError(
                f"session_state(): {name!r} is a second model or optimizer from fabric.setup: a session saves one "
                "model and its optimizers (pass optimizers positionally)"
            )
        out[name] = obj
    return out


__all__ = ["LightningError", "SessionEnvironment", "session_fabric", "session_state"]
