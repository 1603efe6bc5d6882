"""The lowest Airflow the provider claims (``batch_llm_airflow.MIN_AIRFLOW``, the ``airflow`` extra's bound) runs it.

A throwaway venv gets exactly that ``apache-airflow`` (from uv's cache when it holds it, else from the index; a
few seconds once cached), the wheel of this checkout with its ``airflow`` extra, and the transformers engine
(no matplotlib, no modelscope, no EvalScope). Airflow and everything else resolve as on the floor's release
day (``uv --exclude-newer``): a deployment of that Airflow installs under that release's constraints file
(not reachable from here), and with today's releases of its dependencies Airflow 3.2.0's ``dag.test()``
fails every task, even a plain ``@task`` (``Model 'TITerminalStatePayload' needs a discriminator field``);
as on its release day it runs. The engine (torch, transformers, gguf and what they need: their closure in
requirements.lock's ``# via`` graph) is at requirements.lock's pins. There, as
a deployment on that Airflow would: every DAG file under dags/ parses with no import error, and the demo DAG
(the demo pipeline on the transformers engine, the demo model from its local folder, two shards of a few
rows, evaluate off) runs through ``dag.test()`` to success, publishing every row, its run report written
without matplotlib. In tests/system, so ``make check`` (tests/unit) leaves it out; ``make test`` runs it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROWS = 4
ENGINE = ("torch", "transformers", "gguf")  # the transformers engine; with their closure, at the lock's pins
# The day after each floor's release on PyPI (apache-airflow 3.2.0: 2026-04-07T12:52Z): its dependencies resolve
# as they did then. A new floor needs its date here.
RELEASED = {"3.2.0": "2026-04-08T00:00:00Z"}

pytestmark = pytest.mark.slow

RUN = r"""
import datetime as dt, json, sys
import airflow
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
out = {"airflow": airflow.__version__, "dags": sorted(bag.dags),
       "errors": {k: str(v)[-800:] for k, v in bag.import_errors.items()}}
dr = bag.dags["batch_llm_demo"].test(logical_date=dt.datetime(2026, 11, 5, tzinfo=dt.timezone.utc))
out["state"] = str(dr.state)
out["tasks"] = sorted(f"{ti.task_id}[{ti.map_index}] {ti.state}" for ti in dr.get_task_instances())
out["heavy"] = sorted({m.split(".")[0] for m in sys.modules} & {"matplotlib", "modelscope", "evalscope", "vllm"})
print("FLOOR " + json.dumps(out))
"""


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv") or str(ROOT / ".cache" / "uv-bootstrap" / "bin" / "uv")
    if not Path(found).exists() and not shutil.which(found):
        pytest.skip("uv not found (scripts/setup.sh bootstraps it into .cache/uv-bootstrap)")
    return found


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def lock_closure(lock: str, roots: tuple[str, ...]) -> dict[str, str]:
    """``name -> "name==version"`` for ``roots`` and everything they need, by the lock file's ``# via`` lines
    (uv pip compile's: under each pin, the packages that require it)."""
    pins: dict[str, str] = {}
    needed_by: dict[str, set[str]] = {}
    current = None
    for line in lock.splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)==\S+", line):
            current = canon(m[1])
            pins[current], needed_by[current] = line.split(";")[0].strip(), set()
        elif current and (m := re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9_.\-]+)\s*$", line)) and m[1] != "via":
            needed_by[current].add(canon(m[1]))
    found: set[str] = set()
    todo = [canon(r) for r in roots]
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += [dep for dep, users in needed_by.items() if name in users]
    return {name: pins[name] for name in sorted(found)}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floor_pipeline(tmp: Path, model_dir: Path) -> Path:
    """dags/pipelines/demo.yaml for the floor run, in a folder of its own (BATCH_LLM_PIPELINES_DIR)."""
    src = ROOT / "dags" / "pipelines"
    cfg = yaml.safe_load((src / "demo.yaml").read_text())
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say the number {i}."}) + "\n"
                               for i in range(ROWS)))
    cfg["model"] = {"ref": str(model_dir)}     # the local folder: no ModelScope in this venv
    cfg["input"]["path"] = str(prompts)
    cfg["output"]["path"] = str(tmp / "out")
    cfg["engine"] = {**cfg["engine"], "kind": "transformers"}
    cfg["sharding"]["num_shards"] = 2
    cfg["sampling"]["max_tokens"] = 4
    cfg["evaluate"]["enabled"] = False
    cfg["airflow"]["retries"] = 0
    for wl in cfg["filter"]["lists"]:
        if not wl["path"].startswith("builtin:"):
            wl["path"] = str((src / wl["path"]).resolve())
    folder = tmp / "pipelines"
    folder.mkdir()
    (folder / "demo.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


@pytest.mark.timeout(900)
def test_the_floor_airflow_runs_the_demo_dag(tmp_path, demo_model_dir):
    import batch_llm_airflow

    floor = batch_llm_airflow.MIN_AIRFLOW
    uv = _uv()
    uv_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    src = tmp_path / "src"  # the wheel, built from a copy: the checkout gets no build/ or egg-info
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ("batch_llm", "batch_llm_airflow"):
        shutil.copytree(ROOT / "include" / pkg, src / "include" / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([uv, "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(src)], 300, env=uv_env)
    wheel = next((tmp_path / "dist").glob("batch_llm-*.whl"))

    engine = lock_closure((ROOT / "requirements.lock").read_text(), ENGINE)
    assert set(ENGINE) <= set(engine) and "huggingface-hub" in engine, engine
    (tmp_path / "engine-pins.txt").write_text("\n".join(engine.values()) + "\n")
    venv = tmp_path / "venv"
    _run([uv, "venv", "-q", "--python", getattr(sys, "_base_executable", sys.executable), str(venv)], 120, env=uv_env)
    py = str(venv / "bin" / "python")
    # torch==<v>+cpu: from the local wheel folder scripts/setup.sh uses when it has it, else PyTorch's CPU index
    torch = engine["torch"]
    local = os.environ.get("TORCH_FIND_LINKS", "/opt/wheels")
    where = ["--find-links", local] if list(Path(local).glob(f"torch-{torch[7:]}-*.whl")) else [
        "--extra-index-url", os.environ.get("TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu"),
        "--index-strategy", "unsafe-best-match"]
    as_released = ["--exclude-newer", RELEASED[floor],
                   *(a for name in engine for a in ("--exclude-newer-package", f"{name}=2100-01-01T00:00:00Z"))]
    install = [uv, "pip", "install", "-q", "--python", py, *where, *as_released, "-c", str(tmp_path / "engine-pins.txt"),
               f"apache-airflow=={floor}", f"{wheel}[airflow,transformers]"]
    if subprocess.run([*install, "--offline"], capture_output=True, timeout=600, env=uv_env).returncode != 0:
        _run(install, 600, env=uv_env)

    home = tmp_path / "home"
    home.mkdir()
    env = {**uv_env, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"), "AIRFLOW__CORE__PLUGINS_FOLDER": str(tmp_path / "plugins"),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
           "BATCH_LLM_PIPELINES_DIR": str(floor_pipeline(tmp_path, demo_model_dir)),
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    _run([str(venv / "bin" / "airflow"), "db", "migrate"], 300, env=env, cwd=tmp_path)
    proc = _run([py, "-c", RUN, str(ROOT / "dags")], 600, env=env, cwd=tmp_path)
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("FLOOR ")][-1][len("FLOOR "):])

    assert out["airflow"] == floor, out
    assert out["errors"] == {}, out["errors"]
    assert {"batch_llm_demo", "example_llm_batch_switch", "example_custom_steps"} <= set(out["dags"]), out["dags"]
    assert out["state"].endswith("success"), "\n".join(out["tasks"]) + "\n" + proc.stdout[-8000:]
    assert "pipeline.batch_inference[0] success" in out["tasks"] and "pipeline.batch_inference[1] success" in \
        out["tasks"], out["tasks"]
    assert out["heavy"] == [], out["heavy"]
    current = json.loads(next((tmp_path / "out").rglob("_CURRENT.json")).read_text())
    assert current["rows"] == ROWS, current
    version = Path(current["version"].removeprefix("file://"))
    assert "No plots but the timeline: matplotlib is not installed" in (version / "report.html").read_text()
