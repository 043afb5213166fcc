"""The import graph of `service/`: no module and no package imports back (no circle, not even through an
import inside a function), the OpenAI protocol imports no transport, and each package imports alone in a
fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service"
GENERATED = "_gen"


def module_files() -> dict[str, Path]:
    """`service.x.y` -> its file (a package is its `__init__.py`)."""
    found = {}
    for path in SERVICE.rglob("*.py"):
        if GENERATED in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path) -> Iterator[str]:
    """Every absolute import of the file, wherever it is (module level, a function, TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
            yield node.module


def module_graph() -> dict[str, set[str]]:
    files = module_files()

    def owner(name: str) -> str | None:  # the service module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = {owner(name) for name in imported_names(path)}
        graph[module] = {t for t in targets if t is not None and t != module and not module.startswith(t + ".")}
    return graph


def unit(module: str) -> str:
    """The top-level package or module of `service` a module belongs to."""
    return ".".join(module.split(".")[:2])


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        graph.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    return graph


def cycle_of(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycle_of({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_of({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_service_imports_back() -> None:
    assert cycle_of(module_graph()) is None


def test_no_package_of_service_imports_back() -> None:
    graph = unit_graph()
    assert cycle_of(graph) is None
    # the layers: the protocol, then the jobs, then the transports, then the server that joins them
    assert graph["service.openai"] == set()
    assert graph["service.jobs"] <= {"service.openai", "service.state", "service.metrics"}
    for transport in ("service.http", "service.grpc_api"):
        assert graph[transport] <= {"service.openai", "service.state", "service.metrics", "service.jobs"}


def test_the_protocol_imports_no_transport() -> None:
    for module, path in module_files().items():
        if unit(module) == "service.openai":
            roots = {name.split(".")[0] for name in imported_names(path)}
            assert not roots & {"aiohttp", "grpc", "psycopg", "sqlite3"}, module


def test_each_package_imports_alone_in_a_fresh_interpreter() -> None:
    units = sorted({unit(m) for m in module_files()} - {"service"})
    runs = {u: subprocess.Popen([sys.executable, "-c", f"import {u}"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
            for u in units}
    errors = {u: run.communicate(timeout=120)[1] for u, run in runs.items()}
    assert not {u: errors[u] for u, run in runs.items() if run.returncode != 0}
