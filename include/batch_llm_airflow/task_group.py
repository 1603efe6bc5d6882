"""The pipeline as a task group: drop it into a DAG of your own, with steps of your own around it.

    with DAG("my_dag", ...) as dag:
        redact = my_redaction_task()
        group = batch_llm_task_group(load_config("pipelines/daily.yaml"))
        notify = my_post_processing()
        redact >> group >> notify
"""
from __future__ import annotations

from typing import Any

from airflow.sdk import Asset, TaskGroup, TriggerRule
from batch_llm.config import ConfigDump, PipelineConfig
from batch_llm.stages.review import review_active

from batch_llm_airflow.operators import (
    BatchInferenceOperator,
    ContentFilterOperator,
    EvaluateOperator,
    FetchModelOperator,
    FetchReviewModelOperator,
    PlanJoinOperator,
    PlanPartsOperator,
    PlanPlaceOperator,
    PlanScanOperator,
    PlanShardsOperator,
    PlanWriteOperator,
    PublishOperator,
    QuantizeOperator,
    ReviewOperator,
    ShardFilterOperator,
)


def pipeline_asset(cfg: PipelineConfig) -> Asset:
    """The Asset a pipeline's publish task updates; schedule downstream DAGs on it."""
    root = cfg.output.path.rstrip("/")
    uri = f"{root}/{cfg.name}" if "://" in root else f"file://{root}/{cfg.name}"
    return Asset(name=f"batch_llm.{cfg.name}", uri=uri)


def shard_and_review(pair) -> dict:
    """A shard task's result and its review task's, as the arguments of its ``filter_shard`` task."""
    return {"shard": pair[0], "review": pair[1]}


def batch_llm_task_group(cfg: PipelineConfig, *, group_id: str = "batch_llm",
                         overrides: dict | None = None) -> TaskGroup:
    """fetch model → quantize → plan shards (with ``sharding.plan_part_bytes``: plan parts → plan scan × P → plan
    join × P → plan place → plan write × P → plan shards) → batch inference × N (→ review × N, with ``filter.review``) →
    filter shard × N → content filter (a join of counts) → evaluate → publish.

    ``overrides`` are dotted config keys applied at run time after the Params; their values are templated,
    so an upstream step can hand over e.g. ``{"input.path": "{{ ti.xcom_pull('redact') }}"}``.
    """
    # the arguments every operator of the group takes; the config's dump keeps the validated config for the
    # operators made in this process (a task's, which parses the DAG file): they do not validate it again
    common: dict[str, Any] = {"pipeline_config": ConfigDump(cfg), "config_overrides": overrides}
    with TaskGroup(group_id=group_id) as group:
        model = FetchModelOperator(task_id="fetch_model", **common)
        quantized = QuantizeOperator(task_id="quantize", model=model.output, **common)
        if cfg.sharding.plan_part_bytes is None:
            plan = PlanShardsOperator(task_id="plan_shards", **common)
        else:  # the plan mapped over parts of the input; plan_shards gathers their manifests
            listed = PlanPartsOperator(task_id="plan_parts", **common)
            scans = PlanScanOperator.partial(task_id="plan_scan", **common).expand(part=listed.output)
            # the join, one hash-bucket group of every part a task: after every scan
            joins = PlanJoinOperator.partial(task_id="plan_join", **common).expand(part=listed.output)
            placed = PlanPlaceOperator(task_id="plan_place", **common)
            writes = PlanWriteOperator.partial(task_id="plan_write", **common).expand(part=placed.output)
            plan = PlanShardsOperator(task_id="plan_shards", gather=True, **common)
            scans >> joins >> placed
            writes >> plan
        # One pool slot per GPU the shard's engine leases (tensor parallelism): a pool sized to the GPUs of the
        # workers admits only the shards that fit. Taken from the config the DAG was built with (the trigger
        # form's Params do not change tensor_parallel_size). A pool with fewer slots leaves the shard scheduled
        # forever (the scheduler logs "Requested pool slots ... are greater than total pool slots").
        shards = BatchInferenceOperator.partial(
            task_id="batch_inference", pool=cfg.airflow.gpu_pool, queue=cfg.airflow.gpu_queue,
            pool_slots=cfg.engine.tensor_parallel_size, model=quantized.output, **common,
        ).expand(shard=plan.output)
        reviews = None
        if review_active(cfg) and cfg.filter.review is not None:
            # The content review's pass: mapped over the shard tasks' results, a GPU task like the shards (its own
            # engine: the review model's; stages/review.py says why it is a task of its own)
            review_model = FetchReviewModelOperator(task_id="fetch_review_model", **common)
            reviews = ReviewOperator.partial(
                task_id="review", pool=cfg.airflow.gpu_pool, queue=cfg.airflow.gpu_queue,
                pool_slots=cfg.filter.review.engine.tensor_parallel_size, model=review_model.output, **common,
            ).expand(shard=shards.output)
        # The word lists (and the review's verdicts) per shard task, mapped beside the shards; the content filter
        # joins their counts and reads no row
        per_shard = ShardFilterOperator.partial(task_id="filter_shard", trigger_rule=TriggerRule.NONE_FAILED, **common)
        parts = (per_shard.expand_kwargs(shards.output.zip(reviews.output).map(shard_and_review))
                 if reviews is not None else per_shard.expand(shard=shards.output))
        filtered = ContentFilterOperator(task_id="content_filter", shards=shards.output, parts=parts.output,
                                         trigger_rule=TriggerRule.NONE_FAILED, **common)
        scores = EvaluateOperator(task_id="evaluate", **common)
        published = PublishOperator(task_id="publish", outlets=[pipeline_asset(cfg)], **common)
        filtered >> scores >> published
    return group
