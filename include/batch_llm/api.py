"""The stage library's facade: one function per stage, each delegating to the stage's own module under
``batch_llm.stages``. The Airflow operators, the CLI, the benchmarks and the tests call these::

    layout = RunLayout.for_run(cfg, run_id="manual__1", ds="2026-11-30")   # batch_llm.layout
    model = api.fetch(cfg, layout)
    model = api.quantize(cfg, layout, model)
    plan = api.plan_shards(cfg, layout)
    shards = [api.infer_shard(cfg, layout, model, s) for s in plan.shards]
    # or, one engine for k consecutive shards (sharding.shards_per_task):
    shards = [m for group in api.shard_tasks(cfg, plan) for m in api.infer_shards(cfg, layout, model, group)]
    filtered = api.content_filter(cfg, layout, plan, shards)
    scores = api.evaluate(cfg, layout, plan, filtered)
    api.publish(cfg, layout, plan, filtered, scores)

Each stage takes the pipeline config, the run's layout and what it needs of the stages before it, writes its
artifacts plus ``manifest.json`` under ``<run>/<stage>/``, and returns that manifest. Hand-off between stages
(the rule ``batch_llm.manifests`` states; the operators follow it): a stage's manifest lives in its run folder
in storage and is the record of what it did; between Airflow tasks XCom carries only a small typed reference
(``ModelRef``, the ``ShardSpec`` list (or one list per task: ``shard_tasks``), ``ShardResult``,
``PublishedRef``). A stage that needs more of an upstream stage than its reference reads the manifest from the
run folder (``batch_llm.layout.read_manifest_at``, ``shard_manifests``).

Nothing is implemented here: each function only names the stage's module, so a reader goes from here to the
code that acts. The stage modules import their heavy dependencies (vLLM, EvalScope, matplotlib) inside the
functions that need them, so importing this facade is cheap (DAG parsing does).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from batch_llm.stages import content_filter as _content_filter
from batch_llm.stages import evaluate as _evaluate
from batch_llm.stages import fetch as _fetch
from batch_llm.stages import plan_parts as _plan_parts
from batch_llm.stages import publish as _publish
from batch_llm.stages import quantize as _quantize
from batch_llm.stages import review as _review
from batch_llm.stages.infer import tasks as _infer_tasks

if TYPE_CHECKING:
    from batch_llm.config import PipelineConfig
    from batch_llm.layout import RunLayout
    from batch_llm.manifests import (
        EvaluateManifest,
        FetchManifest,
        FilterManifest,
        FilterPart,
        ModelRef,
        PlanManifest,
        PublishManifest,
        QuantizeManifest,
        ShardManifest,
        ShardResult,
        ShardSpec,
    )
    from batch_llm.stages.infer.runner import SharedEngine
    from batch_llm.stages.plan_parts import GroupJoin, JoinManifest, PartScan, PartsManifest, PartWrite

__all__ = ["content_filter", "evaluate", "fetch", "filter_shard", "infer_shard", "infer_shards", "join_filter",
           "maintain_cache", "plan_gather", "plan_join_group", "plan_parts",
           "plan_place", "plan_scan_part", "plan_shards", "plan_write_part",
           "publish", "quantize", "review_fetch", "review_shards", "shard_tasks"]


def fetch(cfg: PipelineConfig, layout: RunLayout, *, storage_options: dict | None = None,
          adapter_storage_options: dict | None = None) -> FetchManifest:
    """The model (and its LoRA adapter): ``batch_llm.stages.fetch``."""
    return _fetch.fetch(cfg, layout, storage_options=storage_options, adapter_storage_options=adapter_storage_options)


def quantize(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | dict) -> QuantizeManifest:
    """The AWQ W4A16 or FP8 export when enabled, else the model as is: ``batch_llm.stages.quantize``."""
    return _quantize.quantize(cfg, layout, model)


def plan_shards(cfg: PipelineConfig, layout: RunLayout) -> PlanManifest:
    """The run's plan (reused while its inputs are unchanged): ``batch_llm.stages.plan``, or with
    ``sharding.plan_part_bytes`` its steps in parts in turn (``batch_llm.stages.plan_parts.plan_day``)."""
    return _plan_parts.plan_day(cfg, layout)


def plan_parts(cfg: PipelineConfig, layout: RunLayout) -> PartsManifest:
    """A plan in parts (``sharding.plan_part_bytes``), its first step: the day's files grouped into parts:
    ``batch_llm.stages.plan_parts``. ``plan_shards`` runs all five steps in turn; a DAG maps them."""
    return _plan_parts.list_parts(cfg, layout)


def plan_scan_part(cfg: PipelineConfig, layout: RunLayout, part: int) -> PartScan:
    """One part of a plan in parts validated and spooled: ``batch_llm.stages.plan_parts``."""
    return _plan_parts.scan_part(cfg, layout, part)


def plan_join_group(cfg: PipelineConfig, layout: RunLayout, group: int) -> GroupJoin:
    """The duplicate ids among one group of hash buckets of every part: ``batch_llm.stages.plan_parts``."""
    return _plan_parts.join_group(cfg, layout, group)


def plan_place(cfg: PipelineConfig, layout: RunLayout) -> JoinManifest:
    """Each part's first row and shards, from the join's counts: ``batch_llm.stages.plan_parts``."""
    return _plan_parts.place_parts(cfg, layout)


def plan_write_part(cfg: PipelineConfig, layout: RunLayout, part: int) -> PartWrite:
    """One part's shards, records and errors: ``batch_llm.stages.plan_parts``."""
    return _plan_parts.write_part(cfg, layout, part)


def plan_gather(cfg: PipelineConfig, layout: RunLayout) -> PlanManifest:
    """The plan manifest of a plan in parts, from its parts' manifests: ``batch_llm.stages.plan_parts``."""
    return _plan_parts.gather_plan(cfg, layout)


def shard_tasks(cfg: PipelineConfig, plan: PlanManifest) -> list[list[ShardSpec]]:
    """The plan's shards grouped as the inference tasks run them: ``batch_llm.stages.infer.tasks``."""
    return _infer_tasks.shard_tasks(cfg, plan)


def infer_shard(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                shard: ShardSpec | dict, say: Callable[[str], None] = print, started: dict | None = None,
                on_committed: Callable[[ShardManifest], None] | None = None,
                shared_engine: SharedEngine | None = None, stage: str = "infer") -> ShardManifest:
    """One shard in this process: ``batch_llm.stages.infer.tasks``. The GPU operator runs shards in a worker of
    their own instead (``batch_llm.isolation``). ``stage``: review for a shard of the content review's pass."""
    return _infer_tasks.infer_shard(cfg, layout, model, shard, say=say, started=started, on_committed=on_committed,
                                    shared_engine=shared_engine, stage=stage)


def infer_shards(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                 shards: list[ShardSpec | dict], say: Callable[[str], None] = print, started: dict | None = None,
                 on_committed: Callable[[list[ShardManifest]], None] | None = None,
                 stage: str = "infer") -> list[ShardManifest]:
    """One task's shards on one engine: ``batch_llm.stages.infer.tasks``."""
    return _infer_tasks.infer_shards(cfg, layout, model, shards, say=say, started=started,
                                     on_committed=on_committed, stage=stage)


def review_fetch(cfg: PipelineConfig, layout: RunLayout, *, storage_options: dict | None = None) -> FetchManifest:
    """The content review's model (``filter.review.model``), fetched as the model is: ``batch_llm.stages.review``."""
    return _review.review_fetch(cfg, layout, storage_options=storage_options)


def review_shards(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | dict, plan: PlanManifest,
                  shards: Sequence[ShardResult | ShardManifest | dict | list],
                  say: Callable[[str], None] = print) -> list[ShardManifest]:
    """The content review's pass over the given shards in this process, on one engine (``filter.review``):
    ``batch_llm.stages.review``. The Airflow task runs it in an isolated worker instead."""
    return _review.review_shards(cfg, layout, model, plan, list(shards), say=say)


def content_filter(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                   shards: Sequence[ShardResult | ShardManifest | dict | list],
                   reviews: Sequence[ShardResult | ShardManifest | dict | list] | None = None) -> FilterManifest:
    """Every shard through the word lists, and with ``filter.review`` the review's verdicts (``reviews``: its
    shards' results), then the parts joined: ``batch_llm.stages.content_filter``."""
    return _content_filter.content_filter(cfg, layout, plan, shards, reviews)


def filter_shard(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, shard: ShardResult | ShardManifest | dict,
                 review: ShardResult | ShardManifest | dict | None = None) -> FilterPart:
    """One shard's part of the filter pass (its review's verdicts joined): ``batch_llm.stages.content_filter``."""
    return _content_filter.filter_shard(cfg, layout, plan, shard, review)


def join_filter(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                shards: Sequence[ShardResult | ShardManifest | dict | list],
                parts: Sequence[FilterPart | dict | list]) -> FilterManifest:
    """The run's filter pass from its shards' parts, by their counts: ``batch_llm.stages.content_filter``."""
    return _content_filter.join_filter(cfg, layout, plan, shards, parts)


def evaluate(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest) -> EvaluateManifest:
    """EvalScope's scores and the ``min_score`` gate: ``batch_llm.stages.evaluate``."""
    return _evaluate.evaluate(cfg, layout, plan, filtered)


def publish(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
            scores: EvaluateManifest, extra_manifests: dict | None = None, *,
            catalog_properties: dict[str, str] | None = None) -> PublishManifest:
    """A new version of the partition, made current, or with ``output.table`` the table's partition replaced in
    one commit (``catalog_properties``: the Iceberg catalog's connection): ``batch_llm.stages.publish``."""
    return _publish.publish(cfg, layout, plan, filtered, scores, extra_manifests=extra_manifests,
                            catalog_properties=catalog_properties)


def maintain_cache(cfg: PipelineConfig, layout: RunLayout) -> dict | None:
    """The result cache's retention and compaction, once per run: ``batch_llm.stages.publish``."""
    return _publish.maintain_cache(cfg, layout)
