"""Cluster policy for Kubernetes: runs the batch_inference tasks in GPU pods, leaves every other task alone.

Both images put this file at $AIRFLOW_HOME/config/airflow_local_settings.py, where Airflow imports it. It does
nothing unless BATCH_LLM_GPU_POD_TEMPLATE names a pod template file, so the compose deployment (Celery, queue
"gpu") is not affected. On Kubernetes set, on the scheduler and the dag-processor:

    BATCH_LLM_GPU_POD_TEMPLATE=/opt/airflow/pod_templates/pod_template_gpu.yaml
    BATCH_LLM_GPU_EXECUTOR=KubernetesExecutor   # only with several executors, e.g. CeleryExecutor,KubernetesExecutor

A BatchInferenceOperator task (mapped, as the task group builds it, or not) then gets
``executor_config={"pod_template_file": ...}``, and a ``pod_override`` asking for
``engine.tensor_parallel_size`` GPUs when its pipeline wants more than the template's one. Tasks that already
have an executor_config are left as their author set them. See docs/production.md.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["task_policy"]

GPU_OPERATOR = "BatchInferenceOperator"
TEMPLATE_GPUS = 1  # nvidia.com/gpu of docker/k8s/pod_template_gpu.yaml


def _gpu_pod_override(gpus: int) -> Any:
    from kubernetes.client import models as k8s

    amount = {"nvidia.com/gpu": str(gpus)}
    return k8s.V1Pod(spec=k8s.V1PodSpec(containers=[k8s.V1Container(
        name="base", resources=k8s.V1ResourceRequirements(limits=amount, requests=amount))]))


def gpu_executor_config(task: Any, template: str) -> dict:
    kwargs = getattr(task, "partial_kwargs", None)
    pipeline = (kwargs if kwargs is not None else vars(task)).get("pipeline_config") or {}
    tp = int((pipeline.get("engine") or {}).get("tensor_parallel_size") or 1)
    config: dict[str, Any] = {"pod_template_file": template}
    if tp > TEMPLATE_GPUS:
        config["pod_override"] = _gpu_pod_override(tp)
    return config


def task_policy(task: Any) -> None:
    template = os.environ.get("BATCH_LLM_GPU_POD_TEMPLATE")
    if not template or getattr(task, "task_type", None) != GPU_OPERATOR:
        return
    executor = os.environ.get("BATCH_LLM_GPU_EXECUTOR") or None
    kwargs = getattr(task, "partial_kwargs", None)  # a MappedOperator keeps its arguments here
    if kwargs is not None:
        if not kwargs.get("executor_config"):
            kwargs["executor_config"] = gpu_executor_config(task, template)
        if executor:
            kwargs["executor"] = executor
        return
    if not task.executor_config:
        task.executor_config = gpu_executor_config(task, template)
    if executor:
        task.executor = executor
