"""The package layering: imports run one way, and no file takes part in an import circle.

Imports run down the floors: cli/chaos/__main__ -> ray (kvbridge on Ray Serve, which composes
the programs) -> the three programs (server, proxy, launcher) -> engine -> kv_transfer -> shape and config (the ground floor). Every top-level module and package of kvbridge has its floor here, so a
new one must be placed; any import that runs up a floor fails, and so does any circle of files (a
function-local import counts: it only hides the circle; a relative import counts as the module it
names)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvbridge"
# openai_wire: the HTTP shapes the server and the proxy share (pydantic stays at the HTTP edge);
# http_protocol: the bounded HTTP/1.1 connection every server of kvbridge speaks;
# stop_strings: the stream's stop-string rule the engine and the proxy share;
# strict_json: RFC 8259 JSON, bounded in depth, for request bodies and trace files;
# tracing: OpenTelemetry tracers and trace context, used by every layer.
# ray: the Ray Serve application runs the proxy's router and engine instances (launcher's
# command lines): above the programs, below the CLI.
FLOOR = {"shape": 0, "config": 0, "kv_events": 0, "stop_strings": 0, "strict_json": 0, "tracing": 0, "kv_transfer": 1, "engine": 2, "server": 3, "proxy": 3,
         "launcher": 3, "openai_wire": 3, "http_protocol": 3, "ray": 3.5, "cli": 4, "chaos": 4, "__main__": 4}
PROGRAMS = ("server", "proxy", "launcher")
# What of kv_transfer the engine may import: the connector's contract. base: the two halves the
# engine calls (and their WorkerStatus, KVConnectorOutput); metadata: the scheduler half's per-step
# message, which rides the SchedulerOutput; rank_agent: each rank's transfer agent, its commands and
# reports (the model runner drives it); params: kv_transfer_params and BlockIds.
ENGINE_MAY_IMPORT = frozenset({"kvbridge.kv_transfer.connector.base", "kvbridge.kv_transfer.connector.metadata",
                               "kvbridge.kv_transfer.connector.rank_agent", "kvbridge.kv_transfer.params"})
# ...and the wiring, in these modules only: the factory builds the two halves and the parts they
# share; a TP rank process creates its own transfer backend.
ENGINE_WIRING_MAY_IMPORT = {
    "kvbridge.engine.kv_connector_factory": frozenset({
        "kvbridge.kv_transfer.backends", "kvbridge.kv_transfer.backends.base",
        "kvbridge.kv_transfer.connector.scheduler_side", "kvbridge.kv_transfer.connector.worker_side",
        "kvbridge.kv_transfer.failure", "kvbridge.kv_transfer.side_channel.handshake", "kvbridge.kv_transfer.lease",
        "kvbridge.kv_transfer.read_plan.request_reads", "kvbridge.kv_transfer.side_channel.server",
        "kvbridge.kv_transfer.stats"}),
    "kvbridge.engine.tp.executor": frozenset({"kvbridge.kv_transfer.backends"}),
}


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports_in(name: str, source: str, mods: set[str], package: bool = False) -> set[tuple[str, str]]:
    """(name, imported module) for every kvbridge import anywhere in `source`, the text of module
    `name` (`package`: its __init__); `from a import b` names a.b when that is a module, else a."""
    edges = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                edges.add((name, sub if sub in mods else module))
        elif isinstance(node, ast.Import):
            edges |= {(name, a.name) for a in node.names}
    return {(a, b) for a, b in edges if a != b and b in mods}


def imports() -> set[tuple[str, str]]:
    """Every (importer, imported module) pair among kvbridge's files."""
    mods = modules()
    return {edge for name, path in mods.items()
            for edge in imports_in(name, path.read_text(), set(mods), path.name == "__init__.py")}


def floor(module: str) -> float:
    """A module's floor; KeyError for a top-level name FLOOR does not place."""
    parts = module.split(".")
    return FLOOR[parts[1]] if len(parts) > 1 else 0


def upward(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in edges if floor(a) < floor(b)}


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


def test_every_top_level_module_has_a_floor():
    assert {m.split(".")[1] for m in modules() if "." in m} - FLOOR.keys() == set()


def test_no_import_runs_up_the_floors():
    assert upward(imports()) == set(), "imports that run up (programs > engine > kv_transfer > shape, config)"


def test_no_file_joins_an_import_circle():
    found = circles(imports())
    assert found == [], [sorted(c) for c in found]


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


def engine_reaches_past_the_contract(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The engine's imports of kv_transfer modules that neither list allows it."""
    return {(a, b) for a, b in edges if a.startswith("kvbridge.engine") and b.startswith("kvbridge.kv_transfer")
            and b not in ENGINE_MAY_IMPORT and b not in ENGINE_WIRING_MAY_IMPORT.get(a, frozenset())}


def test_the_engine_imports_of_kv_transfer_only_the_connector_contract():
    """The engine sees the KV connector through its contract (connector/base.py and the messages it
    names); only the wiring modules reach the concrete halves and their parts."""
    assert engine_reaches_past_the_contract(imports()) == set()
    planted = {("kvbridge.engine.engine", "kvbridge.kv_transfer.lease"),
               ("kvbridge.engine.scheduler", "kvbridge.kv_transfer.backends")}
    assert engine_reaches_past_the_contract(imports() | planted) == planted


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


def test_only_the_cli_imports_the_ray_package():
    """kvbridge[ray] is optional: nothing but cli.py (lazily, for `up --ray` and `kvbridge ray`)
    imports kvbridge.ray, so the default install runs without Ray."""
    importers = {a for a, b in imports() if b.startswith("kvbridge.ray") and not a.startswith("kvbridge.ray")}
    assert importers == {"kvbridge.cli"}


def test_the_checks_see_an_upward_import_and_a_circle():
    """The graph walk itself: a made-up upward import and a made-up circle among the real files are
    found, and so are a function-local import and a relative one."""
    edges, mods = imports(), set(modules())
    assert ("kvbridge.engine.engine", "kvbridge.engine.scheduler") in edges
    up = ("kvbridge.kv_transfer.lease", "kvbridge.engine.request")
    assert upward(edges | {up}) == {up}
    assert ("kvbridge.shape.kv_cache_layout", "kvbridge.shape.kv_groups") in edges
    back = ("kvbridge.shape.kv_groups", "kvbridge.shape.kv_cache_layout")
    assert circles(edges | {back}) == [frozenset(back)]
    assert circles({("a", "b"), ("b", "a"), ("b", "c")}) == [frozenset({"a", "b"})]
    hidden = "def f():\n    from kvbridge.engine.request import Request\n"
    assert imports_in("kvbridge.kv_transfer.lease", hidden, mods) == {up}
    relative = "from ..engine import request\nfrom . import kv_groups\n"
    assert imports_in("kvbridge.shape.tp_split", relative, mods) == {
        ("kvbridge.shape.tp_split", "kvbridge.engine.request"), ("kvbridge.shape.tp_split", "kvbridge.shape.kv_groups")}
    assert reachable({"a"}, {("a", "b"), ("b", "c"), ("d", "a")}) == {"b", "c"}
    assert "kvbridge.engine.engine" in reachable({"kvbridge.server.api_server"}, edges)
