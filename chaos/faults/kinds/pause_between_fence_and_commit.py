"""``pause_between_fence_and_commit``: the coordinator (rank 0) of round ``round`` (default 1)
stops itself (SIGSTOP, armed from the start through ``FTRAIN_FAULT_PAUSE_AFTER_FENCE``) in the
save of step ``save_step``, right after its fence check passed and before its commit. The fault
then freezes that node's agent too (a frozen host: nothing there kills the worker), waits until
the others formed a newer round without it and completed a step in it, and continues the
worker: it stores its manifest, and its commit record must be refused (the etcd transaction
checks the round). The record's ``refused`` says whether it was: the refusal is in the worker's
log, the zombie's manifest of that step is on storage, and etcd holds no commit record of it.
The agent is continued last, and its node rejoins without a human."""

from __future__ import annotations

import signal
from typing import Any

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultError, FaultSpec
from ftrain.chaos.faults.targets import continue_process, is_stopped, send_signal
from ftrain.checkpoint.catalog import list_steps
from ftrain.contract import events as ev
from ftrain.contract.events import Event
from ftrain.testbed.wait import WaitTimeout, wait_for


def _armed(spec: FaultSpec) -> tuple[int, int]:
    try:
        return int(spec.params["save_step"]), int(spec.params.get("round", 1))
    except (KeyError, TypeError, ValueError):
        raise FaultError(f"{spec.kind}: save_step (a checkpoint step) is required, round an int") from None


def _worker_env(spec: FaultSpec) -> dict[str, str]:
    save_step, round_ = _armed(spec)
    return {"FTRAIN_FAULT_PAUSE_AFTER_FENCE": f"{save_step}:0:{round_}"}


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    save_step, round_ = _armed(spec)
    cluster, keys = ctx.cluster, JobKeys(ctx.cluster.job)
    try:
        zombie = wait_for(
            lambda: next((e for e in cluster.events(Event.WORKER_STARTED, round=round_) if e["rank"] == 0), None),
            180,
            f"rank 0 of round {round_}",
        )
        wait_for(lambda: ctx.stop() or is_stopped(zombie["pid"]), 180, f"rank 0 to stop in the save of {save_step}")
    except WaitTimeout as e:
        raise FaultError(f"{spec.kind}: {e}") from None
    if ctx.stop():
        return ctx.emit(spec.kind, node=zombie["node"], refused=False, why="the run ended first")
    node, agent = zombie["node"], cluster.agents[zombie["node"]].pid
    send_signal(agent, signal.SIGSTOP)  # the frozen host
    record = ctx.emit(spec.kind, node=node, pid=zombie["pid"], step=save_step, round=round_)
    refused, why = False, ""
    try:
        newer = wait_for(
            lambda: (
                ctx.stop() or [m for m in cluster.metrics() if m.get("round", 0) > round_ and m["step"] > save_step]
            ),
            120,
            f"a round after {round_} to train without {node}",
        )
        continue_process(zombie["pid"])  # past its fence check: it stores its manifest and tries to commit
        log = cluster.workdir / node / "workers.log"
        line = f"round {round_} is no longer current ({keys.round} moved on)"
        wait_for(lambda: ctx.stop() or line in log.read_text(errors="replace"), 60, "the zombie's commit to be refused")
        fence = EtcdRoundFence(cluster.etcd_endpoints, keys.round, commits_key=keys.commits)
        recorded = fence.recorded() or {}
        stored = next((s for s in list_steps(ctx.storage, job=cluster.job) if s.step == save_step), None)
        zombie_manifest = stored is not None and stored.manifest is not None and stored.manifest.round == round_
        # the window was hit (the zombie stored its manifest after the newer round trained) and
        # its commit record was refused: what a reader trusts says the step is not committed
        refused = newer is not True and zombie_manifest and save_step not in recorded
        why = f"stored manifest of round {round_}: {zombie_manifest}; recorded steps {sorted(recorded)}"
    except WaitTimeout as e:
        why = str(e)
    finally:
        continue_process(zombie["pid"])
        continue_process(agent)
        ctx.events.emit(ev.ChaosNodeBack(node=node))
    record.update(refused=refused, why=why)
    ctx.events.emit(ev.ChaosFaultDone(kind=spec.kind, detail={"refused": refused, "why": why}))
    return record


FAULT = FAULTS.register(
    Fault(
        kind="pause_between_fence_and_commit",
        act=_act,
        outcome=Outcome.REFUSED,
        worker_env=_worker_env,
        cuts_node=True,
    )
)
