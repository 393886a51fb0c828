"""Write the deployment examples (``make docs``): ``examples/slurm/agent.sh`` and the manifests in
``examples/kubernetes/`` (from the templates in ``scripts/templates/``) start each node's agent with the command line of
:func:`ftrain.agents.launch.agent_command`, the one the chaos cluster and the network-namespace tests
run. ``python scripts/render_examples.py --check`` exits 1 when a committed file is stale.

The command line is built once with placeholders (``@NAME@``) for what each deployment fills in
at run time; Slurm's script writes them as shell variables (``"$NAME"``), Kubernetes as the
container's environment (``$(NAME)``).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from ftrain.agents.launch import agent_command

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
EXAMPLES = REPO / "examples"

PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
#: the agent options whose values each deployment takes from its environment (the job's size)
SIZE_OPTIONS = {"--nnodes": "@FTRAIN_NNODES@", "--nproc-per-node": "@FTRAIN_NPROC_PER_NODE@"}


def node_command() -> list[str]:
    """The agent's command line with a placeholder for every value a node learns at run time."""
    command = agent_command(
        {
            "etcd": "@FTRAIN_ETCD@",
            "job": "@FTRAIN_JOB@",
            "nnodes": "1:2",  # checked values, replaced by placeholders below
            "nproc_per_node": 1,
            "node_id": "@FTRAIN_NODE_ID@",
            "run_dir": "@FTRAIN_RUN_DIR@",
            "host": "@FTRAIN_HOST@",
        },
        "@FTRAIN_CONFIG@",
        overrides=["--checkpoint.uri=@FTRAIN_CHECKPOINT_URI@"],
    )
    for option, placeholder in SIZE_OPTIONS.items():
        command[command.index(option) + 1] = placeholder
    return command


def _shell_word(arg: str) -> str:
    if not PLACEHOLDER.search(arg):
        return shlex.quote(arg)
    return '"' + PLACEHOLDER.sub(r"${\1}", arg) + '"'


#: Slurm's own options: a drain must end before Slurm SIGKILLs the step (KillWait after its SIGTERM)
SLURM_OPTIONS = ["--drain-timeout-s", "@FTRAIN_DRAIN_TIMEOUT_S@"]


def slurm_script() -> str:
    command = node_command()
    split = command.index("--")
    words = [_shell_word(a) for a in (*command[:split], *SLURM_OPTIONS, *command[split:])]
    lines = ["exec " + " ".join(words[:2])]
    rest = words[2:]
    while rest:  # one option and its value per line
        take = 1 if rest[0] == "--" or not rest[0].startswith("--") or len(rest) == 1 else 2
        lines.append("    " + " ".join(rest[:take]))
        rest = rest[take:]
    command = " \\\n".join(lines)
    return (TEMPLATES / "slurm" / "agent.sh").read_text().replace("@COMMAND@", command)


def kubernetes_manifest(template: Path) -> str:
    """A manifest whose container runs the agent's command line with ``$(NAME)`` from its environment."""
    command = [PLACEHOLDER.sub(r"$(\1)", a) for a in node_command()]
    return template.read_text().replace("@COMMAND@", json.dumps(command))


def rendered() -> dict[Path, str]:
    """Every generated example: ``examples/slurm/agent.sh`` and one manifest per template in
    ``scripts/templates/kubernetes/``."""
    out = {EXAMPLES / "slurm" / "agent.sh": slurm_script()}
    for template in sorted((TEMPLATES / "kubernetes").glob("*.yaml")):
        out[EXAMPLES / "kubernetes" / template.name] = kubernetes_manifest(template)
    return out


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path, text in rendered().items():
        if path.exists() and path.read_text() == text:
            continue
        if check:
            stale.append(str(path.relative_to(REPO)))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.suffix == ".sh":
            path.chmod(0o755)
    if stale:
        print(f"stale: {', '.join(stale)}: run `make docs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
