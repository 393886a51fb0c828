"""DESIGN.md's import rules, enforced on the source (every import, at any depth) and at runtime.

| package | must not import |
|---|---|
| checkpoint | ftrain, agents, chaos |
| agents | chaos; torch and ftrain (except the torch-free ftrain.config, ftrain.events) outside the torchrun plugin modules |
| ftrain | agents and chaos (except the CLI modules: cli.py, *_cli.py) |
| chaos | (anything) |
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

FORBIDDEN = {
    "checkpoint": ("ftrain", "agents", "chaos"),
    "agents": ("chaos", "torch", "ftrain"),
    "ftrain": ("agents", "chaos"),
}
ALLOWED = {
    "agents": ("ftrain.config", "ftrain.events"),
}


def _is_torchrun_plugin(path: Path) -> bool:
    return any(word in path.stem for word in ("torchrun", "rdzv", "plugin"))


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _violations(package: str) -> list[str]:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for lineno, name in _imports(path):
            root = name.split(".")[0]
            if root not in FORBIDDEN[package]:
                continue
            if any(name == a or name.startswith(a + ".") for a in ALLOWED.get(package, ())):
                continue
            if package == "agents" and root == "torch" and _is_torchrun_plugin(path):
                continue
            if package == "ftrain" and root in ("chaos", "agents") and (
                    path.name == "cli.py" or path.name.endswith("_cli.py")):
                continue
            bad.append(f"{path.relative_to(REPO)}:{lineno} imports {name}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_import_rules(package):
    assert _violations(package) == []


def test_rule_checker_catches_a_violation(tmp_path, monkeypatch):
    fake = tmp_path / "checkpoint"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from ftrain.train import train\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _violations("checkpoint") == ["checkpoint/bad.py:2 imports ftrain.train"]


def test_agents_and_data_import_without_torch():
    """The agent must start fast and outlive worker crashes; the data package is numpy-only."""
    code = ("import sys, pkgutil, importlib, agents, ftrain.data\n"
            "for m in pkgutil.walk_packages(agents.__path__, 'agents.'):\n"
            "    if not any(w in m.name for w in ('torchrun', 'rdzv', 'plugin')):\n"
            "        importlib.import_module(m.name)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
