"""The package layering, held as a ratchet (issue 28 will remove what is listed here).

Imports should run one way: cli/chaos -> serving -> engine -> kv_transfer -> spec and config (the
ground floor), and no file should take part in an import circle (a function-local import counts: it
only hides the circle). This test lists today's upward imports and circles; it fails on any new
one, and on a listed one that is gone (then strike it from the list, so it cannot come back)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvbridge"
FLOOR = {"spec": 0, "config": 0, "kv_transfer": 1, "engine": 2, "serving": 3, "cli": 4, "chaos": 4, "__main__": 4}

KNOWN_UPWARD: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports() -> set[tuple[str, str]]:
    """(importer, imported module) for every kvbridge import anywhere in a file; `from a import b`
    names a.b when that is a module, else a."""
    mods = modules()
    edges = set()
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvbridge"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add((name, sub if sub in mods else node.module))
            elif isinstance(node, ast.Import):
                edges |= {(name, a.name) for a in node.names if a.name.startswith("kvbridge")}
    return {(a, b) for a, b in edges if a != b and b in mods}


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOOR.get(parts[1], 0) if len(parts) > 1 else 0


def circles(edges: set[tuple[str, str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_new_upward_import_between_the_packages():
    upward = {(a, b) for a, b in imports() if floor(a) < floor(b)}
    assert upward - KNOWN_UPWARD == set(), "imports that run up (serving > engine > kv_transfer > spec, config)"
    assert KNOWN_UPWARD - upward == set(), "gone (good): strike them from KNOWN_UPWARD"


def test_no_file_joins_an_import_circle():
    found = circles(imports())
    assert found == [], [sorted(c) for c in found]


def test_the_checks_see_an_upward_import_and_a_circle():
    """The graph walk itself: a made-up upward edge and a two-file circle are found."""
    assert floor("kvbridge.kv_transfer.lease") < floor("kvbridge.engine.request") < floor("kvbridge.serving.proxy")
    assert circles({("a", "b"), ("b", "a"), ("b", "c")}) == [frozenset({"a", "b"})]
    assert ("kvbridge.engine.engine", "kvbridge.engine.scheduler") in imports()
