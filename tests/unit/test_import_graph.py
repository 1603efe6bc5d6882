"""The import graph of include/ has no cycle.

Every .py under include/batch_llm and include/batch_llm_airflow is parsed with ast and every import in it counts:
at module level, inside functions, under `if TYPE_CHECKING:`, relative ones; `from pkg import name` is an edge to
pkg.name when that is a module of the project, else to pkg. A package's __init__ is a node of its own (the package's
name). A strongly connected component of more than one module, or a module importing itself, is a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

INCLUDE = Path(__file__).resolve().parents[2] / "include"
PACKAGES = ("batch_llm", "batch_llm_airflow")


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every .py of the project's packages."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((INCLUDE / pkg).rglob("*.py")):
            parts = list(path.relative_to(INCLUDE).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _base(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (its relative dots resolved against the importing module)."""
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _project(target: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module of the project (importing a.b.c runs a, a.b, a.b.c:
    the edge that matters here is to the deepest one of ours)."""
    parts = target.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, name, is_package)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return {m for t in targets if (m := _project(t, modules))}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, and nodes with an edge to themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph.get(v, ()):
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(scc: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} → {b}" for a in scc for b in sorted(graph[a]) if b in scc]
    return f"{len(scc)} modules: " + ", ".join(edges)


def test_cycles_are_found():
    """The checker itself: a circle of three, a self-import, and a DAG without one."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_graph_sees_function_level_and_submodule_imports():
    graph = import_graph()
    assert "batch_llm.api" in graph["batch_llm.frontends.cli"]  # `from batch_llm import stages` inside a function
    assert "batch_llm.engines.base" in graph["batch_llm.engines.start"]
    assert "batch_llm.api" in graph["batch_llm.isolation.worker_child"]  # worker_main.main's import, inside a function


def test_include_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in include/:\n" + "\n".join(_describe(scc, graph) for scc in found)
