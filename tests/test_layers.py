"""The package's layers hold: no import circle, and no import back up a layer.

Read from the source with ``ast`` (nothing is imported). ``from pkg import mod`` counts as an import of ``pkg.mod``;
an import inside a function counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# From the ground floor up; a module imports only its own layer and those below.
LAYERS = ["distill_kit.errors distill_kit.config", "distill_kit.data distill_kit.rewards", "losses",
          "distill_kit.engines", "distill_kit.offline distill_kit.students", "distill_kit.teachers",
          "distill_kit.training", "distill_kit.distiller", "distill_kit.tasks", "distill_kit.run",
          "distill_kit"]


def modules() -> dict[str, Path]:
    found = {}
    for package in ("distill_kit", "losses"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in known else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {dep for dep in deps if dep in known and dep != name}
    return graph


def layer(module: str) -> int:
    matches = [(len(prefix), i) for i, names in enumerate(LAYERS) for prefix in names.split()
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_nothing_imports_upward():
    upward = {(a, b) for a, deps in import_graph().items() for b in deps
              if layer(b) > layer(a) and not (b.startswith(a + ".") or a in ("distill_kit", "losses"))}
    assert upward == set(), sorted(upward)
