"""The Kubernetes cluster policy (``batch_llm_airflow.policy``): GPU pods for every GPU task, through Airflow's own
policy machinery.

Airflow loads the policy from the distribution's ``airflow.policy`` entry point into its pluggy policy manager
(``airflow.settings.get_policy_plugin_manager()``) when it starts; no ``airflow_local_settings.py`` is involved.
Applied by Airflow's own ``DagBag`` to this repository's DAGs (the pipeline's ``BatchInferenceOperator`` shards,
``GPULLMBatchOperator`` / ``@task.gpu_llm_batch``'s ``GPUBatchInferenceOperator`` shards, unmapped and mapped
batches), every shard task gets the GPU pod and no other task one; an unmapped GPU task too; what an author set
(``pod_override``, their own ``pod_template_file``, ``executor``) stays. On the old file policy the decorated
batch's shards (``GPUBatchInferenceOperator``) got no GPU pod.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "/opt/airflow/pod_templates/pod_template_gpu.yaml"


def _kwargs(task) -> dict:
    """What the policy set: a mapped task's ``partial_kwargs``, else the task's attributes."""
    kwargs = getattr(task, "partial_kwargs", None)
    return kwargs if kwargs is not None else {"executor_config": task.executor_config, "executor": task.executor}


def test_the_policy_is_an_entry_point_airflow_loads():
    from importlib.metadata import entry_points

    import airflow.settings
    from batch_llm_airflow import policy

    assert [(e.name, e.value) for e in entry_points(group="airflow.policy")
            if e.value.startswith("batch_llm_airflow")] == [("batch_llm", "batch_llm_airflow.policy")]
    manager = airflow.settings.get_policy_plugin_manager()
    assert policy in manager.get_plugins()               # loaded by Airflow at start, from the entry point
    assert [h.plugin for h in manager.hook.task_policy.get_hookimpls()] == [policy]
    assert not (ROOT / "docker" / "k8s" / "airflow_local_settings.py").exists()


def test_every_shard_task_of_both_styles_gets_the_gpu_pod_and_no_other_task(monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("BATCH_LLM_GPU_POD_TEMPLATE", TEMPLATE)
    monkeypatch.setenv("BATCH_LLM_GPU_EXECUTOR", "KubernetesExecutor")
    bag = DagBag(dag_folder=str(ROOT / "dags"))  # applies Airflow's task policies
    assert bag.import_errors == {}
    shards, others = [], []
    for dag in bag.dags.values():
        for task in dag.tasks:
            (shards if task.task_id.endswith(".batch_inference") else others).append((dag.dag_id, task))
    kinds = {type(t).__name__ for _, t in shards} | {getattr(t, "operator_class", type(t)).__name__ for _, t in shards}
    assert {"BatchInferenceOperator", "GPUBatchInferenceOperator"} <= kinds, kinds
    assert {(d, t.task_id) for d, t in shards} >= {
        ("batch_llm_demo", "pipeline.batch_inference"), ("example_llm_batch_switch", "classify_reviews.batch_inference"),
        ("example_llm_batch_switch", "build_summary_requests.batch_inference"),
        ("example_llm_batch_switch", "summaries_by_group.batch_inference")}  # the last: a mapped batch's shards
    for dag_id, task in shards:
        assert _kwargs(task)["executor_config"] == {"pod_template_file": TEMPLATE}, (dag_id, task.task_id)
        assert _kwargs(task)["executor"] == "KubernetesExecutor", (dag_id, task.task_id)
    for dag_id, task in others:
        assert not _kwargs(task).get("executor_config"), (dag_id, task.task_id)
        assert _kwargs(task).get("executor") != "KubernetesExecutor", (dag_id, task.task_id)

    monkeypatch.delenv("BATCH_LLM_GPU_POD_TEMPLATE")    # not configured (the Celery deployment): nothing changes
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert not [t.task_id for d in bag.dags.values() for t in d.tasks if _kwargs(t).get("executor_config")]


def test_unmapped_gpu_tasks_and_what_the_author_set(monkeypatch):
    import airflow.settings
    from airflow.sdk import DAG
    from batch_llm.config import load_config
    from batch_llm_airflow import policy
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator
    from batch_llm_airflow.operators import BatchInferenceOperator, PublishOperator

    monkeypatch.setenv("BATCH_LLM_GPU_POD_TEMPLATE", TEMPLATE)
    monkeypatch.setattr(policy, "gpu_pod_override", lambda n: {"gpus": n})  # the kubernetes client: the image's
    cfg = load_config(ROOT / "dags" / "pipelines" / "demo.yaml")
    mine = {"pod_override": "the author's pod"}
    kw = dict(result_path="/tmp/r/{{ run_id }}", model_id="/models/m", config_overrides={"engine.kind": "transformers"})
    with DAG("authored", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        one = BatchInferenceOperator(task_id="one_shard", shard={}, model={}, pipeline_config=cfg.model_dump())
        tp4 = BatchInferenceOperator(task_id="tp4", shard={}, model={}, pipeline_config=cfg.with_overrides(
            {"engine.tensor_parallel_size": 4}).model_dump())
        own = BatchInferenceOperator(task_id="own_template", shard={}, model={}, pipeline_config=cfg.model_dump(),
                                     executor_config={"pod_template_file": "/mine.yaml"}, executor="CeleryExecutor")
        publish = PublishOperator(task_id="publish", pipeline_config=cfg.model_dump())
        GPULLMBatchOperator(task_id="batch", requests=["x"], executor_config=mine, **kw)
    for task in dag.tasks:
        airflow.settings.task_policy(task)   # Airflow's policy manager, as the DagBag calls it
    assert one.executor_config == {"pod_template_file": TEMPLATE}
    assert tp4.executor_config == {"pod_template_file": TEMPLATE, "pod_override": {"gpus": 4}}
    assert own.executor_config == {"pod_template_file": "/mine.yaml"} and own.executor == "CeleryExecutor"
    assert not publish.executor_config
    assert _kwargs(dag.get_task("batch.batch_inference"))["executor_config"] == {**mine, "pod_template_file": TEMPLATE}
    for tid in ("batch.plan_shards", "batch.fetch_model", "batch"):
        assert dag.get_task(tid).executor_config == mine, tid     # a CPU task keeps exactly what was given


@pytest.mark.parametrize("task_class", ["BatchInferenceOperator", "GPUBatchInferenceOperator"])
def test_gpu_operator_classes_carry_the_marker(task_class):
    from batch_llm_airflow import llm_batch, operators, policy

    cls = getattr(operators, task_class, None) or getattr(llm_batch, task_class)
    assert cls.runs_on_gpu is True
    cpu = [c for c in (operators.PlanShardsOperator, operators.FetchModelOperator, operators.PublishOperator,
                       llm_batch.GPUBatchPlanOperator, llm_batch.GPUBatchLandOperator, llm_batch.GPUBatchModelOperator)
           if getattr(c, "runs_on_gpu", False)]
    assert cpu == [] and not policy.runs_on_gpu(object())


def _review_dag(engine_tp: int, review_tp: int):
    from airflow.sdk import DAG
    from batch_llm.config import load_config
    from batch_llm_airflow.task_group import batch_llm_task_group

    cfg = load_config(ROOT / "dags" / "pipelines" / "demo.yaml").with_overrides({
        "engine.tensor_parallel_size": engine_tp,
        "filter.review": {"model": {"ref": "/models/guard"}, "engine": {"tensor_parallel_size": review_tp}}})
    with DAG("review_pods", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        batch_llm_task_group(cfg)
    return dag


@pytest.mark.parametrize(("engine_tp", "review_tp"), [(1, 2), (4, 1)])
def test_the_review_task_gets_the_pod_of_the_review_engine(monkeypatch, engine_tp, review_tp):
    """The content review's task runs the review model's engine: its pod asks for that engine's
    tensor_parallel_size GPUs (none over the template's one for a one-GPU review beside a 4-GPU main engine),
    while the shards' pod asks for the main engine's."""
    import airflow.settings
    from batch_llm_airflow import policy

    monkeypatch.setenv("BATCH_LLM_GPU_POD_TEMPLATE", TEMPLATE)
    monkeypatch.setattr(policy, "gpu_pod_override", lambda n: {"gpus": n})
    dag = _review_dag(engine_tp, review_tp)
    for task in dag.tasks:
        airflow.settings.task_policy(task)
    pods = {tid: _kwargs(dag.get_task(f"batch_llm.{tid}"))["executor_config"] for tid in ("batch_inference", "review")}
    for tid, tp in (("batch_inference", engine_tp), ("review", review_tp)):
        want = {"pod_template_file": TEMPLATE, **({"pod_override": {"gpus": tp}} if tp > 1 else {})}
        assert pods[tid] == want, (tid, pods)


def _tp2_pipelines(tmp_path: Path) -> Path:
    """A copy of the demo pipeline (with its word lists) whose engine wants 2 GPUs."""
    import shutil

    import yaml

    folder = tmp_path / "pipelines"
    shutil.copytree(ROOT / "dags" / "pipelines", folder)
    for other in folder.glob("*.y*ml"):
        if other.name != "demo.yaml":
            other.unlink()
    data = yaml.safe_load((folder / "demo.yaml").read_text())
    data["engine"] = {**(data.get("engine") or {}), "tensor_parallel_size": 2}
    (folder / "demo.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    return folder


def test_without_the_kubernetes_client_only_a_set_pod_template_refuses_and_clearly(monkeypatch, tmp_path):
    """Without the ``kubernetes`` extra (its client cannot be imported) a pipeline whose engine wants 2 GPUs
    parses when no pod template is set; with one set, the DagBag shows an import error naming the extra, not a
    bare ModuleNotFoundError."""
    import sys

    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes raises ImportError
    monkeypatch.delenv("BATCH_LLM_GPU_POD_TEMPLATE", raising=False)
    monkeypatch.setenv("BATCH_LLM_PIPELINES_DIR", str(_tp2_pipelines(tmp_path)))
    dag_file = str(ROOT / "dags" / "batch_llm_pipelines.py")
    bag = DagBag(dag_folder=dag_file)
    assert bag.import_errors == {} and "batch_llm_demo" in bag.dags
    assert bag.dags["batch_llm_demo"].get_task("pipeline.batch_inference").pool_slots == 2

    monkeypatch.setenv("BATCH_LLM_GPU_POD_TEMPLATE", TEMPLATE)
    bag = DagBag(dag_folder=dag_file)
    errors = "\n".join(bag.import_errors.values())
    assert "AirflowClusterPolicyViolation" in errors and "batch-llm[kubernetes]" in errors, bag.import_errors
