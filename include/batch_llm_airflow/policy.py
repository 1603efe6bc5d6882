"""Cluster policy for Kubernetes: every GPU task runs in a GPU pod; every other task is left alone.

Airflow loads it through the distribution's ``airflow.policy`` entry point (pyproject.toml), as a pluggy plugin
beside the cluster's own policies: nothing replaces the cluster's ``airflow_local_settings.py``, whose
``task_policy`` (if it has one) runs as well. It does nothing unless ``BATCH_LLM_GPU_POD_TEMPLATE`` names a
pod template file, so the Celery deployment (queue ``gpu``) is not affected. On Kubernetes set, on the
scheduler and the dag-processor (where DAGs are parsed and policies applied):

    BATCH_LLM_GPU_POD_TEMPLATE=/opt/airflow/pod_templates/pod_template_gpu.yaml
    BATCH_LLM_GPU_EXECUTOR=KubernetesExecutor   # only with several executors, e.g. CeleryExecutor,KubernetesExecutor

A GPU task is one whose operator class says so (``runs_on_gpu = True``: ``BatchInferenceOperator`` and every
operator built on it, the pipeline's shards and ``GPULLMBatchOperator`` / ``@task.gpu_llm_batch``'s), mapped or
not. It gets ``executor_config={"pod_template_file": ...}``, plus a ``pod_override`` asking for the
``tensor_parallel_size`` GPUs of the engine the task runs (its class's ``engine_section``: ``engine`` for a shard,
``filter.review.engine`` for the content review's task) when that is more than the template's one. The pod
override needs the ``kubernetes`` extra (the Kubernetes provider's client); where it is missing only a task that
needs the override fails, and only with a pod template set: ``AirflowClusterPolicyViolation`` naming the extra,
which Airflow shows as the DAG file's import error. What the task's
author set stays: their own ``pod_template_file`` (the executor config is then left as it is), their
``pod_override`` (kept as given, on the GPU template: ask for more GPUs there), their ``executor``.
See docs/production.md, "Kubernetes equivalent".
"""
from __future__ import annotations

import os
from typing import Any

from airflow.exceptions import AirflowClusterPolicyViolation
from airflow.policies import hookimpl

TEMPLATE_ENV, EXECUTOR_ENV = "BATCH_LLM_GPU_POD_TEMPLATE", "BATCH_LLM_GPU_EXECUTOR"
TEMPLATE_GPUS = 1  # nvidia.com/gpu of docker/k8s/pod_template_gpu.yaml


def runs_on_gpu(task: Any) -> bool:
    """Whether ``task`` (an operator, or a mapped one: its ``operator_class``) is a GPU task."""
    cls = getattr(task, "operator_class", None)
    if not isinstance(cls, type):
        cls = type(task)
    return bool(getattr(cls, "runs_on_gpu", False))


def engine_section(task: Any) -> tuple[str, ...]:
    """Where the engine ``task`` runs is in its pipeline config (its class's ``engine_section``)."""
    cls = getattr(task, "operator_class", None)
    if not isinstance(cls, type):
        cls = type(task)
    return tuple(getattr(cls, "engine_section", ("engine",)))


def gpu_pod_override(gpus: int) -> Any:
    try:
        from kubernetes.client import models as k8s
    except ImportError:
        raise AirflowClusterPolicyViolation(
            f"{TEMPLATE_ENV} is set and a GPU task asks for {gpus} GPUs (tensor_parallel_size), which needs a pod "
            "override, but the kubernetes client is not installed: install batch-llm[kubernetes] (the Kubernetes "
            "provider) where DAGs are parsed, or unset the variable") from None

    amount = {"nvidia.com/gpu": str(gpus)}
    return k8s.V1Pod(spec=k8s.V1PodSpec(containers=[k8s.V1Container(
        name="base", resources=k8s.V1ResourceRequirements(limits=amount, requests=amount))]))


def engine_gpus(pipeline: dict | None, section: tuple[str, ...] = ("engine",)) -> int:
    """The ``tensor_parallel_size`` of the engine at ``section`` of a pipeline config's dump (1 where unset)."""
    node: Any = pipeline or {}
    for key in section:
        node = (node.get(key) if isinstance(node, dict) else None) or {}
    return int(node.get("tensor_parallel_size") or 1) if isinstance(node, dict) else 1


def gpu_executor_config(existing: dict | None, pipeline: dict | None, template: str,
                        section: tuple[str, ...] = ("engine",)) -> dict:
    """The executor config of a GPU task that has ``existing`` (its author's, possibly empty), whose engine is at
    ``section`` of ``pipeline``."""
    config = dict(existing or {})
    if "pod_template_file" in config:  # the author chose the pod: theirs
        return config
    config["pod_template_file"] = template
    tp = engine_gpus(pipeline, section)
    if tp > TEMPLATE_GPUS and "pod_override" not in config:
        config["pod_override"] = gpu_pod_override(tp)
    return config


@hookimpl
def task_policy(task: Any) -> None:
    template = os.environ.get(TEMPLATE_ENV)
    if not template or not runs_on_gpu(task):
        return
    executor = os.environ.get(EXECUTOR_ENV) or None
    section = engine_section(task)
    kwargs = getattr(task, "partial_kwargs", None)  # a mapped task keeps its arguments here
    if kwargs is not None:
        kwargs["executor_config"] = gpu_executor_config(kwargs.get("executor_config"), kwargs.get("pipeline_config"),
                                                        template, section)
        if executor and not kwargs.get("executor"):
            kwargs["executor"] = executor
        return
    task.executor_config = gpu_executor_config(task.executor_config, getattr(task, "pipeline_config", None), template,
                                               section)
    if executor and not task.executor:
        task.executor = executor
