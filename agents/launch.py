"""The command line that starts one node's agent, written once.

The chaos cluster (and with it every test on network namespaces) and the deployment examples
(``scripts/render_examples.py`` writes ``examples/slurm/`` and ``examples/kubernetes/``) all build it
here, so that what the tests run is what a cluster runs. A node's command line sets the keys of
:data:`NODE_KEYS`; every other ``[agent]`` setting comes from the job's config file or from
``options`` (the tests' faster timeouts). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ftrain.agents.config import agent_flags

#: The ``[agent]`` keys that differ between nodes or jobs and so are given on each node's command line.
NODE_KEYS = ("etcd", "job", "nnodes", "nproc_per_node", "node_id", "run_dir", "host")


def agent_command(
    node: Mapping[str, Any],
    config: str,
    *,
    options: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> list[str]:
    """``ftrain agent`` for one node: ``node`` gives every key of :data:`NODE_KEYS` (a
    ``ConfigError`` names a bad value before anything starts), ``options`` more agent options,
    ``config`` the job's TOML file and ``overrides`` its ``--section.key=value`` overrides.
    The first word is the ``ftrain`` command (``python -m`` runs the same from a checkout)."""
    missing = [k for k in NODE_KEYS if k not in node]
    unknown = sorted(set(node) - set(NODE_KEYS))
    if missing or unknown:
        raise ValueError(f"agent_command: missing keys {missing}, unknown keys {unknown} (the keys: {NODE_KEYS})")
    return ["ftrain", "agent", *agent_flags({k: node[k] for k in NODE_KEYS}), *options, "--", config, *overrides]
