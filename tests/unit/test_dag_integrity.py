"""The DAGs import cleanly, have no cycles, set retries, and map inference onto the GPU pool and queue."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags"))


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert "batch_llm_demo" in dagbag.dags


def test_pipeline_shape(dagbag):
    dag = dagbag.dags["batch_llm_demo"]
    ids = {t.task_id.split(".")[-1]: t for t in dag.tasks}
    assert set(ids) == {"fetch_model", "quantize", "plan_shards", "batch_inference", "filter_shard",
                        "content_filter", "evaluate", "publish"}
    chain = ["fetch_model", "quantize", "batch_inference", "filter_shard", "content_filter", "evaluate", "publish"]
    for up, down in zip(chain, chain[1:]):
        assert ids[down].task_id in ids[up].downstream_task_ids, f"{up} -> {down}"
    assert ids["batch_inference"].task_id in ids["plan_shards"].downstream_task_ids
    # the word lists run per shard, mapped beside the shards: no task of the filter reads every row
    assert type(ids["filter_shard"]).__name__ == "MappedOperator"
    dag.check_cycle() if hasattr(dag, "check_cycle") else None
    from airflow.sdk.definitions._internal.abstractoperator import AbstractOperator  # noqa: F401
    # topological sort raises on a cycle
    assert len(dag.topological_sort()) == len(dag.tasks)


def test_a_stage_has_one_name(dagbag):
    """A stage with a config section has that section's name as its task id, its api function, its module under
    batch_llm.stages and its operator (``<Name>Operator``)."""
    import importlib

    from batch_llm import api
    from batch_llm.config import PipelineConfig

    tasks = {t.task_id.split(".")[-1]: t for t in dagbag.dags["batch_llm_demo"].tasks}
    for stage in ("quantize", "evaluate"):
        assert stage in PipelineConfig.model_fields and stage in api.__all__
        importlib.import_module(f"batch_llm.stages.{stage}")
        assert type(tasks[stage]).__name__ == f"{stage.capitalize()}Operator"


def test_retries_and_gpu_routing(dagbag):
    dag = dagbag.dags["batch_llm_demo"]
    for t in dag.tasks:
        assert t.retries >= 1, t.task_id
    infer = next(t for t in dag.tasks if t.task_id.endswith("batch_inference"))
    assert infer.pool == "gpu" and infer.queue == "gpu"
    assert infer.is_mapped if hasattr(infer, "is_mapped") else type(infer).__name__ == "MappedOperator"


def test_params_form(dagbag):
    dag = dagbag.dags["batch_llm_demo"]
    params = dag.params
    for name in ("model_ref", "engine", "max_tokens", "temperature", "rows_per_shard", "evaluate", "min_score"):
        assert name in params
        assert params.get_param(name).description
    assert params["max_tokens"] == 48  # the YAML's value is the form's default


@pytest.mark.parametrize("tp", [1, 4])
def test_inference_takes_a_pool_slot_per_gpu(dagbag, tp):
    """batch_inference asks the GPU pool for engine.tensor_parallel_size slots (one per GPU it leases)."""
    import datetime as dt

    from airflow.sdk import DAG
    from batch_llm.config import load_config
    from batch_llm_airflow.task_group import batch_llm_task_group

    demo = next(t for t in dagbag.dags["batch_llm_demo"].tasks if t.task_id.endswith("batch_inference"))
    assert demo.pool_slots == 1  # demo.yaml: tensor_parallel_size 1
    cfg = load_config(ROOT / "dags" / "pipelines" / "demo.yaml").with_overrides(
        {"engine.tensor_parallel_size": tp})
    with DAG(f"pool_slots_tp{tp}", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        batch_llm_task_group(cfg)
    infer = dag.get_task("batch_llm.batch_inference")
    assert infer.pool_slots == tp and infer.pool == cfg.airflow.gpu_pool
    others = [t for t in dag.tasks if t is not infer]
    assert others and all(t.pool_slots == 1 for t in others)


def test_a_plan_in_parts_is_five_tasks_the_scans_joins_and_writes_mapped():
    """sharding.plan_part_bytes: plan_parts → plan_scan × P → plan_join × P (after every scan) → plan_place →
    plan_write × P → plan_shards → batch_inference; no plan task but the three mapped ones reads a row."""
    import datetime as dt

    from airflow.sdk import DAG
    from batch_llm.config import load_config
    from batch_llm_airflow.task_group import batch_llm_task_group

    cfg = load_config(ROOT / "dags" / "pipelines" / "demo.yaml").with_overrides(
        {"sharding.plan_part_bytes": 2**20, "output.parts": True, "sharding.num_shards": None,
         "sharding.rows_per_shard": 1000})
    with DAG("plan_in_parts", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        batch_llm_task_group(cfg)
    t = {x.task_id.split(".")[-1]: x for x in dag.tasks}
    chain = ["plan_parts", "plan_scan", "plan_join", "plan_place", "plan_write", "plan_shards", "batch_inference"]
    for up, down in zip(chain, chain[1:]):
        assert t[down].task_id in t[up].downstream_task_ids, f"{up} -> {down}"
    mapped = {n for n, x in t.items() if n.startswith("plan_") and type(x).__name__ == "MappedOperator"}
    assert mapped == {"plan_scan", "plan_join", "plan_write"}
    assert len(dag.topological_sort()) == len(dag.tasks)
