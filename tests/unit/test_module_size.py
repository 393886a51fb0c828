"""Modules stay small enough to read: one over ~600 lines says why at its top (a ``**Size.**``
paragraph in its docstring), or is split by responsibility."""

from __future__ import annotations

import ast

from ftrain.testbed.procs import REPO
from tests.script_support import load_script

MAX_LINES = 600
GRAPH = load_script("import_graph")


def test_a_module_over_600_lines_says_why_at_its_top():
    unexplained = []
    for folder in (*GRAPH.FOLDERS, "bench", "scripts"):
        for path in GRAPH.sources(REPO / folder):
            text = path.read_text()
            if text.count("\n") > MAX_LINES and "**Size.**" not in (ast.get_docstring(ast.parse(text)) or ""):
                unexplained.append(f"{path.relative_to(REPO)}: {text.count(chr(10))} lines")
    assert unexplained == []
