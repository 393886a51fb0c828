"""``duplicate_node``: a second agent starts with the node id of a live node; it must be refused
(exit code 2, "already registered"), which the record's ``refused`` says."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_node
from ftrain.testbed.procs import quiet_env


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node = pick_node(ctx, spec.node)
    dup = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftrain",
            "agent",
            "--etcd",
            ctx.cluster.etcd,
            "--job",
            ctx.cluster.job,
            "--nnodes",
            "1:8",
            "--node-id",
            node,
            "--",
            *ctx.cluster.worker_args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=quiet_env(**ctx.cluster.env),
    )
    refused = dup.returncode == 2 and "already registered" in dup.stderr
    return ctx.emit(spec.kind, node=node, refused=refused, exit_code=dup.returncode, stderr=dup.stderr.strip()[-300:])


FAULT = FAULTS.register(Fault(kind="duplicate_node", act=_act, outcome=Outcome.REFUSED))
