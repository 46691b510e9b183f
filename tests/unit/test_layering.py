"""The package layering, held as a ratchet (issue 28 will remove what is listed here).

Imports should run one way: cli/chaos -> server / proxy / launcher -> engine -> kv_transfer -> config
(the ground floor), and no file should take part in an import circle (a function-local import counts: it
only hides the circle). This test lists today's upward imports and circles; it fails on any new
one, and on a listed one that is gone (then strike it from the list, so it cannot come back)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvbridge"
# openai_wire: the HTTP shapes the server and the proxy share (pydantic stays at the HTTP edge);
# stop_strings: the stream's stop-string rule the engine and the proxy share.
FLOOR = {"config": 0, "stop_strings": 0, "kv_transfer": 1, "engine": 2, "server": 3, "proxy": 3, "launcher": 3,
         "openai_wire": 3, "cli": 4, "chaos": 4, "__main__": 4}
PROGRAMS = ("server", "proxy", "launcher")

KNOWN_UPWARD = {
    ("kvbridge.config", "kvbridge.engine.cpu_bind"),
    ("kvbridge.config", "kvbridge.kv_transfer.net"),
    ("kvbridge.kv_transfer.connector.base", "kvbridge.engine.request"),
    ("kvbridge.kv_transfer.connector.factory", "kvbridge.engine.kv_cache_layout"),
    ("kvbridge.kv_transfer.connector.factory", "kvbridge.engine.kv_groups"),
    ("kvbridge.kv_transfer.connector.factory", "kvbridge.engine.model_runner"),
    ("kvbridge.kv_transfer.connector.factory", "kvbridge.engine.models.config"),
    ("kvbridge.kv_transfer.connector.scheduler_side", "kvbridge.engine.request"),
    ("kvbridge.kv_transfer.read_plan.mamba_mapping", "kvbridge.engine.layers.mamba2"),
    ("kvbridge.kv_transfer.read_plan.mamba_mapping", "kvbridge.engine.models.config"),
    ("kvbridge.kv_transfer.read_plan.mamba_mapping", "kvbridge.engine.tp"),
    ("kvbridge.kv_transfer.read_plan.request_reads", "kvbridge.engine.models.config"),
}


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
    assert upward - KNOWN_UPWARD == set(), \
        "imports that run up the layers (server, proxy, launcher > engine > kv_transfer > config)"
    assert KNOWN_UPWARD - upward == set(), "gone (good): strike them from KNOWN_UPWARD"


# Today's one circle, inside engine/ (layers -> cpu_kernels -> loader.cache -> models -> layers), held
# apart only by imports inside functions (issue 28).
KNOWN_CIRCLE = frozenset({
    "kvbridge.engine.layers.activation", "kvbridge.engine.layers.attention", "kvbridge.engine.layers.cpu_kernels",
    "kvbridge.engine.layers.mla_attention", "kvbridge.engine.layers.norm", "kvbridge.engine.layers.rotary",
    "kvbridge.engine.loader.cache", "kvbridge.engine.models", "kvbridge.engine.models.bamba",
    "kvbridge.engine.models.deepseek", "kvbridge.engine.models.llama"})


def test_no_file_joins_an_import_circle():
    found = circles(imports())
    assert all(c <= KNOWN_CIRCLE for c in found), [sorted(c - KNOWN_CIRCLE) for c in found]
    assert found == [KNOWN_CIRCLE], "the circle shrank or broke up (good): update KNOWN_CIRCLE"


def reachable(start: set[str], edges: set[tuple[str, str]]) -> set[str]:
    """Every module `start` imports, directly or through others."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    seen, todo = set(), list(start)
    while todo:
        for b in graph.get(todo.pop(), set()) - seen:
            seen.add(b)
            todo.append(b)
    return seen


def test_the_proxy_runs_without_the_engine():
    """Nothing the proxy imports, directly or through another module, is the engine's: what it
    shares with the instance server is in openai_wire.py, with the engine in stop_strings.py and
    kv_transfer.params."""
    edges = imports()
    reached = reachable({m for m in modules() if m.startswith("kvbridge.proxy")}, edges)
    assert "kvbridge.openai_wire" in reached
    assert sorted(m for m in reached if m.startswith("kvbridge.engine")) == []


def test_the_three_programs_import_not_one_another():
    """The instance server, the proxy and the launcher are separate programs: none imports another."""
    def program(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in PROGRAMS else None

    crossing = {(a, b) for a, b in imports() if program(a) and program(b) and program(a) != program(b)}
    assert crossing == set()


def test_the_checks_see_an_upward_import_and_a_circle():
    """The graph walk itself: a made-up upward edge and a two-file circle are found."""
    assert floor("kvbridge.kv_transfer.lease") < floor("kvbridge.engine.request") < floor("kvbridge.proxy.proxy")
    assert circles({("a", "b"), ("b", "a"), ("b", "c")}) == [frozenset({"a", "b"})]
    assert ("kvbridge.engine.engine", "kvbridge.engine.scheduler") in imports()
    assert reachable({"a"}, {("a", "b"), ("b", "c"), ("d", "a")}) == {"b", "c"}
    assert "kvbridge.engine.engine" in reachable({"kvbridge.server.api_server"}, imports())
