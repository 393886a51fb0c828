"""Where a job keeps its records in etcd, and which agents follow which keys.

Everything lives under ``/ftrain/jobs/<job>/``::

    nodes/<node_id>            NodeRecord, on the agent's lease (gone when the agent is)
    leader                     node id of the leader, on its lease (election = put-if-absent)
    round                      the current round number as text: the fencing token
    rounds/<g>                 RoundRecord: members in node-rank order, why it was formed
    rounds/<g>/master          "host:port" of round g's rendezvous, written by its node-rank-0 agent
    rounds/<g>/hang            node id of the first member that reported a hang in round g
    rounds/<g>/stragglers      the members the leader sees as stragglers (JSON list), on change
    commits/<step>             the checkpoint fence's commit record of a step
    dump                       DumpRequest: ``ftrain status --dump``
    final                      FinalStatus: the job is over (succeeded or failed)
    status/<node>              NodeStatus, on the agent's lease (rate: :mod:`ftrain.agents.agent_status`)
    tally/<g>/started/<node>   the agent launched its workers for round g
    tally/<g>/reports/<node>   Report: how round g ended on that node

Every agent follows the keys before ``status/`` (:attr:`JobKeys.member_range`: a handful of keys
plus one per node, changing when the membership or the round does); only the leader also
follows ``status/`` and ``tally/`` (:attr:`JobKeys.leader_range`: one or more keys per node
that change all the time). Each agent keeps them in a local view fed by a watch
(:mod:`ftrain.agents.job_view`) and decides on the whole of it, level by level, so an agent that
missed events, restarted or lost etcd for a while acts on what is true now rather than on a
history it may have half seen. Each record is decoded once per change (:mod:`ftrain.agents.records`).

What must stay true: ids are one path segment (:func:`validate_id`); the keys every agent follows
(:attr:`JobKeys.member_range`) and the leader's (:attr:`JobKeys.leader_range`) never overlap, and
a round's per-node keys live under ``tally/<g>/`` so that a follower never sees one per node per
round.
"""

from __future__ import annotations

import re

ROOT = "/ftrain/jobs"

#: Job ids and node ids: one etcd key path segment, printable, bounded.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_id(value: str, option: str) -> str:
    """``value`` if it is a valid job or node id, else ValueError naming ``option`` and the fix.

    What must stay true: every id that reaches a key path is one segment matching
    :data:`ID_PATTERN` (no ``/``, no spaces, no control characters, at most 64 characters).
    """
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{option}: bad id {value!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, starting with a "
            f"letter or digit (e.g. {option} node-1)"
        )
    return value


class JobKeys:
    def __init__(self, job: str):
        self.job = validate_id(job, "--job")
        self.prefix = f"{ROOT}/{job}/"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}nodes/{node_id}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    @property
    def round(self) -> str:
        return f"{self.prefix}round"

    @property
    def commits(self) -> str:
        """Prefix of the checkpoint commit records (one per committed step, written by the
        workers' fence: the commit point)."""
        return f"{self.prefix}commits/"

    def round_record(self, g: int) -> str:
        return f"{self.prefix}rounds/{g}"

    def master(self, g: int) -> str:
        return f"{self.prefix}rounds/{g}/master"

    def hang(self, g: int) -> str:
        """The first member that reported a hang in round g (what the other members dump for)."""
        return f"{self.prefix}rounds/{g}/hang"

    def stragglers(self, g: int) -> str:
        """The members the leader sees as stragglers in round g (JSON list of node ids), written
        when that set changes: how a follower knows its waiting is a straggler's cost."""
        return f"{self.prefix}rounds/{g}/stragglers"

    def tally(self, g: int) -> str:
        """Prefix of round g's per-node keys, read by the leader alone (and ``ftrain status``)."""
        return f"{self.prefix}tally/{g}/"

    def started(self, g: int, node_id: str) -> str:
        return f"{self.tally(g)}started/{node_id}"

    def report(self, g: int, node_id: str) -> str:
        return f"{self.tally(g)}reports/{node_id}"

    @property
    def member_range(self) -> tuple[str, str]:
        """[start, end) of the keys every agent follows: all but ``status/`` and ``tally/``."""
        return self.prefix, f"{self.prefix}status/"

    @property
    def leader_range(self) -> tuple[str, str]:
        """[start, end) of the keys only the leader follows: every node's ``status/`` and every
        round's ``tally/`` (they grow with the job's size and change all the time)."""
        return f"{self.prefix}status/", f"{self.prefix}tally0"  # "0" follows "/"

    def status(self, node_id: str) -> str:
        return f"{self.prefix}status/{node_id}"

    @property
    def final(self) -> str:
        return f"{self.prefix}final"

    @property
    def dump(self) -> str:
        """``ftrain status --dump``: every agent dumps its workers' flight records and stacks."""
        return f"{self.prefix}dump"


__all__ = ["ID_PATTERN", "ROOT", "JobKeys", "validate_id"]
