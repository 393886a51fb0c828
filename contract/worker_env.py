"""What a node agent tells the workers it starts: ``FTRAIN_*`` environment variables.

The agent builds a :class:`WorkerEnv` and exports :meth:`WorkerEnv.to_env`; a worker reads it
back with :meth:`WorkerEnv.from_env`. A worker started without an agent (plain torchrun, a
test) sees the defaults: round 0, no heartbeat, no fence.

What must stay true: a value the worker cannot use (a round that is not a plain non-negative
integer, a pid that is not one) stops the worker at start with a :class:`WorkerEnvError`
naming the variable. A worker that cannot say which round it is in must not train: its
heartbeats would be ignored and its commits fenced off anyway. No secret travels in this
environment: etcd credentials are in the 0600 file that ``FTRAIN_ETCD_CLIENT_FILE`` names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ftrain.contract.config import ConfigError
from ftrain.contract.heartbeat import PID_MAX

JOB = "FTRAIN_JOB"
ROUND = "FTRAIN_ROUND"
NODE = "FTRAIN_NODE"
ETCD = "FTRAIN_ETCD"
FENCE_KEY = "FTRAIN_FENCE_KEY"
COMMITS_KEY = "FTRAIN_COMMITS_KEY"
HEARTBEAT = "FTRAIN_HEARTBEAT"
AGENT_PID = "FTRAIN_AGENT_PID"
STACK_DIR = "FTRAIN_STACK_DIR"
ETCD_CLIENT_FILE = "FTRAIN_ETCD_CLIENT_FILE"
CONTROL = "FTRAIN_CONTROL"
RUN_ID = "FTRAIN_RUN_ID"
#: the job's event log, for a script's workers (ftrain train's read logging.events_path)
EVENTS = "FTRAIN_EVENTS"
#: where a script's :class:`ftrain.ResumableSampler` appends the consumption ledger
#: (:mod:`ftrain.data.ledger`): set by ``ftrain chaos run`` for a script job, so that the chaos
#: checks prove each sample consumed once; unset (the default), the sampler writes nothing
LEDGER_DIR = "FTRAIN_LEDGER_DIR"
"""This launch of the job (a run id), where the launcher knows one: the memory tier binds its
snapshots in ``checkpoint.memory_dir`` to it, so that a later run of the same job never resumes
from them. It must change when the job is started anew and stay the same while the job restarts
its workers. Without it a worker uses what its launcher tells it (:mod:`ftrain.recovery.tier_binding`)."""

ETCD_PASSWORD = "FTRAIN_ETCD_PASSWORD"
"""The etcd password of ``ftrain agent``/``status``/torchrun's ``etcd-v3`` (never a command line).
Never passed on to workers, and neither is an inherited client file: see :data:`NOT_INHERITED`."""
NOT_INHERITED = (ETCD_PASSWORD, ETCD_CLIENT_FILE)

#: the largest round accepted (an etcd-revision-sized counter fits easily)
MAX_ROUND = 2**62
#: the longest run id accepted (a manifest records it)
MAX_RUN_ID_CHARS = 200


class WorkerEnvError(ConfigError):
    """An ``FTRAIN_*`` variable holds something a worker cannot use; ``key`` names it."""


def _natural(environ: Mapping[str, str], name: str, high: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or len(raw) > 19 or int(raw) > high:
        raise WorkerEnvError(
            name,
            f"must be an integer in [0, {high}], got {raw[:40]!r} (it is set by the ftrain "
            "agent; unset it to run without one)",
        )
    return int(raw)


def _printable(environ: Mapping[str, str], name: str, longest: int) -> str:
    raw = environ.get(name, "")
    if len(raw) > longest or not raw.isprintable() or raw != raw.strip():
        raise WorkerEnvError(
            name, f"must be at most {longest} printable characters without surrounding blanks, got {raw[:40]!r}"
        )
    return raw


@dataclass(frozen=True, slots=True)
class WorkerEnv:
    job: str = ""  #: the job id (manifests record it; signed ones are bound to it)
    round: int = 0  #: the rendezvous round: the fencing token of this worker's commits
    node: str = ""  #: the node id of the agent
    etcd: tuple[str, ...] = ()  #: etcd client URLs, for the commit fence
    fence_key: str = ""  #: the job's round key in etcd, compared before every commit
    commits_key: str = ""  #: the etcd prefix where each commit is recorded, atomically with that compare
    heartbeat: str = ""  #: the agent's Unix datagram socket (:mod:`ftrain.contract.heartbeat`)
    agent_pid: int = 0  #: the worker ends itself once this process is gone (0: no watchdog)
    stack_dir: str = ""  #: where SIGUSR1 makes the worker write its threads' stacks
    etcd_client_file: str = ""  #: 0600 JSON file with the etcd credentials and TLS files
    control: str = ""  #: a live worker's control file (:mod:`ftrain.contract.control`); empty under torchrun
    run_id: str = ""  #: this launch of the job (:data:`RUN_ID`); empty: the worker derives one
    events: str = ""  #: the event log a script's session appends to (:data:`EVENTS`); empty: none
    ledger_dir: str = ""  #: where a script's ResumableSampler records what it consumed (:data:`LEDGER_DIR`)

    def to_env(self) -> dict[str, str]:
        """The variables to export (only those with a value)."""
        values = {
            JOB: self.job,
            ROUND: str(self.round),
            NODE: self.node,
            ETCD: ",".join(self.etcd),
            FENCE_KEY: self.fence_key,
            COMMITS_KEY: self.commits_key,
            HEARTBEAT: self.heartbeat,
            AGENT_PID: str(self.agent_pid) if self.agent_pid else "",
            STACK_DIR: self.stack_dir,
            ETCD_CLIENT_FILE: self.etcd_client_file,
            CONTROL: self.control,
            RUN_ID: self.run_id,
            EVENTS: self.events,
            LEDGER_DIR: self.ledger_dir,
        }
        return {k: v for k, v in values.items() if v}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """This process's (or ``environ``'s) values; :class:`WorkerEnvError` on an unusable one."""
        env = os.environ if environ is None else environ
        return cls(
            job=env.get(JOB, ""),
            round=_natural(env, ROUND, MAX_ROUND),
            node=env.get(NODE, ""),
            etcd=tuple(e for e in env.get(ETCD, "").split(",") if e),
            fence_key=env.get(FENCE_KEY, ""),
            commits_key=env.get(COMMITS_KEY, ""),
            heartbeat=env.get(HEARTBEAT, ""),
            agent_pid=_natural(env, AGENT_PID, PID_MAX),
            stack_dir=env.get(STACK_DIR, ""),
            etcd_client_file=env.get(ETCD_CLIENT_FILE, ""),
            control=env.get(CONTROL, ""),
            run_id=_printable(env, RUN_ID, MAX_RUN_ID_CHARS),
            events=env.get(EVENTS, ""),
            ledger_dir=env.get(LEDGER_DIR, ""),
        )


def worker_environment(base: Mapping[str, str], extra: Mapping[str, str], ours: Mapping[str, str]) -> dict[str, str]:
    """The workers' whole environment: ``base`` (the agent's) less :data:`NOT_INHERITED`, then
    ``extra`` (the job's worker_env, same filter), then ``ours`` (:meth:`WorkerEnv.to_env` and
    whatever else the agent sets)."""
    env = {k: v for k, v in base.items() if k not in NOT_INHERITED}
    env.update({k: v for k, v in extra.items() if k not in NOT_INHERITED})
    env.update(ours)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
