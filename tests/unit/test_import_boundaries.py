"""The layers of DESIGN.md, enforced on the source (every import, at any depth) and at runtime.

Every module belongs to exactly one layer (the longest matching prefix below) and may import only
the layers listed for it; there are no per-file exemptions.

| layer | modules | may import |
|---|---|---|
| contract | `contract` | the standard library |
| checkpoint | `checkpoint` | contract (+ torch, fsspec, ...) |
| runtime | `ftrain` | contract, checkpoint (+ torch, numpy) |
| agents | `agents` | contract (never torch) |
| torchrun plugin | `agents.torchrun_rdzv` (loaded by torchrun, in its process) | contract, agents, torch |
| testbed | `testbed` | contract, agents, checkpoint |
| chaos | `chaos` | everything below the CLI |
| cli | `ftrain.cli`, `ftrain.__main__` | everything |
"""

from __future__ import annotations

import ast
import subprocess
import sys
import sysconfig
from pathlib import Path

from testbed.jobs import TINY_CONFIG, worker_env
from testbed.procs import REPO

PACKAGES = ("contract", "checkpoint", "ftrain", "agents", "testbed", "chaos")
LAYER_OF = {
    "contract": "contract",
    "checkpoint": "checkpoint",
    "ftrain": "runtime",
    "ftrain.cli": "cli",
    "ftrain.__main__": "cli",
    "agents": "agents",
    "agents.torchrun_rdzv": "torchrun plugin",
    "testbed": "testbed",
    "chaos": "chaos",
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


def _module_name(path: Path, repo: Path) -> str:
    rel = path.relative_to(repo).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations(repo: Path = REPO) -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            module = _module_name(path, repo)
            layer = layer_of(module)
            assert layer is not None, module
            for lineno, name in _imports(path, module):
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


def test_rule_checker_catches_violations(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "checkpoint" / "bad.py").write_text("def f():\n    from ftrain.train import train\n")
    (tmp_path / "ftrain" / "worker.py").write_text("import agents.agent\n")
    (tmp_path / "agents" / "x.py").write_text("from . import y\nimport torch.nn\n")
    (tmp_path / "contract" / "env.py").write_text("import requests\n")
    assert violations(tmp_path) == [
        "contract/env.py:1 imports requests (the contract is standard library only)",
        "checkpoint/bad.py:2 imports ftrain.train (layer checkpoint may not import layer runtime)",
        "ftrain/worker.py:1 imports agents.agent (layer runtime may not import layer agents)",
        "agents/x.py:2 imports torch.nn (layer agents may not import torch)",
    ]


def test_every_package_is_mapped_to_a_layer():
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench", "scripts"}
    assert on_disk == set(PACKAGES)
    purelib = Path(sysconfig.get_paths()["purelib"])
    assert not any((purelib / p).is_dir() for p in PACKAGES if p != "ftrain"), (
        "a name collides with an installed package"
    )


def test_agents_and_data_import_without_torch():
    """The agent must start fast and outlive worker crashes; the data package is numpy-only."""
    code = (
        "import sys, pkgutil, importlib, agents, ftrain.data, contract\n"
        "for pkg in (agents, contract):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if m.name != 'agents.torchrun_rdzv':\n"
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
    assert "ftrain.train" in loaded and "checkpoint.manager" in loaded  # the log is the real thing
    assert (
        sorted(
            m
            for m in loaded
            if layer_of(m) in ("agents", "torchrun plugin", "chaos", "testbed", "cli")
            and m not in ("ftrain.cli", "ftrain.cli.train", "ftrain.__main__")
        )
        == []
    )
