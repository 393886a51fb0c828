"""The import graph of ftrain's modules and its import circles (strongly connected components).

    python scripts/import_graph.py                 # every circle of more than one module
    python scripts/import_graph.py --under ftrain.agents --json

An edge ``a -> b`` is any import of ``b`` anywhere in ``a`` that can run: at module level or
inside a function (a lazy import still ties the two modules together). An import under
``if TYPE_CHECKING:`` names types for checkers only and is left out unless ``--annotations``.
``from p import m`` is an edge to the module ``p.m`` when there is one, else to ``p``. Importing
``p.m`` also runs ``p/__init__.py``; those implicit edges are left out (package ``__init__``
files here import nothing heavy). Exit status 1 when a circle is found, so the script can gate
a change (tests/unit/test_import_boundaries.py runs it).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: folder of the checkout -> the package it is imported as (pyproject.toml links them into
#: ftrain/), bottom layer first
FOLDERS = {
    "contract": "ftrain.contract",
    "checkpoint": "ftrain.checkpoint",
    "ftrain": "ftrain",
    "agents": "ftrain.agents",
    "testbed": "ftrain.testbed",
    "chaos": "ftrain.chaos",
}


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the namespace -> its file (links are not followed: each file once)."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sources(repo / folder):
            rel = path.relative_to(repo / folder).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join([package, *parts])] = path
    return out


def sources(folder: Path) -> list[Path]:
    """The .py files under ``folder``, sorted; ``os.walk`` does not descend into a link."""
    return sorted(Path(root) / name for root, _, files in os.walk(folder) for name in files if name.endswith(".py"))


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        name = ".".join([*base, node.module] if node.module else base)
    else:
        name = node.module or ""
    return [f"{name}.{a.name}" if f"{name}.{a.name}" in known else name for a in node.names]


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST, annotations: bool = False) -> list[ast.AST]:
    """Every node that can run: ``if TYPE_CHECKING:`` blocks (annotations only) are left out
    unless ``annotations``."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if not annotations and isinstance(node, ast.If) and _type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports(path: Path, module: str, known: set[str], annotations: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``path`` (the module ``module``) that can run, or
    also the type checkers' with ``annotations``; relative imports resolved, ``from p import m``
    named ``p.m`` when that is a module in ``known``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (getattr(node, "lineno", 0), name)
        for node in _runtime_nodes(tree, annotations)
        for name in _targets(node, module, path.name == "__init__.py", known)
    ]


def graph(repo: Path = REPO, annotations: bool = False) -> dict[str, set[str]]:
    """module -> the modules of the namespace it imports (with ``annotations``, also those named
    only for type checkers)."""
    files = modules(repo)
    known = set(files)
    edges: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for _, target in imports(path, module, known, annotations):
            while target and target not in known:  # ftrain.x.Y (a name in a module) -> ftrain.x
                target = target.rpartition(".")[0]
            if target and target != module:
                edges[module].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--under", default="ftrain", help="only modules under this package (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object: modules, edges, circles")
    parser.add_argument(
        "--annotations", action="store_true", help="count imports under `if TYPE_CHECKING:` too (types only)"
    )
    args = parser.parse_args(argv)
    edges = graph(annotations=args.annotations)
    keep = {m for m in edges if m == args.under or m.startswith(args.under + ".")}
    edges = {m: {t for t in targets if t in keep} for m, targets in edges.items() if m in keep}
    found = circles(edges)
    if args.json:
        print(json.dumps({"modules": len(edges), "edges": sum(map(len, edges.values())), "circles": found}))
    else:
        print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports among them")
        for component in found:
            print(f"circle of {len(component)}: {', '.join(component)}")
        if not found:
            print("no import circle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
