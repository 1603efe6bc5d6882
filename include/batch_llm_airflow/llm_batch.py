"""``GPULLMBatchOperator`` and ``@task.gpu_llm_batch``: common-ai's ``LLMBatchOperator`` / ``@task.llm_batch``,
served by this project's engines on your own GPUs.

The same task, hosted or self-hosted; only the operator line changes::

    classify = LLMBatchOperator(task_id="classify", requests=prompts, result_path=ROOT, output_type=Sentiment,
                                system_prompt="...", llm_conn_id="pydanticai_default", model_id="openai:gpt-5-mini")
    classify = GPULLMBatchOperator(task_id="classify", requests=prompts, result_path=ROOT, output_type=Sentiment,
                                   system_prompt="...", model_id="Qwen/Qwen2.5-7B-Instruct")
    summarize(classify.output)      # the manifest: counts, result_uri; the rows are JSONL at result_uri

Why a group of tasks and not one operator: a hosted batch is one job to wait on, a self-hosted one is GPU work
that should spread over the GPU workers. ``GPULLMBatchOperator`` therefore builds Airflow's own ``TaskGroup``
(``<task_id>_gpu_batch``) of the project's stages, thin operators over the stage library::

    <task_id>.plan_shards ─> <task_id>.fetch_model ─> <task_id>.batch_inference × N ─> <task_id>

``plan_shards`` writes the requests (or runs the decorated function for them) and plans shards;
``batch_inference`` is ``BatchInferenceOperator`` mapped over the shards, on the GPU pool and queue of the
config (one worker process per shard, GPU leases, committed chunks); the last task, whose id is the
``task_id`` given, lands the results and returns the manifest, so ``ti.xcom_pull(task_ids=task_id)``,
``classify.output`` and ``upstream >> classify >> downstream`` mean what they mean with common-ai's operator.

The stage logic is ``batch_llm.frontends.common_ai`` (no Airflow); here are only the tasks around it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from airflow.sdk import BaseOperator, Context, TaskGroup, TriggerRule
from airflow.sdk.bases.decorator import DecoratedOperator, determine_kwargs, get_unique_task_id, task_decorator_factory
from airflow.sdk.definitions.context import context_merge
from airflow.sdk.definitions.xcom_arg import PlainXComArg, XComArg
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from batch_llm import api
from batch_llm.config import PipelineConfig, load_config
from batch_llm.frontends import common_ai as llm_batch
from batch_llm.frontends.common_ai import STATE_DIR, OutputType
from pydantic import BaseModel

from batch_llm_airflow.hooks import BatchLlmStorageHook
from batch_llm_airflow.operators import BatchInferenceOperator, PipelineStageOperator, fetch_storage_options, names_storage_errors
from batch_llm_airflow.storage_bridge import StorageTarget, split_conn

if TYPE_CHECKING:
    from airflow.sdk.definitions.mappedoperator import MappedOperator

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

# Where a BaseOperator argument given to the batch lands. common-ai's LLMBatchOperator is one task; here the batch
# is several, and each argument goes to the task(s) where it means what it means there:
# - the batch's outcome, on the landing task only (the task with the id given, whose XCom is the manifest): it
#   runs once per batch, after every shard, and fails when any earlier task of the batch failed, so its
#   outlets update their Assets once per landed batch and its callbacks fire once per batch;
# - the batch's start, on the plan task only (its first task, the one the upstream tasks point at);
# - everything else (retries, retry_delay, execution_timeout, owner, priority_weight, executor_config,
#   max_active_tis_per_dag, ...), on every task, each applying it to itself; the shard tasks' pool, queue and
#   pool_slots are the config's GPU ones whatever else is given (a pool given here is the other tasks').
BATCH_OUTCOME_ARGS = frozenset({
    "outlets", "inlets", "on_success_callback", "on_failure_callback", "on_retry_callback", "on_skipped_callback",
    "email", "email_on_failure", "email_on_retry", "task_display_name", "doc", "doc_md", "doc_json", "doc_yaml",
    "doc_rst", "do_xcom_push", "multiple_outputs"})
BATCH_START_ARGS = frozenset({"trigger_rule", "on_execute_callback"})


def split_task_kwargs(task_kwargs: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """``task_kwargs`` as (every task's, the plan task's, the landing task's): see ``BATCH_OUTCOME_ARGS``."""
    every = {k: v for k, v in task_kwargs.items() if k not in BATCH_OUTCOME_ARGS | BATCH_START_ARGS}
    start = {k: v for k, v in task_kwargs.items() if k in BATCH_START_ARGS}
    outcome = {k: v for k, v in task_kwargs.items() if k in BATCH_OUTCOME_ARGS}
    return every, start, outcome


def common_ai_errors(module: types.ModuleType | None) -> dict[type, type]:
    """For each of the stage library's common-ai-named errors (``llm_batch.COMMON_AI_ERRORS``), a subclass that is
    also common-ai's own class of that name in ``module`` (``airflow.providers.common.ai.exceptions``), and of
    the subclass made for its parent: ``except`` on either provider's class, or the stage library's, catches it."""
    made: dict[type, type] = {}
    for ours in llm_batch.COMMON_AI_ERRORS:
        theirs = getattr(module, ours.__name__, None)
        if not isinstance(theirs, type):
            continue
        parents = tuple(made[b] for b in ours.__bases__ if b in made)
        made[ours] = type(ours.__name__, (ours, *parents, theirs), {"__module__": __name__, "__doc__": ours.__doc__})
    return made


try:  # common-ai installed beside this provider: raise its classes (subclassed), else the same-named ones
    from airflow.providers.common.ai import exceptions as _common_ai_exceptions
except ImportError:
    _common_ai_exceptions = None
COMMON_AI_ERRORS = common_ai_errors(_common_ai_exceptions)
LLMBatchInputError = COMMON_AI_ERRORS.get(llm_batch.LLMBatchInputError, llm_batch.LLMBatchInputError)
LLMBatchModelMismatchError = COMMON_AI_ERRORS.get(llm_batch.LLMBatchModelMismatchError,
                                                  llm_batch.LLMBatchModelMismatchError)
UnsupportedBatchProviderError = COMMON_AI_ERRORS.get(llm_batch.UnsupportedBatchProviderError,
                                                     llm_batch.UnsupportedBatchProviderError)
LLMBatchOutputTypeError = COMMON_AI_ERRORS.get(llm_batch.LLMBatchOutputTypeError, llm_batch.LLMBatchOutputTypeError)
LLMBatchJobError = COMMON_AI_ERRORS.get(llm_batch.LLMBatchJobError, llm_batch.LLMBatchJobError)
LLMBatchPartialFailureError = COMMON_AI_ERRORS.get(llm_batch.LLMBatchPartialFailureError,
                                                   llm_batch.LLMBatchPartialFailureError)
LLMBatchStateReadError = COMMON_AI_ERRORS.get(llm_batch.LLMBatchStateReadError, llm_batch.LLMBatchStateReadError)


@contextlib.contextmanager
def as_common_ai(errors: Mapping[type, type] | None = None):
    """Re-raises the stage library's common-ai-named errors as their common-ai subclasses (``errors``, default
    ``COMMON_AI_ERRORS``; nothing to do when common-ai is not installed)."""
    errors = COMMON_AI_ERRORS if errors is None else errors
    caught: tuple[type[BaseException], ...] = tuple(errors)
    try:
        yield
    except caught as e:
        if isinstance(e, tuple(errors.values())):
            raise
        cls = next(errors[c] for c in type(e).__mro__ if c in errors)
        raise cls(*e.args).with_traceback(e.__traceback__) from e.__cause__


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
    ``api.plan_shards``); returns the shard list, the ``batch_inference`` task is mapped over it.

    A retry or a clear with the same requests and config re-attaches to the folder an earlier attempt made:
    it is named by their fingerprint under the task instance's key, and nothing planned there is planned again.
    Requests that cannot run (an unknown request key, a parameter the engine cannot apply) are refused per
    request and land as ``error`` rows; a batch that cannot run at all (not a list, an empty list, another
    model) raises ``LLMBatchInputError`` (common-ai's; retried by the task's ``retries``, as common-ai's is).

    In a mapped batch (``.partial().expand()``) each map index is a batch of its own (the identity key has the
    map index, as common-ai's), and the task returns ``{**BatchRef, "shards": [...]}``."""

    template_fields: Sequence[str] = ("requests", "input_path", "result_path", "system_prompt", "model_id",
                                      "request_params")
    template_fields_renderers = {"requests": "py", "request_params": "py"}
    ui_color = "#e8f0fe"

    def __init__(self, *, batch_task_id: str, result_path: str, model_id: str, requests: Any = None,
                 input_path: str | None = None, input_format: str = "auto", system_prompt: str = "",
                 output_type: Any = str, max_tokens: int = 1024, request_params: dict | None = None,
                 base_config: PipelineConfig | None = None, config_overrides: Mapping[str, Any] | None = None,
                 batch_mapped: bool = False, **kwargs: Any):
        super().__init__(pipeline_config={}, **kwargs)
        self.batch_mapped = batch_mapped
        self.batch_task_id = batch_task_id
        self.requests, self.input_path, self.input_format = requests, input_path, input_format
        self.result_path, self.model_id, self.system_prompt = result_path, model_id, system_prompt
        self.output_type, self.max_tokens, self.request_params = output_type, max_tokens, request_params
        self.base_config, self.batch_overrides = base_config, dict(config_overrides or {})

    @names_storage_errors
    def execute(self, context: Context) -> list[dict] | dict:
        with as_common_ai():
            return self._plan(context)

    def _plan(self, context: Context) -> list[dict] | dict:
        self._storage_targets = [_target(self.result_path)]
        if self.input_path:
            self._storage_targets.append(_target(self.input_path, must_exist=True))
        root = self._storage_targets[0].location
        ti = context["ti"]
        map_index = ti.map_index if ti.map_index is not None else -1
        cfg = llm_batch.batch_config(name=self.batch_task_id, model_id=self.model_id, result_path=self.result_path,
                                     max_tokens=self.max_tokens, output=OutputType.of(self.output_type),
                                     base=self.base_config, overrides=self.batch_overrides,
                                     response_format=(self.request_params or {}).get("response_format"))
        requests = llm_batch.requests_from_file(self._storage_targets[1].location, self.input_format) \
            if self.input_path else llm_batch.normalize_requests(self.requests)
        batch = llm_batch.prepare(
            cfg, root.child(STATE_DIR), requests=requests, system_prompt=self.system_prompt or "",
            request_params=self.request_params, key=llm_batch.identity_key(
                dag_id=ti.dag_id, task_id=self.batch_task_id, run_id=ti.run_id, map_index=map_index))
        m = batch.manifest
        self.log.info("%s batch %s-%s: %d requests (%d refused before planning) in %s", "re-attached to" if
                      batch.reattached else "prepared", m.key16, m.fingerprint, m.request_count, m.refused_count,
                      batch.layout.run_dir.url)
        plan = api.plan_shards(batch.config, batch.layout)
        self.log.info("plan: %d requests valid, %d refused by the planner, %d shards", plan.valid, plan.invalid,
                      len(plan.shards))
        ref = BatchRef(result_path=self.result_path, key16=m.key16, fingerprint=m.fingerprint,
                       reattached=batch.reattached).model_dump()
        shards = [s.model_dump() for s in plan.shards]
        if self.batch_mapped:  # one of many batches: the later tasks map over these values
            return {**ref, "shards": shards}
        ti.xcom_push(key="batch", value=ref)
        return shards


class _GPUBatchDecoratedPlanOperator(DecoratedOperator, GPUBatchPlanOperator):
    """The plan task of ``@task.gpu_llm_batch``: the decorated function returns the requests, at run time, with
    the task's context (as ``@task.llm_batch``'s does; it must return the same list on every attempt, or a
    retry sees new input and starts a fresh batch). The prompts it returns are not rendered as templates."""

    template_fields: Sequence[str] = tuple(f for f in (*DecoratedOperator.template_fields,
                                                       *GPUBatchPlanOperator.template_fields) if f != "requests")
    custom_operator_name = "@task.gpu_llm_batch"

    def __init__(self, *, python_callable: Callable, op_args: Sequence | None = None,
                 op_kwargs: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs, requests=None,
                         **kwargs)  # the requests are the function's return value, set in execute

    def execute(self, context: Context) -> list[dict] | dict:
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
        with as_common_ai():
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
        fetched = api.fetch(cfg, layout, **fetch_storage_options(cfg))
        m = api.quantize(cfg, layout, fetched)
        self.log.info("model %s at %s", m.id, m.local_dir)
        return m.ref().model_dump(mode="json")


class GPUBatchInferenceOperator(_BatchStage, BatchInferenceOperator):
    """``BatchInferenceOperator`` on one shard of the batch: the same worker process, GPU lease, committed chunks
    and resume, in the batch's run folder (so a retry resumes after the last committed chunk)."""

    template_fields = ("batch", "shard", "model")


class GPUBatchLandOperator(_BatchStage):
    """Lands the batch: ``<result_path>/<key16>.jsonl`` with one row per request and the manifest (the XCom
    value), validated against ``output_type`` with pydantic. ``fail_on_partial_error`` fails the task with
    ``LLMBatchPartialFailureError`` when a request has no usable result; as common-ai's, that is retried by the
    task's ``retries``, and a retry lands the same results again (nothing is run again) and raises again.

    With ``plan_task_id`` (an unmapped batch) it runs when every earlier task of the batch is done, whatever
    their state (``all_done``), reads the batch from the plan task's XCom, and first checks the states of
    ``batch_task_ids``: when one failed it fails (no retry) naming them, so the batch's failure is this task's
    (its callbacks fire once); when the plan was skipped (a branch not taken) it is skipped too."""

    template_fields: Sequence[str] = ("batch",)
    ui_color = "#d5f5e3"

    def __init__(self, *, output_type: Any = str, fail_on_partial_error: bool = False, plan_task_id: str | None = None,
                 batch_task_ids: Sequence[str] = (), batch: Any = None, **kwargs: Any):
        super().__init__(batch=batch, **kwargs)
        self.output_type, self.fail_on_partial_error = output_type, fail_on_partial_error
        self.plan_task_id, self.batch_task_ids = plan_task_id, list(batch_task_ids)

    def check_batch_tasks(self, context: Context) -> None:
        """Fails naming the batch's failed tasks, or skips when the plan was skipped (see the class doc)."""
        ti = context["ti"]
        states = ti.get_task_states(dag_id=ti.dag_id, task_ids=self.batch_task_ids,
                                    run_ids=[ti.run_id]).get(ti.run_id, {})
        # a mapped task's instances come as "<task_id>_<map index>"
        named = {(k if k in self.batch_task_ids else "{}[{}]".format(*k.rsplit("_", 1))): str(v)
                 for k, v in states.items()}
        if failed := sorted(k for k, v in named.items() if v in ("failed", "upstream_failed")):
            raise AirflowFailException(
                f"batch {self.task_id!r} has nothing to land: {', '.join(f'{k} {named[k]}' for k in failed)}. "
                "Clear the failed task with its downstream tasks to run it again (a shard resumes after its "
                "committed chunks)")
        if named.get(str(self.plan_task_id)) == "skipped":
            raise AirflowSkipException(f"batch {self.task_id!r}: {self.plan_task_id} was skipped")

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        if self.plan_task_id is not None:
            self.check_batch_tasks(context)
            self.batch = context["ti"].xcom_pull(task_ids=self.plan_task_id, key="batch")
        cfg, layout = self.resolve(context)
        ref = self._ref
        result_uri = f"{ref.result_path.rstrip('/')}/{ref.key16}.jsonl"
        with as_common_ai():
            m = llm_batch.land(cfg, layout, self._batch.manifest, OutputType.of(self.output_type),
                               result=BatchLlmStorageHook(None).location(result_uri), result_uri=result_uri,
                               reattached=ref.reattached)
        counts = ", ".join(f"{k}={v}" for k, v in m.counts.model_dump().items() if v)
        self.log.info("Landed %d results for batch %s at %s (%s; terminal_reason=%s)", m.request_count, m.batch_id,
                      m.result_uri, counts or "no results", m.terminal_reason)
        if self.fail_on_partial_error and (partial := m.partial_buckets()):
            raise LLMBatchPartialFailureError(
                f"Batch {m.batch_id!r} did not produce a valid result for every request "
                f"({', '.join(f'{k}={v}' for k, v in partial.items())}); fail_on_partial_error=True. Results are at "
                f"{m.result_uri}; the batch's state is kept, so a retry lands the same results without running "
                "the shards")
        return m.model_dump(mode="json")


class GPUBatchShardsOperator(BaseOperator):
    """The shards of every batch of a mapped GPU batch as one list (``{"batch", "shard", "model"}`` each), what
    ``batch_inference`` is mapped over: the shards of all the batches spread over the GPU workers together."""

    template_fields: Sequence[str] = ("batches", "models")
    ui_color = "#e8f0fe"

    def __init__(self, *, batches: Any, models: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.batches, self.models = batches, models

    def execute(self, context: Context) -> list[dict]:
        out: list[dict] = []
        for planned, model in zip(self.batches, self.models, strict=True):
            ref = BatchRef.model_validate(planned).model_dump()
            out.extend({"batch": ref, "shard": shard, "model": model} for shard in planned["shards"])
        self.log.info("%d shards over %d batches", len(out), len(self.batches))
        return out


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


@attrs.define(init=False, kw_only=True, repr=False)
class GPULLMBatchOperator(TaskGroup):
    """common-ai's ``LLMBatchOperator`` run on this project's engines: the same arguments where the meaning is the
    same, the same result rows and manifest; the batch runs as tasks of its own (see the module docstring), and
    this is their group: Airflow's ``TaskGroup`` (``<task_id>_gpu_batch``, task ids not prefixed) built by the
    constructor, so ``a >> batch >> b`` is the group's own dependency protocol (its root is the plan task, its
    leaf the landing task), and ``.output`` / ``.task_id`` are the landing task's, as common-ai's one task's are.

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
        ``user``/``metadata`` are dropped, anything else fails the task naming it), and ``response_format``
        (OpenAI's ``json_schema`` shape: ``sampling.output_schema`` where ``output_type`` is ``str``). Templated.
    :param fail_on_partial_error: fail the landing task (``LLMBatchPartialFailureError``, retried by ``retries``
        as common-ai's) when a request has no usable result.

    ``GPULLMBatchOperator.partial(...).expand(...)`` maps it as common-ai's: one batch per map index.

    Only here:

    :param input_path: instead of ``requests``, a JSONL / Parquet / CSV file or folder of requests (a ``prompt``
        column; ``system_prompt``, ``max_tokens``, ``params`` optional), streamed: no list in the DAG or XCom.
        A row that is not a request lands as an ``error`` row. ``input_format`` when the name does not tell.
    :param config: a pipeline YAML path or ``PipelineConfig`` whose engine, sharding, sampling, cache, model
        and airflow sections the batch uses (its input, output, filter and scoring are the batch's own).
    :param config_overrides: dotted config keys on top (``{"engine.kind": "transformers"}``), not templated.
    :param task_kwargs: BaseOperator arguments, each given to the task(s) where it means what it means on
        common-ai's one task (``BATCH_OUTCOME_ARGS``, ``BATCH_START_ARGS``):

        - the batch's outcome, the landing task only: ``outlets`` and ``inlets`` (an Asset is updated once per
          landed batch, after every shard), ``on_success_callback``, ``on_failure_callback`` (once per failed
          batch: the landing task fails when an earlier task of the batch failed), ``on_retry_callback`` (the
          landing task's retries; a shard's retries resume it and call nothing), ``on_skipped_callback``,
          ``email*``, ``task_display_name``, ``doc*``;
        - the batch's start, the plan task only: ``trigger_rule`` (against the batch's upstream tasks) and
          ``on_execute_callback``;
        - every task, each applying it to itself: ``retries``, ``retry_delay``, ``retry_exponential_backoff``,
          ``execution_timeout`` (per task, not for the whole batch), ``owner``, ``priority_weight``,
          ``executor_config``, ``max_active_tis_per_dag``, ``pool`` and ``queue`` (except for the shard tasks,
          whose ``pool``, ``queue`` and ``pool_slots`` are the config's ``airflow.gpu_pool``,
          ``airflow.gpu_queue`` and ``engine.tensor_parallel_size``), and the rest.

        In a mapped batch (``.partial().expand()``) the landings run only when nothing before them failed;
        a failure there leaves them ``upstream_failed``, for which Airflow calls no callback (the DAG run's
        ``on_failure_callback`` does fire).

    Hosted-only arguments (``llm_conn_id``, ``deferrable``, ``poll_interval``, ...) are refused with the reason.
    """

    plan: Any = attrs.field(init=False, default=None)      # the plan task: one, or mapped (one per batch)
    operator: Any = attrs.field(init=False, default=None)  # the landing task, whose XCom is the manifest: the same

    def __init__(self, *, task_id: str, result_path: str, model_id: str, requests: Any = None,
                 input_path: str | None = None, input_format: str = "auto", system_prompt: str = "",
                 output_type: Any = str, max_tokens: int = 1024, request_params: dict | None = None,
                 fail_on_partial_error: bool = False, config: PipelineConfig | str | os.PathLike | None = None,
                 config_overrides: Mapping[str, Any] | None = None, python_callable: Callable | None = None,
                 op_args: Sequence | None = None, op_kwargs: Mapping[str, Any] | None = None, **task_kwargs: Any):
        if python_callable is None and (requests is None) == (input_path is None):
            raise TypeError("GPULLMBatchOperator: give requests or input_path (one of them)")
        plan_args = dict(result_path=result_path, model_id=model_id, requests=requests, input_path=input_path,
                         input_format=input_format, system_prompt=system_prompt, max_tokens=max_tokens,
                         request_params=request_params)
        make_plan: Callable[..., BaseOperator] = GPUBatchPlanOperator
        if python_callable is not None:  # @task.gpu_llm_batch: the function returns the requests
            plan_args.pop("requests")
            make_plan = functools.partial(_GPUBatchDecoratedPlanOperator, python_callable=python_callable,
                                          op_args=op_args, op_kwargs=op_kwargs)
        self._build(task_id, plan_args, make_plan, mapped=False, output_type=output_type,
                    fail_on_partial_error=fail_on_partial_error, config=config, config_overrides=config_overrides,
                    task_kwargs=task_kwargs)

    @classmethod
    def partial(cls, **kwargs: Any) -> GPULLMBatchPartial:
        """Mapping, as ``LLMBatchOperator.partial(...).expand(...)``: one batch per map index, each with its own
        result file (the identity key has the map index, as common-ai's). ``.expand()`` / ``.expand_kwargs()``
        take the per-batch arguments (``EXPANDABLE``); ``.output`` is then the list of manifests."""
        return GPULLMBatchPartial(cls, kwargs)

    def _build(self, task_id: str, plan_args: dict, make_plan: Callable[..., Any], *, mapped: bool,
               output_type: Any = str, fail_on_partial_error: bool = False,
               config: PipelineConfig | str | os.PathLike | None = None,
               config_overrides: Mapping[str, Any] | None = None, task_kwargs: Mapping[str, Any]) -> None:
        """The batch's tasks. ``make_plan(**plan task arguments)`` makes the plan task (``mapped``: a mapped one,
        whose expanded arguments ``plan_args`` lacks)."""
        task_kwargs = dict(task_kwargs)
        if hosted := sorted(set(task_kwargs) & set(HOSTED_ONLY)):
            raise TypeError("GPULLMBatchOperator: " + "; ".join(f"{k}: {HOSTED_ONLY[k]}" for k in hosted))
        base = load_config(config) if isinstance(config, (str, os.PathLike)) else config
        # The config as far as it is known when the DAG is parsed (templated and expanded values are not known):
        # it is validated now, and gives the shard tasks their pool, queue and slots.
        params = plan_args.get("request_params")
        with as_common_ai():
            output = OutputType.of(output_type)  # at parse time: an output_type without a schema is a DAG error
            cfg = llm_batch.batch_config(
                name=task_id, model_id=plan_args.get("model_id", "(mapped)"),
                result_path=plan_args.get("result_path", "(mapped)"), max_tokens=plan_args.get("max_tokens", 1024),
                output=output, base=base, overrides=config_overrides,
                response_format=params.get("response_format") if isinstance(params, Mapping) else None)
        self.__attrs_init__(group_id=f"{task_id}_gpu_batch", prefix_group_id=False,
                            tooltip=f"GPU batch {task_id}: plan, model, shards, landing")
        with self:
            parent = self.parent_group
            full_id = parent.child_id(task_id) if parent is not None else task_id
            every, start, outcome = split_task_kwargs(task_kwargs)
            plan = make_plan(task_id=f"{full_id}.plan_shards", batch_task_id=full_id, output_type=output_type,
                             base_config=base, config_overrides=config_overrides, batch_mapped=mapped,
                             **plan_args, **every, **start)
            common = dict(pipeline_config=cfg.model_dump(mode="json"), **every)
            gpu = {**common, "pool": cfg.airflow.gpu_pool, "queue": cfg.airflow.gpu_queue,
                   "pool_slots": cfg.engine.tensor_parallel_size}
            land = dict(task_id=full_id, output_type=output_type, fail_on_partial_error=fail_on_partial_error,
                        **common, **outcome)
            model: GPUBatchModelOperator | MappedOperator  # one task, or one per batch (mapped)
            if not mapped:
                batch = XComArg(plan, key="batch")
                model = GPUBatchModelOperator(task_id=f"{full_id}.fetch_model", batch=batch, **common)
                shards = GPUBatchInferenceOperator.partial(task_id=f"{full_id}.batch_inference", model=model.output,
                                                           batch=batch, **gpu).expand(shard=plan.output)
                # all_done: it lands once every shard is done (a batch whose every request was refused has no
                # shard to run, and still lands), and is the batch's one outcome: it fails when an earlier task
                # failed, instead of being left upstream_failed where Airflow runs no callback.
                self.operator = GPUBatchLandOperator(
                    plan_task_id=plan.task_id, batch_task_ids=[plan.task_id, model.task_id, shards.task_id],
                    trigger_rule=TriggerRule.ALL_DONE, **land)
                plan >> model >> shards >> self.operator
            else:  # one batch per map index: plan, model and landing per batch, the shards of all of them together
                model = GPUBatchModelOperator.partial(task_id=f"{full_id}.fetch_model", **common).expand(
                    batch=XComArg(plan))
                collect = GPUBatchShardsOperator(task_id=f"{full_id}.shards", batches=XComArg(plan),
                                                 models=XComArg(model), **every)
                shards = GPUBatchInferenceOperator.partial(task_id=f"{full_id}.batch_inference", **gpu) \
                    .expand_kwargs(XComArg(collect))
                # none_failed, not all_done: the landings are expanded over the plans' results, and with every
                # plan failed an all_done expansion would be empty, i.e. skipped, and the run could succeed.
                self.operator = GPUBatchLandOperator.partial(trigger_rule=TriggerRule.NONE_FAILED, **land).expand(
                    batch=XComArg(plan))
                plan >> model >> collect >> shards >> self.operator
        self.plan = plan

    @property
    def task_id(self) -> str:
        """The landing task's id (``ti.xcom_pull(task_ids=batch.task_id)`` is the manifest)."""
        return self.operator.task_id

    @property
    def output(self) -> BatchXComArg:
        """The manifest, as ``LLMBatchOperator(...).output`` is."""
        return BatchXComArg(operator=self.operator, batch_roots=[self.plan])


# The arguments a mapped batch may expand: those of the plan task, which makes each batch. The rest (output_type,
# fail_on_partial_error, config, config_overrides, task arguments) is the same for every batch: .partial() only.
EXPANDABLE = ("requests", "input_path", "input_format", "result_path", "model_id", "system_prompt", "max_tokens",
              "request_params")


def _check_expanded(names: Sequence[str], partial: Mapping[str, Any]) -> None:
    if other := sorted(set(names) - set(EXPANDABLE)):
        raise TypeError(f"GPULLMBatchOperator: cannot expand {', '.join(other)}: a mapped GPU batch expands "
                        f"{', '.join(EXPANDABLE)}; the rest is the same for every batch (give it to .partial())")
    if twice := sorted(set(names) & set(partial)):
        raise TypeError(f"GPULLMBatchOperator: {', '.join(twice)} given to .partial() and expanded")


class GPULLMBatchPartial:
    """``GPULLMBatchOperator.partial(...)``: ``.expand(**lists)`` or ``.expand_kwargs(list of dicts)`` makes the
    mapped batch (a ``GPULLMBatchOperator``: ``.output``, ``>>`` as the unmapped one)."""

    def __init__(self, operator_class: type[GPULLMBatchOperator], kwargs: dict):
        self.operator_class, self.kwargs = operator_class, dict(kwargs)

    def expand(self, **mapped: Any) -> GPULLMBatchOperator:
        if not mapped:
            raise TypeError("no arguments to expand against")
        _check_expanded(list(mapped), self.kwargs)
        return self._mapped(set(mapped), lambda **kw: GPUBatchPlanOperator.partial(**kw).expand(**mapped))

    def expand_kwargs(self, kwargs: Any, *, strict: bool = True) -> GPULLMBatchOperator:
        names = {k for item in kwargs for k in item} if isinstance(kwargs, Sequence) and all(
            isinstance(item, Mapping) for item in kwargs) else set()  # an XComArg: checked when the plan runs
        _check_expanded(sorted(names), self.kwargs)
        return self._mapped(names, lambda **kw: GPUBatchPlanOperator.partial(**kw).expand_kwargs(kwargs, strict=strict))

    def _mapped(self, names: set[str], make_plan: Callable[..., Any]) -> GPULLMBatchOperator:
        kw = dict(self.kwargs)
        task_id = kw.pop("task_id")
        if "python_callable" in kw:
            raise TypeError("GPULLMBatchOperator.partial: map a decorated batch with @task.gpu_llm_batch's own "
                            ".partial()/.expand()")
        plan_args = {k: kw.pop(k) for k in EXPANDABLE if k in kw}
        if names and not (names | set(plan_args)) & {"requests", "input_path"}:  # names: empty for an XComArg
            raise TypeError("GPULLMBatchOperator: give requests or input_path (one of them)")
        op = self.operator_class.__new__(self.operator_class)
        known = {k: kw.pop(k) for k in ("output_type", "fail_on_partial_error", "config", "config_overrides")
                 if k in kw}
        op._build(task_id, plan_args, make_plan, mapped=True, task_kwargs=kw, **known)
        return op


class _GPULLMBatchDecorator:
    """What ``@task.gpu_llm_batch`` makes of a function: calling it adds the batch and returns the manifest;
    ``.partial(**fn_kwargs).expand(**fn_lists)`` / ``.expand_kwargs(...)`` add one batch per map index (the
    function's arguments are mapped, as with any ``@task``) and return the manifests."""

    def __init__(self, function: Callable, kwargs: dict, partial_kwargs: dict | None = None):
        self.function, self.kwargs, self.partial_kwargs = function, kwargs, dict(partial_kwargs or {})
        functools.update_wrapper(self, function)

    def override(self, **kwargs: Any) -> _GPULLMBatchDecorator:
        return _GPULLMBatchDecorator(self.function, {**self.kwargs, **kwargs}, self.partial_kwargs)

    def partial(self, **kwargs: Any) -> _GPULLMBatchDecorator:
        if twice := sorted(set(kwargs) & set(self.partial_kwargs)):
            raise TypeError(f"duplicate partial: {', '.join(twice)}")
        return _GPULLMBatchDecorator(self.function, self.kwargs, {**self.partial_kwargs, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> BatchXComArg:
        task_id = get_unique_task_id(self.kwargs.get("task_id") or self.function.__name__)
        return GPULLMBatchOperator(**{**self.kwargs, "task_id": task_id}, python_callable=self.function,
                                   op_args=args, op_kwargs={**self.partial_kwargs, **kwargs}).output

    def expand(self, **map_kwargs: Any) -> BatchXComArg:
        return self._mapped(lambda deco: deco.expand(**map_kwargs))

    def expand_kwargs(self, kwargs: Any, *, strict: bool = True) -> BatchXComArg:
        return self._mapped(lambda deco: deco.expand_kwargs(kwargs, strict=strict))

    def _mapped(self, expand: Callable[[Any], PlainXComArg]) -> BatchXComArg:  # a mapped call's XComArg has .operator
        kw = dict(self.kwargs)
        task_id = get_unique_task_id(kw.pop("task_id", None) or self.function.__name__)
        plan_args = {k: kw.pop(k) for k in EXPANDABLE if k in kw and k != "requests"}

        def make_plan(**plan_kwargs: Any) -> Any:  # Airflow's own @task mapping, on the plan task
            deco = task_decorator_factory(python_callable=self.function, multiple_outputs=False,
                                          decorated_operator_class=_GPUBatchDecoratedPlanOperator, **plan_kwargs)
            mapping = (deco.partial(**self.partial_kwargs)  # type: ignore[attr-defined]  # added to the decorator at run time
                       if self.partial_kwargs else deco)
            return expand(mapping).operator

        known = {k: kw.pop(k) for k in ("output_type", "fail_on_partial_error", "config", "config_overrides")
                 if k in kw}
        op = GPULLMBatchOperator.__new__(GPULLMBatchOperator)
        op._build(task_id, plan_args, make_plan, mapped=True, task_kwargs=kw, **known)
        return op.output


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
