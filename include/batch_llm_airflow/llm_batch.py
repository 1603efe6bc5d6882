"""``GPULLMBatchOperator`` and ``@task.gpu_llm_batch``: common-ai's ``LLMBatchOperator`` / ``@task.llm_batch``,
served by this project's engines on your own GPUs.

The same task, hosted or self-hosted; only the operator line changes::

    classify = LLMBatchOperator(task_id="classify", requests=prompts, result_path=ROOT, output_type=Sentiment,
                                system_prompt="...", llm_conn_id="pydanticai_default", model_id="openai:gpt-5-mini")
    classify = GPULLMBatchOperator(task_id="classify", requests=prompts, result_path=ROOT, output_type=Sentiment,
                                   system_prompt="...", model_id="Qwen/Qwen2.5-7B-Instruct")
    summarize(classify.output)      # the manifest: counts, result_uri; the rows are JSONL at result_uri

Why a group of tasks and not one operator: a hosted batch is one job to wait on, a self-hosted one is GPU work
that should spread over the GPU workers. ``GPULLMBatchOperator`` therefore adds the project's stages as tasks
(in a task group, ``<task_id>_gpu_batch``)::

    <task_id>.plan_shards ─> <task_id>.fetch_model ─> <task_id>.batch_inference × N ─> <task_id>

``plan_shards`` writes the requests (or runs the decorated function for them) and plans shards;
``batch_inference`` is ``BatchInferenceOperator`` mapped over the shards, on the GPU pool and queue of the
config (one worker process per shard, GPU leases, committed chunks); the last task, whose id is the
``task_id`` given, lands the results and returns the manifest, so ``ti.xcom_pull(task_ids=task_id)``,
``classify.output`` and ``upstream >> classify >> downstream`` mean what they mean with common-ai's operator.

The stage logic is ``batch_llm.llm_batch`` (no Airflow); here are only the tasks around it.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from airflow.sdk import Context, TaskGroup, TriggerRule
from airflow.sdk.bases.decorator import DecoratedOperator, determine_kwargs, get_unique_task_id
from airflow.sdk.definitions._internal.mixins import DependencyMixin
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION
from airflow.sdk.definitions.context import context_merge
from airflow.sdk.definitions.xcom_arg import PlainXComArg, XComArg
from airflow.sdk.exceptions import AirflowFailException
from batch_llm import llm_batch, stages
from batch_llm.config import PipelineConfig, load_config
from batch_llm.llm_batch import STATE_DIR, BatchInputError, OutputType
from pydantic import BaseModel

from batch_llm_airflow.hooks import BatchLlmStorageHook
from batch_llm_airflow.operators import BatchInferenceOperator, PipelineStageOperator, fetch_storage_options, names_storage_errors
from batch_llm_airflow.storage_bridge import StorageTarget, split_conn

# common-ai arguments that mean something only for a hosted API: refused by name, with what to do instead.
HOSTED_ONLY = {
    "llm_conn_id": "there is no API connection: the engine runs on your workers (model_id names the checkpoint)",
    "deferrable": "GPU work holds a worker slot while it runs; there is nothing to defer to the triggerer",
    "poll_interval": "nothing is polled: the tasks run the shards themselves",
    "timeout": "use execution_timeout (every task of the batch gets it)",
    "cancel_on_kill": "a killed shard task always ends its engine (BatchInferenceOperator.on_kill)",
    "cancel_on_timeout": "a timed-out shard task always ends its engine",
    "on_stale_state": "changed input is a new run folder (a fresh batch); the old one stays as it was",
    "on_orphaned_intent": "there is no submission to lose: a retry resumes from committed chunks",
    "completion_window": "no provider deadline",
}


def _target(url: str, *, must_exist: bool = False) -> StorageTarget:
    """``url`` (``s3://conn@bucket/key``: ObjectStoragePath's form names its connection) as a storage target."""
    return StorageTarget(split_conn(url)[1], BatchLlmStorageHook(None).location(url), must_exist=must_exist)


class BatchRef(BaseModel):
    """What the plan task hands the others (XCom key ``batch``): where the batch's run folder is."""

    result_path: str
    key16: str
    fingerprint: str
    reattached: bool


class GPUBatchPlanOperator(PipelineStageOperator):
    """Writes the requests into the batch's run folder and plans its shards (``llm_batch.prepare``,
    ``stages.plan_shards``); returns the shard list, the ``batch_inference`` task is mapped over it.

    A retry or a clear with the same requests and config re-attaches to the folder an earlier attempt made:
    it is named by their fingerprint under the task instance's key, and nothing planned there is planned again.
    Requests that cannot run (an unknown request key, a parameter the engine cannot apply) are refused per
    request and land as ``error`` rows; a batch that cannot run at all (not a list, an empty list, another
    model) fails the task without retries."""

    template_fields: Sequence[str] = ("requests", "input_path", "result_path", "system_prompt", "model_id",
                                      "request_params")
    template_fields_renderers = {"requests": "py", "request_params": "py"}
    ui_color = "#e8f0fe"

    def __init__(self, *, batch_task_id: str, result_path: str, model_id: str, requests: Any = None,
                 input_path: str | None = None, input_format: str = "auto", system_prompt: str = "",
                 output_type: Any = str, max_tokens: int = 1024, request_params: dict | None = None,
                 base_config: PipelineConfig | None = None, config_overrides: Mapping[str, Any] | None = None,
                 **kwargs: Any):
        super().__init__(pipeline_config={}, **kwargs)
        self.batch_task_id = batch_task_id
        self.requests, self.input_path, self.input_format = requests, input_path, input_format
        self.result_path, self.model_id, self.system_prompt = result_path, model_id, system_prompt
        self.output_type, self.max_tokens, self.request_params = output_type, max_tokens, request_params
        self.base_config, self.batch_overrides = base_config, dict(config_overrides or {})

    @names_storage_errors
    def execute(self, context: Context) -> list[dict]:
        self._storage_targets = [_target(self.result_path)]
        if self.input_path:
            self._storage_targets.append(_target(self.input_path, must_exist=True))
        root = self._storage_targets[0].location
        ti = context["ti"]
        try:
            cfg = llm_batch.batch_config(name=self.batch_task_id, model_id=self.model_id, result_path=self.result_path,
                                         max_tokens=self.max_tokens, output=OutputType.of(self.output_type),
                                         base=self.base_config, overrides=self.batch_overrides)
            requests = llm_batch.requests_from_file(self._storage_targets[1].location, self.input_format) \
                if self.input_path else llm_batch.normalize_requests(self.requests)
            batch = llm_batch.prepare(
                cfg, root.child(STATE_DIR), requests=requests, system_prompt=self.system_prompt or "",
                request_params=self.request_params, key=llm_batch.identity_key(
                    dag_id=ti.dag_id, task_id=self.batch_task_id, run_id=ti.run_id, map_index=-1))
        except BatchInputError as e:
            raise AirflowFailException(str(e)) from None  # the same input fails the same way on every retry
        m = batch.manifest
        self.log.info("%s batch %s-%s: %d requests (%d refused before planning) in %s", "re-attached to" if
                      batch.reattached else "prepared", m.key16, m.fingerprint, m.request_count, m.refused_count,
                      batch.layout.run_dir.url)
        plan = stages.plan_shards(batch.config, batch.layout)
        self.log.info("plan: %d requests valid, %d refused by the planner, %d shards", plan.valid, plan.invalid,
                      len(plan.shards))
        ti.xcom_push(key="batch", value=BatchRef(result_path=self.result_path, key16=m.key16,
                                                 fingerprint=m.fingerprint, reattached=batch.reattached).model_dump())
        return [s.model_dump() for s in plan.shards]


class _GPUBatchDecoratedPlanOperator(DecoratedOperator, GPUBatchPlanOperator):
    """The plan task of ``@task.gpu_llm_batch``: the decorated function returns the requests, at run time, with
    the task's context (as ``@task.llm_batch``'s does; it must return the same list on every attempt, or a
    retry sees new input and starts a fresh batch). The prompts it returns are not rendered as templates."""

    template_fields: Sequence[str] = tuple(f for f in (*DecoratedOperator.template_fields,
                                                       *GPUBatchPlanOperator.template_fields) if f != "requests")
    custom_operator_name = "@task.gpu_llm_batch"

    def __init__(self, *, python_callable: Callable, op_args: Sequence | None = None,
                 op_kwargs: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         requests=SET_DURING_EXECUTION, **kwargs)

    def execute(self, context: Context) -> list[dict]:
        context_merge(context, self.op_kwargs)
        self.requests = self.python_callable(*self.op_args, **determine_kwargs(self.python_callable, self.op_args,
                                                                               context))
        return GPUBatchPlanOperator.execute(self, context)


class _BatchStage(PipelineStageOperator):
    """The tasks after the plan: their config and run layout are the batch's (``BatchRef`` from XCom)."""

    def __init__(self, *, batch: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.batch = batch

    def resolve(self, context: Context):
        ref = BatchRef.model_validate(self.batch)
        self._storage_targets = [_target(ref.result_path)]
        root = self._storage_targets[0].location
        self._batch = llm_batch.read_batch(root.child(STATE_DIR), ref.key16, ref.fingerprint)
        self._ref = ref
        return self._batch.config, self._batch.layout


class GPUBatchModelOperator(_BatchStage):
    """The batch's model: fetched (ModelScope with its cache, a local folder or an object-storage prefix) and,
    where ``quantize.enabled``, exported to 4-bit AWQ; returns where the shards load it from."""

    template_fields: Sequence[str] = ("batch",)

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        fetched = stages.fetch(cfg, layout, **fetch_storage_options(cfg))
        m = stages.quantize(cfg, layout, fetched)
        self.log.info("model %s at %s", m.id, m.local_dir)
        return m.ref().model_dump(mode="json")


class GPUBatchInferenceOperator(_BatchStage, BatchInferenceOperator):
    """``BatchInferenceOperator`` on one shard of the batch: the same worker process, GPU lease, committed chunks
    and resume, in the batch's run folder (so a retry resumes after the last committed chunk)."""

    template_fields: Sequence[str] = ("batch", "shard", "model")


class GPUBatchLandOperator(_BatchStage):
    """Lands the batch: ``<result_path>/<key16>.jsonl`` with one row per request and the manifest (the XCom
    value), validated against ``output_type`` with pydantic. ``fail_on_partial_error`` fails the task (without
    retries: the same results would land again) when a request has no usable result."""

    template_fields: Sequence[str] = ("batch",)
    ui_color = "#d5f5e3"

    def __init__(self, *, output_type: Any = str, fail_on_partial_error: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.output_type, self.fail_on_partial_error = output_type, fail_on_partial_error

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        ref = self._ref
        result_uri = f"{ref.result_path.rstrip('/')}/{ref.key16}.jsonl"
        m = llm_batch.land(cfg, layout, self._batch.manifest, OutputType.of(self.output_type),
                           result=BatchLlmStorageHook(None).location(result_uri), result_uri=result_uri,
                           reattached=ref.reattached)
        counts = ", ".join(f"{k}={v}" for k, v in m.counts.model_dump().items() if v)
        self.log.info("Landed %d results for batch %s at %s (%s; terminal_reason=%s)", m.request_count, m.batch_id,
                      m.result_uri, counts or "no results", m.terminal_reason)
        if self.fail_on_partial_error and (partial := m.partial_buckets()):
            raise AirflowFailException(
                f"batch {m.batch_id!r} has no valid result for every request "
                f"({', '.join(f'{k}={v}' for k, v in partial.items())}); fail_on_partial_error=True. Results are at "
                f"{m.result_uri}; a clear lands the same results again without running the shards")
        return m.model_dump(mode="json")


@attrs.define
class BatchXComArg(PlainXComArg):
    """The manifest (the landing task's return value) as an XComArg whose *roots* are the batch's first task:
    ``start >> build_prompts(rows)`` puts ``start`` before the whole batch, not only before its landing task.
    Serialized and resolved as a plain XComArg of the landing task."""

    batch_roots: list = attrs.field(factory=list, eq=False, repr=False)

    @property
    def roots(self) -> list:
        return list(self.batch_roots) or super().roots

    def set_upstream(self, task_or_task_list, edge_modifier=None):
        for root in self.roots:
            root.set_upstream(task_or_task_list, edge_modifier)


class GPULLMBatchOperator(DependencyMixin):
    """common-ai's ``LLMBatchOperator`` run on this project's engines: the same arguments where the meaning is the
    same, the same result rows and manifest; the batch runs as tasks of its own (see the module docstring).

    Same as common-ai's (``airflow.providers.common.ai.operators.llm_batch.LLMBatchOperator``, 1.0.0):

    :param task_id: the landing task's id (its XCom is the manifest); the other tasks are ``<task_id>.<stage>``.
    :param requests: a list of prompt strings or ``{"prompt", "system_prompt", "max_tokens", "params"}`` objects
        (templated; an XComArg works). A request's ``model`` may only repeat ``model_id``.
    :param result_path: a directory URI (``/data/llm``, ``s3://bucket/prefix``, ``s3://conn_id@bucket/prefix``);
        results land at ``<result_path>/<key16>.jsonl``, state under ``<result_path>/_batch_llm_state/``.
        Templated; it must render the same on every attempt (``{{ run_id }}``, never ``{{ ts }}``).
    :param model_id: the model that answers: a ModelScope id, a local folder or an object-storage prefix (where
        common-ai takes ``"<provider>:<model>"``, refused here by that shape). Templated.
    :param system_prompt: the system message of every request that sets none. Templated.
    :param output_type: ``str`` (plain text) or a pydantic model / a type ``TypeAdapter`` takes: its JSON Schema is
        ``sampling.output_schema`` (vLLM decodes under it) and every answer is validated; one that does not match
        is an ``invalid_output`` row.
    :param max_tokens: the output token cap of every request that sets none (common-ai's default, 1024).
    :param request_params: merged into every request under its own ``params``: ``temperature``, ``top_p``,
        ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty`` (what the engine applies per request;
        ``user``/``metadata`` are dropped, anything else fails the task naming it). Templated.
    :param fail_on_partial_error: fail the landing task when a request has no usable result.

    Only here:

    :param input_path: instead of ``requests``, a JSONL / Parquet / CSV file or folder of requests (a ``prompt``
        column; ``system_prompt``, ``max_tokens``, ``params`` optional), streamed: no list in the DAG or XCom.
        A row that is not a request lands as an ``error`` row. ``input_format`` when the name does not tell.
    :param config: a pipeline YAML path or ``PipelineConfig`` whose engine, sharding, sampling, cache, model
        and airflow sections the batch uses (its input, output, filter and scoring are the batch's own).
    :param config_overrides: dotted config keys on top (``{"engine.kind": "transformers"}``), not templated.
    :param task_kwargs: BaseOperator arguments (``retries``, ``execution_timeout``, ...) for every task; the
        shard tasks' ``pool``, ``queue`` and ``pool_slots`` come from the config's ``airflow.gpu_pool``,
        ``airflow.gpu_queue`` and ``engine.tensor_parallel_size``.

    Hosted-only arguments (``llm_conn_id``, ``deferrable``, ``poll_interval``, ...) are refused with the reason.
    """

    def __init__(self, *, task_id: str, result_path: str, model_id: str, requests: Any = None,
                 input_path: str | None = None, input_format: str = "auto", system_prompt: str = "",
                 output_type: Any = str, max_tokens: int = 1024, request_params: dict | None = None,
                 fail_on_partial_error: bool = False, config: PipelineConfig | str | os.PathLike | None = None,
                 config_overrides: Mapping[str, Any] | None = None, python_callable: Callable | None = None,
                 op_args: Sequence | None = None, op_kwargs: Mapping[str, Any] | None = None, **task_kwargs: Any):
        if hosted := sorted(set(task_kwargs) & set(HOSTED_ONLY)):
            raise TypeError("GPULLMBatchOperator: " + "; ".join(f"{k}: {HOSTED_ONLY[k]}" for k in hosted))
        if python_callable is None and (requests is None) == (input_path is None):
            raise TypeError("GPULLMBatchOperator: give requests or input_path (one of them)")
        base = load_config(config) if isinstance(config, (str, os.PathLike)) else config
        output = OutputType.of(output_type)  # at parse time: an output_type without a schema is a DAG error
        # The config as far as it is known when the DAG is parsed (templated values are not rendered): it is
        # validated now, and gives the shard tasks their pool, queue and slots.
        cfg = llm_batch.batch_config(name=task_id, model_id=model_id, result_path=result_path, max_tokens=max_tokens,
                                     output=output, base=base, overrides=config_overrides)
        with TaskGroup(group_id=f"{task_id}_gpu_batch", prefix_group_id=False,
                       tooltip=f"GPU batch {task_id}: plan, model, shards, landing") as self.group:
            parent = self.group.parent_group
            full_id = parent.child_id(task_id) if parent is not None else task_id
            plan_args = dict(task_id=f"{full_id}.plan_shards", batch_task_id=full_id, result_path=result_path,
                             model_id=model_id, requests=requests, input_path=input_path, input_format=input_format,
                             system_prompt=system_prompt, output_type=output_type, max_tokens=max_tokens,
                             request_params=request_params, base_config=base, config_overrides=config_overrides,
                             **task_kwargs)
            if python_callable is not None:  # @task.gpu_llm_batch: the function returns the requests
                plan_args.pop("requests")
                plan = _GPUBatchDecoratedPlanOperator(python_callable=python_callable, op_args=op_args,
                                                      op_kwargs=op_kwargs, **plan_args)
            else:
                plan = GPUBatchPlanOperator(**plan_args)
            batch = XComArg(plan, key="batch")
            common = dict(pipeline_config=cfg.model_dump(mode="json"), batch=batch, **task_kwargs)
            model = GPUBatchModelOperator(task_id=f"{full_id}.fetch_model", **common)
            gpu = {**common, "pool": cfg.airflow.gpu_pool, "queue": cfg.airflow.gpu_queue,
                   "pool_slots": cfg.engine.tensor_parallel_size}
            shards = GPUBatchInferenceOperator.partial(task_id=f"{full_id}.batch_inference", model=model.output,
                                                       **gpu).expand(shard=plan.output)
            # none_failed: a batch whose every request was refused has no shard to run, and still lands.
            self.operator = GPUBatchLandOperator(task_id=full_id, output_type=output_type,
                                                 fail_on_partial_error=fail_on_partial_error,
                                                 trigger_rule=TriggerRule.NONE_FAILED, **common)
            plan >> model >> shards >> self.operator
        self.plan = plan

    @property
    def task_id(self) -> str:
        return self.operator.task_id

    @property
    def output(self) -> BatchXComArg:
        """The manifest, as ``LLMBatchOperator(...).output`` is."""
        return BatchXComArg(operator=self.operator, batch_roots=[self.plan])

    @property
    def roots(self) -> list:
        return [self.plan]

    @property
    def leaves(self) -> list:
        return [self.operator]

    def set_upstream(self, other, edge_modifier=None):
        self.plan.set_upstream(other, edge_modifier)

    def set_downstream(self, other, edge_modifier=None):
        self.operator.set_downstream(other, edge_modifier)


class _GPULLMBatchDecorator:
    """What ``@task.gpu_llm_batch`` makes of a function: calling it adds the batch and returns the manifest."""

    def __init__(self, function: Callable, kwargs: dict):
        self.function, self.kwargs = function, kwargs
        functools.update_wrapper(self, function)

    def override(self, **kwargs: Any) -> _GPULLMBatchDecorator:
        return _GPULLMBatchDecorator(self.function, {**self.kwargs, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> BatchXComArg:
        task_id = get_unique_task_id(self.kwargs.get("task_id") or self.function.__name__)
        return GPULLMBatchOperator(**{**self.kwargs, "task_id": task_id}, python_callable=self.function,
                                   op_args=args, op_kwargs=kwargs).output


def gpu_llm_batch_task(python_callable: Callable | None = None, **kwargs: Any):
    """``@task.gpu_llm_batch``: ``@task.llm_batch`` on your GPUs. The function returns the batch's requests; the
    call returns the manifest; the other arguments are ``GPULLMBatchOperator``'s::

        @task.gpu_llm_batch(result_path="s3://lake@bucket/llm/{{ run_id }}", model_id="Qwen/Qwen2.5-7B-Instruct",
                            system_prompt="Classify the review.", output_type=Sentiment)
        def build_prompts(reviews: list[str]) -> list[str]:
            return [f"Review: {r!r}" for r in reviews]

        summarize(build_prompts(reviews))

    Registered through the provider's ``task-decorators`` (``get_provider_info.py``)."""
    def decorate(function: Callable) -> _GPULLMBatchDecorator:
        return _GPULLMBatchDecorator(function, kwargs)

    return decorate(python_callable) if python_callable is not None else decorate
