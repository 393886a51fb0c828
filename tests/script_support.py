"""Load one of ``scripts/`` (not a package) as a module, for the tests that check what it writes."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from ftrain.testbed.procs import REPO


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
