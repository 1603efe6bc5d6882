"""The GPU pools a scheduler needs before it queues the pipelines' GPU tasks: ``batch_llm_airflow.pools`` creates
each pool the pipeline files name through Airflow's own CLI (``airflow pools set``), with the slots asked for and
never fewer than the largest task takes (a task of more slots than its pool stays scheduled for ever); the demo
script and compose's init run it; each pipeline DAG's description names its pool."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dags" / "pipelines" / "demo.yaml"


def _pipelines(tmp_path: Path) -> Path:
    """demo.yaml as three pipelines: the default pool, pool ``big`` with a 4-GPU engine, pool ``gpu`` with a
    2-GPU review engine; and a broken file."""
    import yaml

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "wordlists").symlink_to(DEMO.parent / "wordlists")
    base = yaml.safe_load(DEMO.read_text().replace("../../include", str(ROOT / "include")))
    variants = {"a": {}, "b": {"name": "big_one", "engine": {**base["engine"], "tensor_parallel_size": 4},
                               "airflow": {**base.get("airflow", {}), "gpu_pool": "big"}},
                "c": {"name": "reviewed", "filter": {**base["filter"], "review": {
                    "model": {"ref": "/models/guard"}, "engine": {"tensor_parallel_size": 2}}}}}
    for stem, change in variants.items():
        (folder / f"{stem}.yaml").write_text(yaml.safe_dump({**base, **change}, allow_unicode=True))
    (folder / "z_broken.yaml").write_text("name: broken\n")
    return folder


def test_every_pool_the_pipelines_name_is_set_with_room_for_its_largest_task(tmp_path):
    from batch_llm_airflow.pools import pipeline_pools, pool_commands

    pools = pipeline_pools([_pipelines(tmp_path)])
    assert pools == {"gpu": 2, "big": 4}
    assert [c[3:5] for c in pool_commands(pools, 3)] == [["big", "4"], ["gpu", "3"]]
    assert all(c[:3] == ["airflow", "pools", "set"] for c in pool_commands(pools, 8))


def test_the_command_runs_airflow_pools_set_for_each(tmp_path):
    """``python -m batch_llm_airflow.pools`` runs the airflow CLI (a recording stand-in here) once per pool, the
    deployment's default pool included where no pipeline names it."""
    log = tmp_path / "calls"
    fake = tmp_path / "airflow"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    folder = _pipelines(tmp_path)
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "batch_llm_airflow.pools", "--slots", "2",
                           "--pool", "spare", "--airflow", str(fake), str(folder)],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode == 0, done.stderr
    calls = [line.split(" ", 4)[:4] for line in log.read_text().splitlines()]
    assert calls == [["pools", "set", "big", "4"], ["pools", "set", "gpu", "2"], ["pools", "set", "spare", "2"]]
    assert "skipping z_broken.yaml" in done.stderr


def test_the_demo_and_the_compose_init_create_the_pools():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    init = (ROOT / "docker" / "airflow-init.sh").read_text()
    assert "-m batch_llm_airflow.pools" in demo and "dags/pipelines" in demo
    assert "-m batch_llm_airflow.pools" in init and "BATCH_LLM_PIPELINES_DIR" in init


@pytest.mark.parametrize("stem", ["b", "c"])
def test_a_pipeline_dag_says_which_pool_it_needs(tmp_path, stem):
    from batch_llm.config import load_config
    from batch_llm_airflow.dag_factory import pipeline_dag

    dag = pipeline_dag(load_config(_pipelines(tmp_path) / f"{stem}.yaml"))
    want = {"b": "needs Airflow pool 'big', 4 slot(s) a GPU task", "c": "needs Airflow pool 'gpu', 2 slot(s)"}[stem]
    assert want in dag.description and want in dag.doc_md
    assert "airflow pools set" in dag.doc_md
