"""The provider uses Airflow's public API only, and says which Airflow it needs where pip and Airflow see it.

- No module under include/ imports a private Airflow module or name (a path segment or a name with a leading
  underscore: ``airflow.sdk.definitions._internal``, ``airflow._shared``): those change without notice between
  releases. ``GPULLMBatchOperator`` writes out Airflow's dependency protocol instead of subclassing its private
  ``DependencyMixin``; ``>>``, ``<<``, lists and ``chain`` still span the whole batch.
- The floor (``batch_llm_airflow.MIN_AIRFLOW``) is the ``airflow`` extra's lower bound, and an older Airflow is
  refused on import with one line naming both versions. That the floor really runs the demo DAG is
  tests/system/test_airflow_floor.py (a throwaway venv with that Airflow).
"""
from __future__ import annotations

import ast
import datetime as dt
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def private_airflow_imports(source: str, where: str) -> list[str]:
    """``where:line module[.name]`` for every import of a private Airflow module or name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            names = [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in names:
            parts = module.split(".")
            if parts[0] == "airflow" and any(p.startswith("_") for p in [*parts[1:], name]):
                found.append(f"{where}:{node.lineno} {module}{'.' + name if name else ''}")
    return found


def test_the_scan_finds_private_imports():
    source = ("from airflow.sdk.definitions._internal.mixins import DependencyMixin\n"
              "import airflow._shared.module_loading\nfrom airflow.sdk import _private\n"
              "from airflow.sdk import DAG\nfrom ._x import y\nimport _thread\n")
    assert private_airflow_imports(source, "m.py") == [
        "m.py:1 airflow.sdk.definitions._internal.mixins.DependencyMixin", "m.py:2 airflow._shared.module_loading",
        "m.py:3 airflow.sdk._private"]


def test_no_private_airflow_imports_in_the_provider_or_the_stage_library():
    files = sorted((ROOT / "include").rglob("*.py"))
    assert len(files) > 30
    assert [f for path in files for f in private_airflow_imports(path.read_text(), str(path.relative_to(ROOT)))] == []


def test_the_floor_is_the_airflow_extras_bound_and_an_older_airflow_is_refused(monkeypatch):
    import batch_llm_airflow

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["airflow"]
    assert f"apache-airflow>={batch_llm_airflow.MIN_AIRFLOW}" in extra
    assert batch_llm_airflow.check_airflow_version("3.3.2") is None
    assert batch_llm_airflow.check_airflow_version(batch_llm_airflow.MIN_AIRFLOW) is None
    with pytest.raises(RuntimeError, match=r"^batch-llm's Airflow provider needs apache-airflow>=3\.2\.0; "
                                           r"this environment has 3\.1\.8 "):
        batch_llm_airflow.check_airflow_version("3.1.8")
    with pytest.raises(RuntimeError, match="has 3.2.0rc1"):
        batch_llm_airflow.check_airflow_version("3.2.0rc1")
    with pytest.raises(RuntimeError, match=r"cannot read the release of Airflow version 'main'; it needs "
                                           r"apache-airflow>=3\.2\.0$"):
        batch_llm_airflow.check_airflow_version("main")


def test_dependencies_span_the_whole_batch_without_airflows_private_mixin():
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG, chain
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator

    kw = dict(result_path="/tmp/r/{{ run_id }}", model_id="/models/m", config_overrides={"engine.kind": "transformers"})
    with DAG("deps_protocol", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        a, b, c, d, e = (EmptyOperator(task_id=t) for t in "abcde")
        one = GPULLMBatchOperator(task_id="one", requests=["x"], **kw)
        two = GPULLMBatchOperator(task_id="two", requests=["y"], **kw)
        assert (a >> one) is one and (one >> b) is b
        assert ([c, d] >> two) is two and (two << e) is e
        chain(b, GPULLMBatchOperator(task_id="three", requests=["z"], **kw), c)
    assert dag.get_task("one.plan_shards").upstream_task_ids == {"a"}
    assert dag.get_task("one").downstream_task_ids == {"b"}
    assert dag.get_task("two.plan_shards").upstream_task_ids == {"c", "d", "e"}
    assert dag.get_task("three.plan_shards").upstream_task_ids == {"b"}
    assert dag.get_task("three").downstream_task_ids == {"c"}
