"""The package's import graph has no circle, between modules or between packages: every `from
gateway... import` counts, those under `if TYPE_CHECKING:` and inside functions too (a type-only
circle is still a circle a reader has to hold in their head). At the package level each subpackage
(gateway.config, gateway.http, gateway.redis, gateway.rls) is one node and every top-level module
its own. `python tests/test_import_graph.py` prints the graph, one module a line with what it
imports, and the circles if any."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gateway"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package's __init__ for `from pkg import name`)."""
    found = modules()
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if not (node.module == "gateway" or node.module.startswith("gateway.")):
                    continue
                submodules = {f"{node.module}.{a.name}" for a in node.names} & found.keys()
                graph[name] |= submodules
                if len(submodules) < len(node.names) and node.module in found:
                    graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & found.keys()
        graph[name].discard(name)
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` with each subpackage's modules drawn together as one node."""
    packages = {".".join(name.split(".")[:2]) for name in graph if name.count(".") >= 2}

    def node(name: str) -> str:
        package = ".".join(name.split(".")[:2])
        return package if package in packages else name

    drawn: dict[str, set[str]] = {}
    for name, imported in graph.items():
        drawn.setdefault(node(name), set()).update(node(other) for other in imported)
    for name, imported in drawn.items():
        imported.discard(name)
    return drawn


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    found.append(sorted(component))
    return found


def test_the_package_imports_in_no_circle() -> None:
    graph = import_graph()
    assert len(graph) > 40
    assert circles(graph) == []


def test_no_package_imports_another_that_imports_it_back() -> None:
    drawn = package_graph(import_graph())
    assert {"gateway.config", "gateway.http", "gateway.rls", "gateway.redis"} <= drawn.keys()
    assert circles(drawn) == []


def test_a_circle_through_two_packages_is_found() -> None:
    graph = {"gateway.config.loader": {"gateway.hop"}, "gateway.hop": set(),
             "gateway.http.request": {"gateway.hop"}, "gateway.http.transport": {"gateway.config.model"},
             "gateway.config.model": set()}
    assert circles(package_graph(graph)) == []
    graph["gateway.config.loader"].add("gateway.http.request")  # config -> http -> config
    assert circles(package_graph(graph)) == [["gateway.config", "gateway.http"]]


def test_the_checker_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


if __name__ == "__main__":
    graph = import_graph()
    for name in sorted(graph):
        print(f"{name} -> {', '.join(sorted(graph[name])) or '-'}")
    found = circles(graph) + circles(package_graph(graph))
    print("circles:", found or "none")
    sys.exit(1 if found else 0)
