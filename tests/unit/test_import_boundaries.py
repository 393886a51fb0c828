"""The layers of DESIGN.md, enforced on the source (every import, at any depth) and at runtime.

Every module belongs to exactly one layer (the longest matching prefix below) and may import only
the layers listed for it; there are no per-file exemptions.

| layer | modules | may import |
|---|---|---|
| contract | `ftrain.contract` | the standard library |
| checkpoint | `ftrain.checkpoint` | contract (+ torch, fsspec, ...) |
| runtime | `ftrain` | contract, checkpoint (+ torch, numpy) |
| agents | `ftrain.agents` | contract (never torch) |
| torchrun plugin | `ftrain.torchrun_plugin`, `ftrain.agents.torchrun_{rdzv,store}` (below) | contract, agents, torch |
| testbed | `ftrain.testbed` | contract, agents, checkpoint |
| chaos | `ftrain.chaos` | everything below the CLI |
| cli | `ftrain.cli`, `ftrain.__main__` | everything |

Inside the runtime layer, each room may import only the rooms listed for it (imports that can
run; ``if TYPE_CHECKING:`` names types only), and the runtime's modules import each other in no
circle (``scripts/import_graph.py``):

| room | modules | may import (of the runtime) |
|---|---|---|
| training | the rest: `ftrain.config`, `train`, `models`, `data`, ... | parallel, recovery, agent link, observability |
| parallel | `ftrain.parallel` (strategies, torch mechanisms, pipeline arithmetic) | training |
| recovery | `ftrain.recovery` | training, parallel, agent link |
| agent link | `ftrain.agent_link` | nothing |
| observability | `ftrain.observability` | nothing |
| planning | `ftrain.planning` | training, parallel |
| integrations | `ftrain.integrations` (a framework's loop: Hugging Face's `Trainer`) | training |

torch imports ``ftrain.torchrun_plugin`` (the entry point) in every process that imports its
rendezvous package; that module imports the backend, ``ftrain.agents.torchrun_rdzv``, only when
torchrun asks for the ``etcd-v3`` handler, in torchrun's process.

The checkout keeps ``agents/``, ``checkpoint/``, ``chaos/``, ``contract/`` and ``testbed/`` at its
top; ``ftrain/<name>`` links to each (one import namespace: see pyproject.toml).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ftrain.testbed.jobs import TINY_CONFIG, worker_env
from ftrain.testbed.procs import REPO
from tests.script_support import load_script

GRAPH = load_script("import_graph")
#: folder of the checkout -> the package it is imported as
PACKAGES = GRAPH.FOLDERS
LAYER_OF = {
    "ftrain.contract": "contract",
    "ftrain.checkpoint": "checkpoint",
    "ftrain": "runtime",
    "ftrain.cli": "cli",
    "ftrain.__main__": "cli",
    "ftrain.agents": "agents",
    "ftrain.torchrun_plugin": "torchrun plugin",
    "ftrain.agents.torchrun_rdzv": "torchrun plugin",
    "ftrain.agents.torchrun_store": "torchrun plugin",
    "ftrain.testbed": "testbed",
    "ftrain.chaos": "chaos",
}
MAY_IMPORT = {
    "contract": set(),
    "checkpoint": {"contract"},
    "runtime": {"contract", "checkpoint"},
    "agents": {"contract"},
    "torchrun plugin": {"contract", "agents"},
    "testbed": {"contract", "agents", "checkpoint"},
    "chaos": {"contract", "checkpoint", "runtime", "agents", "torchrun plugin", "testbed"},
    "cli": set(LAYER_OF.values()),
}
#: third-party packages a layer must not import (beyond the layer table)
NEVER = {"contract": ("torch", "numpy"), "agents": ("torch",)}
STDLIB = set(sys.stdlib_module_names)


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name, or None for a module outside ftrain's packages."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYER_OF.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def violations(repo: Path = REPO) -> list[str]:
    bad = []
    files = GRAPH.modules(repo)
    for module, path in files.items():
        layer = layer_of(module)
        assert layer is not None, module
        for lineno, name in GRAPH.imports(path, module, set(files), annotations=True):
            target = layer_of(name)
            where = f"{path.relative_to(repo)}:{lineno} imports {name}"
            if target is not None and target != layer and target not in MAY_IMPORT[layer]:
                bad.append(f"{where} (layer {layer} may not import layer {target})")
            elif target is None and name.split(".")[0] in NEVER.get(layer, ()):
                bad.append(f"{where} (layer {layer} may not import {name.split('.')[0]})")
            elif target is None and layer == "contract" and name.split(".")[0] not in STDLIB:
                bad.append(f"{where} (the contract is standard library only)")
    return bad


def test_every_module_respects_its_layer():
    assert violations() == []


ROOM_OF = {
    "ftrain.parallel": "parallel",
    "ftrain.recovery": "recovery",
    "ftrain.agent_link": "agent link",
    "ftrain.observability": "observability",
    "ftrain.planning": "planning",
    "ftrain.integrations": "integrations",
}
ROOM_MAY_IMPORT = {
    "training": {"parallel", "recovery", "agent link", "observability"},
    "parallel": {"training"},
    "recovery": {"training", "parallel", "agent link"},
    "agent link": set(),
    "observability": set(),
    "planning": {"training", "parallel"},
    "integrations": {"training"},
}


def room_of(module: str) -> str | None:
    """The room of a runtime module (None outside the runtime layer)."""
    if layer_of(module) != "runtime" or module == "ftrain.torchrun_plugin":
        return None
    return next((room for prefix, room in ROOM_OF.items() if module.startswith(prefix + ".")), "training")


def room_violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        room = room_of(module)
        for target in sorted(targets):
            other = room_of(target)
            if room is not None and other not in (None, room) and other not in ROOM_MAY_IMPORT[room]:
                bad.append(f"{module} imports {target} (room {room} may not import room {other})")
    return bad


def test_every_runtime_module_respects_its_room_and_none_imports_in_a_circle():
    edges = GRAPH.graph()
    assert room_violations(edges) == []
    assert GRAPH.circles(edges) == []
    rooms = {p.name for p in (REPO / "ftrain").iterdir() if (p / "__init__.py").is_file() and not p.is_symlink()}
    assert set(ROOM_OF) == {f"ftrain.{name}" for name in rooms - {"cli", "data", "models"}}, (
        "a new room needs its rules"
    )


def test_room_and_circle_checkers_catch_violations():
    edges = {
        "ftrain.agent_link.fence": {"ftrain.train", "ftrain.contract.control"},
        "ftrain.train": {"ftrain.planning.plan", "ftrain.recovery.live"},
        "ftrain.recovery.live": {"ftrain.train"},
        "ftrain.planning.plan": set(),
    }
    assert room_violations(edges) == [
        "ftrain.agent_link.fence imports ftrain.train (room agent link may not import room training)",
        "ftrain.train imports ftrain.planning.plan (room training may not import room planning)",
    ]
    assert GRAPH.circles(edges) == [["ftrain.recovery.live", "ftrain.train"]]


def test_nothing_imports_a_folder_by_its_bare_name():
    """``import agents`` would find a user's own ``agents/`` first (under ``python -m``): every
    import of the project, in its packages, tests, benches and scripts, goes through ``ftrain``."""
    bare = set(PACKAGES) - {"ftrain"}
    found = []
    for top in (*PACKAGES, "tests", "bench", "scripts"):
        for path in GRAPH.sources(REPO / top):
            for lineno, name in GRAPH.imports(path, "tests.x", set(), annotations=True):
                if name.split(".")[0] in bare:
                    found.append(f"{path.relative_to(REPO)}:{lineno} imports {name}: import ftrain.{name}")
    assert found == []


def test_rule_checker_catches_violations(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "checkpoint" / "bad.py").write_text("def f():\n    from ftrain.train import train\n")
    (tmp_path / "ftrain" / "worker.py").write_text("import ftrain.agents.agent\n")
    (tmp_path / "agents" / "x.py").write_text("from . import y\nimport torch.nn\n")
    (tmp_path / "contract" / "env.py").write_text("import requests\n")
    assert violations(tmp_path) == [
        "contract/env.py:1 imports requests (the contract is standard library only)",
        "checkpoint/bad.py:2 imports ftrain.train (layer checkpoint may not import layer runtime)",
        "ftrain/worker.py:1 imports ftrain.agents.agent (layer runtime may not import layer agents)",
        "agents/x.py:2 imports torch.nn (layer agents may not import torch)",
    ]


def test_every_package_is_mapped_to_a_layer_and_imported_inside_ftrain():
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench", "scripts"}
    assert on_disk == set(PACKAGES)
    for folder, package in PACKAGES.items():
        assert layer_of(package) is not None, package
        if folder != "ftrain":
            link = REPO / "ftrain" / folder
            assert link.is_symlink() and link.resolve() == (REPO / folder).resolve(), f"{link} must link to {folder}/"


def test_agents_and_data_import_without_torch():
    """The agent must start fast and outlive worker crashes; the data package is numpy-only."""
    code = (
        "import sys, pkgutil, importlib, ftrain.data, ftrain.torchrun_plugin\n"
        "import ftrain.agents as agents, ftrain.contract as contract\n"
        "for pkg in (agents, contract):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if m.name not in ('ftrain.agents.torchrun_rdzv', 'ftrain.agents.torchrun_store'):\n"
        "            importlib.import_module(m.name)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_a_worker_loads_no_agent_chaos_or_testbed_code(tmp_path):
    """``ftrain train`` (what torchrun starts per rank) runs a real step and a checkpoint save; the
    interpreter's import log shows every module it loaded."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_CONFIG)
    run = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "ftrain",
            "train",
            str(cfg),
            "--train.steps=2",
            f"--checkpoint.uri={tmp_path / 'ckpt'}",
            "--checkpoint.interval=1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=worker_env(),
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = {line.rpartition("|")[2].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "ftrain.train" in loaded and "ftrain.checkpoint.manager" in loaded  # the log is the real thing
    assert (
        sorted(
            m
            for m in loaded
            if layer_of(m) in ("agents", "torchrun plugin", "chaos", "testbed", "cli")
            and m not in ("ftrain.cli", "ftrain.cli.train", "ftrain.__main__")
        )
        == []
    )
