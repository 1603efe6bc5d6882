"""The import graph of include/ has no cycle, and no import runs from a lower floor up to a higher one.

Every .py under include/batch_llm and include/batch_llm_airflow is parsed with ast and every import in it counts:
at module level, inside functions, under `if TYPE_CHECKING:`, relative ones; `from pkg import name` is an edge to
pkg.name when that is a module of the project, else to pkg. A package's __init__ is a node of its own (the package's
name). A strongly connected component of more than one module, or a module importing itself, is a cycle.

The floors (``FLOORS``, bottom to top) are folders: a module is on its package's floor, a top-level module of
``batch_llm`` is placed by name (``TOP_LEVEL``). An import from a floor to a higher one is allowed only when
``ALLOWED_UP`` names it with its reason."""
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


# The floors of include/, bottom to top: a module imports its own floor and those below it, never one above.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("host", ("batch_llm.host",)),              # this machine: GPUs, process groups, user paths, model-folder probes
    ("config", ("batch_llm.config",)),          # the pipeline model and the tables it checks against
    ("rows", ("batch_llm.rows",)),              # a row's own sampling parameters, prompt rows, output records
    ("io", ("batch_llm.io",)),                  # bytes and files: storage, formats, images, identity, retention
    ("cache", ("batch_llm.cache",)),
    ("engines", ("batch_llm.engines",)),
    ("sizing", ("batch_llm.sizing",)),
    ("analysis", ("batch_llm.analysis",)),
    ("sinks", ("batch_llm.sinks",)),
    ("stages", ("batch_llm.stages",)),
    ("batch_api", ("batch_llm.batch_api",)),    # the OpenAI Batch API's files, batches and a stopped shard
    ("api", ()),                                # batch_llm.api: the facade over the stages
    ("isolation", ("batch_llm.isolation",)),    # a shard in a process of its own, which calls the api
    ("frontends", ("batch_llm.frontends",)),
    ("airflow", ("batch_llm_airflow",)),
)
# batch_llm's own modules outside the sub-packages, by name: a module here that no floor names fails the test.
TOP_LEVEL = {
    "batch_llm": "host",                # the package: a docstring, no import
    "batch_llm.demo_model": "host",     # builds the demo model folder (standard library; the config's default cache)
    "batch_llm.tiny_models": "host",    # builds the tests' tiny model folders
    "batch_llm.reasoning": "config",    # the thinking switch's template variables, which the config checks
    "batch_llm.output_schema": "config",  # the structured-output schema the config loads and checks
    "batch_llm.generated_text": "rows",  # every copy of generated text a result row holds
    "batch_llm.manifests": "io",        # a stage's manifest file
    "batch_llm.layout": "io",           # a run's folders in storage
    "batch_llm.api": "api",
    "batch_llm.__main__": "frontends",  # python -m batch_llm: the CLI
}
# (importer, imported) → why the import runs up. Each entry must still exist (a stale one fails the test).
ALLOWED_UP: dict[tuple[str, str], str] = {}
MAX_ALLOWED_UP = 2


def floor_of(module: str, floors=FLOORS, top_level=TOP_LEVEL) -> int:
    """The index in ``floors`` of the module's floor: its own name in ``top_level``, else the longest package prefix."""
    names = [name for name, _ in floors]
    if module in top_level:
        return names.index(top_level[module])
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(floors) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is on no floor: add its package to FLOORS or its name to TOP_LEVEL"
    return best[1]


def up_edges(graph: dict[str, set[str]], floors=FLOORS, top_level=TOP_LEVEL) -> list[tuple[str, str]]:
    """Every import from a module to one on a higher floor."""
    return sorted((a, b) for a in graph for b in graph[a]
                  if floor_of(b, floors, top_level) > floor_of(a, floors, top_level))


def test_up_edges_are_found():
    """The checker itself: an import to a higher floor is found, one to the same or a lower floor is not; a
    top-level module is placed by name, a module of a sub-package by its package."""
    floors = (("low", ("p.low",)), ("high", ("p.high",)))
    top = {"p.leaf": "low", "p.facade": "high"}
    graph = {"p.low.a": {"p.high.b", "p.low.c", "p.leaf"}, "p.high.b": {"p.low.a", "p.high.d.e"}, "p.low.c": set(),
             "p.high.d.e": set(), "p.leaf": {"p.facade"}, "p.facade": {"p.leaf"}}
    assert up_edges(graph, floors, top) == [("p.leaf", "p.facade"), ("p.low.a", "p.high.b")]


def test_every_module_is_on_a_floor():
    for module in import_graph():
        floor_of(module)
    assert set(TOP_LEVEL.values()) <= {name for name, _ in FLOORS}


def test_no_import_runs_up_a_floor():
    """host → config → rows → io → cache → engines → sizing → analysis → sinks → stages → api → isolation →
    frontends → airflow: an import to a higher floor is a fault unless ALLOWED_UP names it with its reason."""
    found = up_edges(import_graph())
    unexplained = [f"{a} ({FLOORS[floor_of(a)][0]}) → {b} ({FLOORS[floor_of(b)][0]})"
                   for a, b in found if (a, b) not in ALLOWED_UP]
    assert not unexplained, "imports that run up a floor in include/:\n" + "\n".join(unexplained)
    stale = sorted(set(ALLOWED_UP) - set(found))
    assert not stale, f"ALLOWED_UP names imports that no longer exist: {stale}"
    assert len(ALLOWED_UP) <= MAX_ALLOWED_UP


# Packages a package never imports, though lower: io/ reads and writes bytes and files and takes the input's rules
# as an argument (io.formats.ColumnRules, which InputConfig satisfies), so a change of the config never reaches it.
NEVER_IMPORTS: dict[str, tuple[str, ...]] = {"batch_llm.io": ("batch_llm.config",)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_io_imports_no_config():
    """No module of io/ imports batch_llm.config (any of its modules), at module level or inside a function."""
    graph = import_graph()
    found = sorted((a, b) for a in graph for b in graph[a] for pkg, banned in NEVER_IMPORTS.items()
                   if _within(a, pkg) and any(_within(b, x) for x in banned))
    assert not found, f"imports NEVER_IMPORTS refuses: {found}"


def reexports(path: Path) -> list[str]:
    """The names a module's ``__all__`` lists that it only imports (a re-export): a name has one home, and only a
    package's __init__ gathers its package's public names."""
    tree = ast.parse(path.read_text(), str(path))
    imported: set[str] = set()
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = [e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)]
    return sorted(set(exported) & imported)


def test_reexports_are_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from a import b, c\nimport d\n\n\ndef e(): ...\n\n\n__all__ = ['b', 'd', 'e']\n")
    assert reexports(module) == ["b", "d"]


def test_only_a_package_init_reexports():
    found = {name: names for name, path in _modules().items()
             if path.name != "__init__.py" and (names := reexports(path))}
    assert not found, f"modules that re-export what they import (import it from its home instead): {found}"
