"""Operators: one per stage, each a few lines over ``batch_llm.api``.

Every operator carries the pipeline's config (a dict, as parsed from YAML) and applies the run's Params on
top, so what a user changes in the trigger form reaches the stage through the same typed model. Hand-offs follow
the rule in ``batch_llm.manifests``: manifests live in the run folder in storage (a task reads an upstream
stage's manifest from there), XCom carries a small typed reference (``ModelRef``, the ``ShardSpec`` list,
``ShardResult``, ``PublishedRef``), and every operator builds its layout with ``RunLayout.for_run``.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, BaseOperatorLink, Context
from airflow.sdk.exceptions import AirflowFailException
from batch_llm import api
from batch_llm.analysis import metrics_push
from batch_llm.batch_api.runs import validate_batch
from batch_llm.batch_api.stop import StopReason
from batch_llm.config import ConfigDump, ConfigError, PipelineConfig, parse_config
from batch_llm.isolation.shard_process import IsolatedShard, ShardFailedNoRetry
from batch_llm.isolation.worker_log import EngineLog
from batch_llm.layout import RunLayout, read_manifest_at, shard_manifests
from batch_llm.manifests import ShardManifest
from batch_llm.stages.evaluate import EvaluationBelowThreshold

from batch_llm_airflow.batch_runs import batch_overrides, batch_store, run_watched
from batch_llm_airflow.hooks import BatchLlmStorageHook
from batch_llm_airflow.params import overrides_from_params
from batch_llm_airflow.storage_bridge import StorageTarget, split_conn, storage_errors
from batch_llm_airflow.table_catalog import catalog_properties


def run_date(context: Context) -> str:
    """The partition date: the logical date, or for API-triggered runs without one, the run's run_after."""
    dr = context["dag_run"]
    when = dr.logical_date or dr.run_after
    return when.date().isoformat()


def names_storage_errors(execute):
    """For a stage operator's ``execute``: refused credentials or a missing bucket or path fail naming the Airflow
    connection and the path (the targets ``resolve`` recorded), not as a bare ``PermissionError: Forbidden``."""
    @functools.wraps(execute)
    def wrapper(self, *args, **kwargs):
        with storage_errors(lambda: getattr(self, "_storage_targets", [])):
            return execute(self, *args, **kwargs)

    return wrapper


def fetch_storage_options(cfg: PipelineConfig) -> dict:
    """``api.fetch``'s storage keyword arguments: the model's and the LoRA adapter's connections."""
    lora = cfg.model.lora
    return {"storage_options": BatchLlmStorageHook(cfg.model.conn_id).storage_options(),
            "adapter_storage_options": BatchLlmStorageHook(lora.conn_id).storage_options() if lora else None}


class PipelineStageOperator(BaseOperator):
    """Base of the stage operators: resolves the config (YAML + Params) and the run's storage layout.

    Each stage's ``execute`` is decorated with ``names_storage_errors``."""

    template_fields: Sequence[str] = ("config_overrides",)
    ui_color = "#e8f0fe"
    reads_input = False  # the input location is among the suspects of a storage error (plan_shards)

    def __init__(self, *, pipeline_config: dict, config_overrides: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.pipeline_config = pipeline_config  # the config's JSON dump: a ConfigDump from the task group
        self.config_overrides = config_overrides or {}
        self._openai_batch: dict | None = None  # the OpenAI Batch API batch this run serves (resolve)

    @functools.cached_property
    def config(self) -> PipelineConfig:
        """The pipeline's config, validated once in this process: the task group's own (a ``ConfigDump`` keeps
        it), or the dump this operator was given, parsed here."""
        given = self.pipeline_config
        if isinstance(given, ConfigDump):
            return given.config
        return parse_config(given, f"pipeline {given.get('name')!r}")

    def resolve(self, context: Context) -> tuple[PipelineConfig, RunLayout]:
        base = self.config
        params = context.get("params") or {}
        # A run of the OpenAI Batch API (batch_runs.py): the batch's input file, its endpoint, its own partition
        try:
            batch, self._openai_batch = batch_overrides(params, self.dag_id)
        except ValueError as e:
            raise AirflowFailException(str(e)) from None
        if self._openai_batch is not None and base.openai_batch is None:
            raise AirflowFailException(f"params: a batch's run of {self.dag_id}, which has no openai_batch section")
        # the same config object where the run's Params and overrides change nothing
        cfg = base.with_overrides({**overrides_from_params(params, base), **batch, **self.config_overrides},
                                  source=f"params of {self.dag_id}")
        ds = run_date(context)
        out = BatchLlmStorageHook(cfg.output.conn_id).location(cfg.output.path)
        inp = BatchLlmStorageHook(cfg.input.conn_id).location(cfg.input.path.format(ds=ds))
        # One run folder per DAG run, whatever its retries and Clears: a cleared task finds its upstream's
        # committed manifests there, and a cleared shard its committed chunks. Whether a stage's committed work
        # still holds is decided by the stage (plan by its input's fingerprint, a shard by its plan and model).
        try:
            layout = RunLayout.for_run(cfg, run_id=context["run_id"], ds=ds, output_location=out, input_location=inp)
        except ConfigError as e:  # a DAG run id (REST API, trigger form) that cannot name a run folder: no retry
            raise AirflowFailException(str(e)) from None
        self._storage_targets = [StorageTarget(cfg.output.conn_id, out)] + (
            [StorageTarget(cfg.input.conn_id, inp, must_exist=True)] if self.reads_input else [])
        return cfg, layout


class FetchModelOperator(PipelineStageOperator):
    """Fetches the model (ModelScope with its cache, a local folder or an object-storage prefix) and checks it
    can be served. A folder missing files or a chat template fails without retries: a retry finds the same."""

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        from batch_llm.stages.fetch import ModelFolderIncomplete, NoChatTemplate
        from batch_llm.stages.lora import AdapterInvalid

        cfg, layout = self.resolve(context)
        try:
            m = api.fetch(cfg, layout, **fetch_storage_options(cfg))
        except (ModelFolderIncomplete, NoChatTemplate, AdapterInvalid) as e:
            raise AirflowFailException(str(e)) from None
        self.log.info("model %s resolved to %s (cache hit: %s, %.1f MB)", m.id, m.local_dir, m.cache_hit,
                      m.total_bytes / 1e6)
        return m.ref().model_dump(mode="json")  # XCom: the reference; the full manifest is in the run folder


class QuantizeOperator(PipelineStageOperator):
    """The quantize stage (config section ``quantize``): an llm-compressor export (AWQ W4A16 or FP8), cached; off,
    the fetched model passes through."""

    template_fields = (*PipelineStageOperator.template_fields, "model")

    def __init__(self, *, model: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.model = model

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        m = api.quantize(cfg, layout, self.model)
        self.log.info("quantize: %s", m.quantization or "disabled; serving the model as fetched")
        return m.ref().model_dump(mode="json")


def check_batch_input(op: PipelineStageOperator, cfg: PipelineConfig) -> None:
    """An OpenAI Batch API run's "validating": its input file checked before any row is planned."""
    if op._openai_batch is not None and cfg.openai_batch is not None:
        v = validate_batch(batch_store()[0], op._openai_batch, cfg.openai_batch, cfg.input.max_line_bytes)
        if v.errors:
            raise AirflowFailException(f"batch {op._openai_batch['id']}: the input file failed its check ("
                                       f"{v.error_count} error(s)): " + "; ".join(
                                           f"{e['code']}: {e['message']}" for e in v.errors[:5]))


class PlanShardsOperator(PipelineStageOperator):
    """The plan; with ``gather`` (a plan in parts, ``sharding.plan_part_bytes``) only its last step: the plan
    manifest from the parts the mapped ``plan_scan`` and ``plan_write`` tasks committed."""

    reads_input = True

    def __init__(self, *, gather: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.gather = gather

    @names_storage_errors
    def execute(self, context: Context) -> list:
        """Returns the shard list (index, rows, url): the batch inference task is mapped over it; with
        ``sharding.shards_per_task`` > 1, one list of consecutive shards per task (``api.shard_tasks``)."""
        cfg, layout = self.resolve(context)
        if self.gather:
            m = api.plan_gather(cfg, layout)
        else:
            check_batch_input(self, cfg)
            m = api.plan_shards(cfg, layout)
        tasks = api.shard_tasks(cfg, m)
        self.log.info("plan: %d rows read, %d valid, %d invalid (%s), %d shards in %.1fs, %d inference task(s)",
                      m.rows_read, m.valid, m.invalid, m.errors, len(m.shards), m.seconds, len(tasks))
        if cfg.sharding.shards_per_task == 1:
            return [s.ref() for s in m.shards]
        return [[s.ref() for s in t] for t in tasks]


class PlanPartsOperator(PipelineStageOperator):
    """A plan in parts, its first step: the day's files grouped into parts; returns the part numbers the
    ``plan_scan`` task is mapped over."""

    reads_input = True

    @names_storage_errors
    def execute(self, context: Context) -> list[int]:
        cfg, layout = self.resolve(context)
        check_batch_input(self, cfg)
        m = api.plan_parts(cfg, layout)
        self.log.info("plan: %d input files in %d parts of about %d bytes", m.input_files, len(m.parts),
                      cfg.sharding.plan_part_bytes)
        return [p.index for p in m.parts]


class MappedPlanOperator(PipelineStageOperator):
    """A mapped step of a plan in parts: ``part`` is its map value (a part; for the join, the hash-bucket group of
    the same number)."""

    template_fields = (*PipelineStageOperator.template_fields, "part")

    def __init__(self, *, part: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.part = part


class PlanScanOperator(MappedPlanOperator):
    """One part of a plan in parts validated and spooled."""

    reads_input = True

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        m = api.plan_scan_part(cfg, layout, int(self.part))
        self.log.info("plan part %d: %d rows read, %d spooled in %.1fs", m.part, m.rows_read, m.valid, m.seconds)
        return {"part": m.part, "rows_read": m.rows_read, "valid": m.valid}


class PlanJoinOperator(MappedPlanOperator):
    """A plan in parts: the duplicate ids among one group of hash buckets of every part."""

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        m = api.plan_join_group(cfg, layout, int(self.part))
        n = (m.part_starts or [0])[-1]
        self.log.info("plan join %d: %d ids, %d duplicates, in %.1fs", m.group, m.entries, n, m.seconds)
        return {"group": m.group, "entries": m.entries, "duplicates": n}


class PlanPlaceOperator(PipelineStageOperator):
    """A plan in parts: each part's first row and shards from the join's counts; returns the part numbers the
    ``plan_write`` task is mapped over."""

    @names_storage_errors
    def execute(self, context: Context) -> list[int]:
        cfg, layout = self.resolve(context)
        m = api.plan_place(cfg, layout)
        self.log.info("plan: %d duplicate ids across %d parts, %d shards", sum(p.duplicates for p in m.places),
                      len(m.places), sum(len(p.shard_rows) for p in m.places))
        return [p.part for p in m.places]


class PlanWriteOperator(MappedPlanOperator):
    """One part of a plan in parts: its shards, records and errors."""

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        m = api.plan_write_part(cfg, layout, int(self.part))
        self.log.info("plan part %d: shards %s, %d error rows, in %.1fs", m.part,
                      ", ".join(str(s.index) for s in m.shards) or "none", m.error_rows, m.seconds)
        return {"part": m.part, "shards": [s.index for s in m.shards], "error_rows": m.error_rows}


class BatchInferenceOperator(PipelineStageOperator):
    """Runs one shard on the configured engine in a spawned worker process of its own: one library call,
    ``batch_llm.isolation.shard_process.IsolatedShard`` (lease, worker, wait, release; the benchmarks run the same).
    ``shard`` a list (``sharding.shards_per_task`` > 1): the worker runs those shards in turn on one engine,
    and the task returns the list of their results.

    - The worker gets its own process group; ``on_kill`` (task marked failed, timeout, SIGTERM) ends the whole
      group and waits until it is gone, so the GPU is free before the task is reported finished.
    - On a GPU worker the task leases ``tensor_parallel_size`` GPUs (``CUDA_VISIBLE_DEVICES``); two tasks never
      share a GPU. Put it on the GPU queue and pool with ``.partial(queue=..., pool=...)``.
    - Outputs are committed in chunks; a retry resumes after the last committed chunk.
    - Too many error rows fail the task without retry; the message says how many and where they are.
    """

    template_fields = (*PipelineStageOperator.template_fields, "shard", "model")
    ui_color = "#fde2c8"
    # The GPU task marker: the Kubernetes cluster policy (batch_llm_airflow.policy) gives every task of this
    # class, and of every class built on it, a GPU pod.
    runs_on_gpu = True
    # Where in the pipeline config the engine this task runs is: the policy sizes the pod from its
    # tensor_parallel_size
    engine_section: tuple[str, ...] = ("engine",)

    def __init__(self, *, shard: Any, model: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.shard = shard
        self.model = model
        self._run: IsolatedShard | None = None

    @names_storage_errors
    def execute(self, context: Context) -> dict | list[dict]:
        cfg, layout = self.resolve(context)
        ti = context["ti"]
        self._run = IsolatedShard(cfg, layout, self.model, self.shard, holder=f"{ti.dag_id}.{ti.task_id}")
        try:  # lease → worker → manifests; lease released (a batch's run: stopped when cancelled or expired)
            manifests = run_watched(lambda: self._run_logged(context, layout), self._run.stop, self._openai_batch)
        except ShardFailedNoRetry as e:
            raise AirflowFailException(str(e)) from None
        if isinstance(manifests, StopReason):
            return self._stopped(layout, manifests)
        for i, m in enumerate(manifests):  # the task's one lease wait counts once
            emit_shard_metrics(cfg.name, m, gpu_lease_wait_seconds=0.0 if i else self._run.lease_wait_seconds)
        results = [m.result().model_dump(mode="json") for m in manifests]  # XCom: files and counts
        return results if self._run.group else results[0]

    def _run_logged(self, context: Context, layout: RunLayout) -> list[ShardManifest]:
        """The worker's run, its messages in the task log, the engine's output in an engine log of the run's
        (``<run>/logs/<task>-<map index>-try<n>.log``) and the engine's warnings in the task log as warnings."""
        assert self._run is not None
        ti = context["ti"]
        name = re.sub(r"[^\w.-]", "_", f"{ti.task_id}-{ti.map_index}-try{ti.try_number}")
        with EngineLog(layout.run_dir, name, warn=self.log.warning) as engine:
            self.log.info("engine output: %s", engine.url)
            try:
                return self._run.run_all(on_line=self.log.info, on_engine=engine, on_warning=self.log.warning)
            finally:
                self.log.info("engine output: %d lines (%d warnings, above; %d repeated) in %s", engine.lines,
                              engine.warnings, engine.repeats, engine.url)

    def _stopped(self, layout: RunLayout, reason: StopReason) -> dict | list[dict]:
        """A batch cancelled or expired (``batch_api.stop``): each shard committed with what it has, the rest of
        its rows error lines; the run goes on to publish them."""
        from batch_llm.batch_api.stop import close_stopped_shard

        shards = self.shard if isinstance(self.shard, list) else [self.shard]
        self.log.info("batch: %s; closing %d shard(s) with the rows they committed", reason.code, len(shards))
        results = [close_stopped_shard(layout, s, reason.code).result().model_dump(mode="json") for s in shards]
        return results if isinstance(self.shard, list) else results[0]

    def on_kill(self) -> None:
        if self._run is not None:
            self._run.stop()  # the worker's whole process group, then the lease


def emit_shard_metrics(pipeline: str, manifest: ShardManifest, *, gpu_lease_wait_seconds: float = 0.0,
                       run_id: str | None = None) -> bool:
    """Pushes the finished shard's counts and timings, and how long it waited for its GPUs, to the Prometheus
    Pushgateway named by ``BATCH_LLM_PUSHGATEWAY_URL`` (none: nothing is pushed), grouped by pipeline, run and
    shard. A failed push is a warning, never the task's failure. ``run_id``: the DAG run's (default: the running
    task's context). Not StatsD: Airflow's Stats carries Airflow's own metrics, the Pushgateway the shards'."""
    url = metrics_push.configured_url()
    if not url:
        return False
    if run_id is None:
        from airflow.sdk import get_current_context

        run_id = str(get_current_context()["run_id"])
    return metrics_push.push_manifest(pipeline, run_id, manifest, gpu_lease_wait_seconds=gpu_lease_wait_seconds,
                                      url=url)


class FetchReviewModelOperator(PipelineStageOperator):
    """Fetches the content review's model (``filter.review.model``) as ``FetchModelOperator`` fetches the model;
    its manifest in ``<run>/review/model/``. A folder missing files fails without retries."""

    @names_storage_errors
    def execute(self, context: Context) -> dict | None:
        from batch_llm.stages.fetch import ModelFolderIncomplete, NoChatTemplate
        from batch_llm.stages.review import review_active

        cfg, layout = self.resolve(context)
        if not review_active(cfg) or cfg.filter.review is None:  # turned off by the run's Params
            self.log.info("filter.review is off for this run: nothing to fetch")
            return None
        try:
            m = api.review_fetch(cfg, layout,
                                 storage_options=BatchLlmStorageHook(cfg.filter.review.model.conn_id).storage_options())
        except (ModelFolderIncomplete, NoChatTemplate) as e:
            raise AirflowFailException(f"filter.review.model: {e}") from None
        self.log.info("review model %s resolved to %s (cache hit: %s)", m.id, m.local_dir, m.cache_hit)
        return m.ref().model_dump(mode="json")


class ReviewOperator(BatchInferenceOperator):
    """The content review's pass over one shard task's outputs (``filter.review``, ``batch_llm.stages.review``):
    builds the review requests from the shard's outputs, then runs them as ``BatchInferenceOperator`` runs a shard
    (lease, isolated worker, chunk commits, resume; the review model's engine), committed under
    ``<run>/review/``. Mapped over the shard tasks' results; returns the review shards' results."""

    engine_section = ("filter", "review", "engine")  # the review model's engine, not the pipeline's

    @names_storage_errors
    def execute(self, context: Context) -> dict | list[dict] | None:
        from batch_llm.stages.review import flat_results, prepare_review, review_active, review_pipeline_config

        cfg, layout = self.resolve(context)
        if not review_active(cfg):  # turned off by the run's Params: the content filter joins no verdicts
            self.log.info("filter.review is off for this run: nothing to review")
            return None
        group = isinstance(self.shard, list)
        plan = read_manifest_at(layout, "plan")
        specs = [prepare_review(cfg, layout, plan, s) for s in flat_results(self.shard if group else [self.shard])]
        ti = context["ti"]
        self._run = IsolatedShard(review_pipeline_config(cfg), layout, self.model,
                                  [s.model_dump() for s in specs] if group else specs[0].model_dump(),
                                  holder=f"{ti.dag_id}.{ti.task_id}", stage="review")
        try:
            manifests = self._run_logged(context, layout)
        except ShardFailedNoRetry as e:
            raise AirflowFailException(f"review: {e}") from None
        results = [m.result().model_dump(mode="json") for m in manifests]
        return results if group else results[0]


class ShardFilterOperator(PipelineStageOperator):
    """One shard task's rows through the word lists, and with ``filter.review`` its review's verdicts
    (``api.filter_shard``), mapped over the shard tasks: a Clear of one shard's filter redoes that shard alone.
    ``shard``: the shard task's result (a list for a task of several shards); ``review``: its review task's."""

    template_fields = (*PipelineStageOperator.template_fields, "shard", "review")

    def __init__(self, *, shard: Any, review: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.shard = shard
        self.review = review

    @names_storage_errors
    def execute(self, context: Context) -> dict | list[dict]:
        from batch_llm.stages.review import flat_results

        cfg, layout = self.resolve(context)
        plan = read_manifest_at(layout, "plan")
        group = isinstance(self.shard, list)
        reviews = {r.shard: r for r in flat_results(self.review if isinstance(self.review, list) else [self.review])
                   if r is not None} if self.review is not None else {}
        parts = []
        for shard in flat_results(self.shard if group else [self.shard]):
            p = api.filter_shard(cfg, layout, plan, shard, reviews.get(shard.shard))
            s = p.summary
            self.log.info("filter shard %d: %d rows scanned, %d affected, %d dropped; hits per list %s", p.shard,
                          s.rows_scanned, s.rows_affected, s.rows_dropped, s.hits_per_list)
            parts.append(p.model_dump(mode="json"))
        return parts if group else parts[0]  # XCom: the part (counts and locations) the join adds up


class ContentFilterOperator(PipelineStageOperator):
    """The run's filter pass: the shards' filter parts joined by their counts (``api.join_filter``), no row read."""

    template_fields = (*PipelineStageOperator.template_fields, "shards", "parts")

    def __init__(self, *, shards: Any, parts: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.shards = shards
        self.parts = parts  # the filter_shard tasks' results

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        plan = read_manifest_at(layout, "plan")
        m = api.join_filter(cfg, layout, plan, list(self.shards), list(self.parts))
        s = m.summary
        self.log.info("filter: %s rows scanned, %s affected, %s dropped; hits per list %s", s.rows_scanned,
                      s.rows_affected, s.rows_dropped, s.hits_per_list)
        if s.review is not None:
            self.log.info("review: %s rows reviewed, verdicts %s, categories %s, %s dropped", s.review.rows_reviewed,
                          s.review.verdicts, s.review.categories, s.review.rows_dropped)
        return m.model_dump(include={"rows", "inference_error_rows"})  # XCom tab only


class EvaluateOperator(PipelineStageOperator):
    """The evaluate stage (config section ``evaluate``): EvalScope's scores; ``evaluate.min_score`` fails the run."""

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        try:
            m = api.evaluate(cfg, layout, read_manifest_at(layout, "plan"),
                                read_manifest_at(layout, "filter"))
        except EvaluationBelowThreshold as e:
            raise AirflowFailException(str(e)) from None
        self.log.info("evaluate: %s%s", m.skipped or m.metrics,
                      f" (a sample of {m.num_samples} of {m.rows_with_references} rows)" if m.sampled else "")
        return m.model_dump(include={"metrics", "num_samples", "rows_with_references", "report_json", "skipped"})  # XCom tab only


class RunReportLink(BaseOperatorLink):
    """"Run report" button on the publish task: opens the run's HTML report through the plugin."""

    name = "Run report"

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        from batch_llm_airflow.report_app import report_href

        value = XCom.get_value(ti_key=ti_key, key="return_value") or {}
        report = value.get("report") if isinstance(value, dict) else None
        out = (getattr(operator, "pipeline_config", None) or {}).get("output") or {}
        conn_id = out.get("conn_id") or split_conn(str(out.get("path") or ""))[1]
        return report_href(report, conn_id) if report else ""  # /batch-llm/report?path=<quoted url>


class PublishOperator(PipelineStageOperator):
    """Publishes the run's rows as a new version of the dataset, its summary and report; an Asset event
    for each outlet, and OpenLineage datasets (input table, model, published dataset) when the OpenLineage
    provider is installed."""

    operator_extra_links = (RunReportLink(),)
    ui_color = "#d5f5e3"

    @names_storage_errors
    def execute(self, context: Context) -> dict:
        cfg, layout = self.resolve(context)
        get = lambda s: read_manifest_at(layout, s)  # noqa: E731
        fetched = get("fetch")
        m = api.publish(cfg, layout, get("plan"), get("filter"), get("evaluate"),
                           extra_manifests={"fetch": fetched, "quantize": get("quantize"),
                                            "infer": shard_manifests(layout)},
                           catalog_properties=catalog_properties(cfg))
        self.log.info("published %d rows to %s", m.rows, m.version if m.table else m.dataset)
        if self._openai_batch is not None:  # the batch's output and error files, from the published lines
            from batch_llm.batch_api.results import publish_files

            files = publish_files(batch_store()[0], self._openai_batch, m, layout.output_root.options)
            self.log.info("batch %s: output file %s, error file %s", self._openai_batch["id"], files["output_file_id"],
                          files["error_file_id"])
        self._lineage_of_run = (cfg, layout, m, fetched)  # read by get_openlineage_facets_on_complete
        # with output.table, the snapshot that holds the day: what a consumer pins its read to
        table = {"table_format": m.table["format"], "snapshot_id": m.table["snapshot_id"]} if m.table else {}
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = {"partition": layout.partition, "dataset": m.dataset,
                                                      "rows": m.rows, "run_id": layout.run_id, **table}
        return m.ref().model_dump(mode="json")  # XCom: the published version; the manifest is in the run folder

    def get_openlineage_facets_on_complete(self, task_instance):
        """Called by the OpenLineage listener after ``execute``, in the same process."""
        from batch_llm_airflow.lineage import publish_lineage

        return publish_lineage(*self._lineage_of_run)
