"""The stages, one function each: the public facade of the stage library.

Each takes the pipeline config, the run's layout and the manifests of the stages before it, writes its
artifacts plus ``manifest.json`` under ``<run>/<stage>/``, and returns that manifest. The Airflow operators,
the CLI, the benchmarks and the tests all call these same functions::

    layout = RunLayout.for_run(cfg, run_id="manual__1", ds="2026-11-30")
    model = fetch(cfg, layout)
    model = quantize(cfg, layout, model)
    plan = plan_shards(cfg, layout)
    shards = [infer_shard(cfg, layout, model, s) for s in plan.shards]
    filtered = content_filter(cfg, layout, plan, shards)
    scores = evaluate(cfg, layout, plan, filtered)
    publish(cfg, layout, plan, filtered, scores)
"""
from __future__ import annotations

import datetime as dt
import heapq
import logging
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from batch_llm import plan as _plan
from batch_llm.config import PipelineConfig
from batch_llm.fetch import fetch_model
from batch_llm.formats import (
    FILE_SUFFIX,
    class_label_column,
    class_score_column,
    joined_outputs,
    openai_error_line,
    output_record,
    structured_column,
    write_rows,
)
from batch_llm.manifests import (
    SUMMARY,
    EvaluateManifest,
    FetchManifest,
    FilterManifest,
    FilterSummary,
    ModelRef,
    PlanManifest,
    PublishManifest,
    QuantizeManifest,
    RunManifests,
    RunSummary,
    ShardManifest,
    ShardResult,
    ShardSpec,
    TokenUsage,
)
from batch_llm.output_schema import OutputSchema
from batch_llm.recommend import fetch_fit_warning
from batch_llm.storage import (
    Location,
    atomic_writer,
    exists,
    iter_jsonl,
    list_files,
    peak_rss_mb,
    read_json,
    remove_tree,
    write_bytes_atomic,
    write_json,
    write_jsonl,
)


class EvaluationBelowThreshold(RuntimeError):
    """EvalScope's score is below ``evaluate.min_score``."""


@dataclass(frozen=True)
class RunLayout:
    """Where one run of one pipeline reads and writes."""

    output_root: Location      # output.path
    pipeline: str
    partition: str             # "dt=2026-11-30"
    run_id: str
    input: Location

    @classmethod
    def for_run(cls, cfg: PipelineConfig, *, run_id: str, ds: str | None = None,
                output_options: dict | None = None, input_options: dict | None = None) -> "RunLayout":
        ds = ds or dt.date.today().isoformat()
        return cls(output_root=Location(cfg.output.path, output_options or {}), pipeline=cfg.name,
                   partition=cfg.output.partition.format(ds=ds), run_id=run_id,
                   input=Location(cfg.input.path.format(ds=ds), input_options or {}))

    @property
    def pipeline_root(self) -> Location:
        return self.output_root.child(self.pipeline)

    @property
    def run_dir(self) -> Location:
        return self.pipeline_root.child("runs", self.partition, re.sub(r"[^A-Za-z0-9_.-]", "_", self.run_id))

    def stage(self, name: str) -> Location:
        return self.run_dir.child(name)

    @property
    def published(self) -> Location:
        return self.pipeline_root.child(self.partition)

    def cache_root(self, cfg: PipelineConfig) -> Location:
        if cfg.cache.path:
            return Location(cfg.cache.path, self.output_root.options)
        return self.output_root.child("_cache", "results")

    def to_dict(self) -> dict:
        return {"output_root": self.output_root.to_dict(), "pipeline": self.pipeline, "partition": self.partition,
                "run_id": self.run_id, "input": self.input.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "RunLayout":
        return cls(output_root=Location.from_any(d["output_root"]), pipeline=d["pipeline"],
                   partition=d["partition"], run_id=d["run_id"], input=Location.from_any(d["input"]))


STAGE_MANIFESTS = {"fetch": FetchManifest, "quantize": QuantizeManifest, "plan": PlanManifest,
                   "filter": FilterManifest, "evaluate": EvaluateManifest, "publish": PublishManifest}


def read_manifest_at(layout: RunLayout, stage: str):
    """The manifest a stage of this run committed (stages downstream go by it, not by XCom)."""
    return STAGE_MANIFESTS[stage].read(layout.stage(stage).path())


def shard_manifests(layout: RunLayout) -> list[ShardManifest]:
    """Every shard this run committed, by index (the publish task reads them from storage, not XCom)."""
    infer_dir = layout.stage("infer").path()
    found = (ShardManifest.read_if_done(d) for d in list_files(infer_dir))
    return sorted((m for m in found if m is not None), key=lambda m: m.shard)


# ------------------------------------------------------------------------------------------ stages
def fetch(cfg: PipelineConfig, layout: RunLayout, *, storage_options: dict | None = None,
          adapter_storage_options: dict | None = None) -> FetchManifest:
    """The model (and its LoRA adapter: merged into a new folder, or recorded for the engine to serve)."""
    t0 = time.perf_counter()
    m = fetch_model(cfg.model, storage_options=storage_options, adapter_storage_options=adapter_storage_options)
    m.seconds = round(time.perf_counter() - t0, 2)
    if warning := fetch_fit_warning(cfg, m.local_dir):  # a GPU worker whose GPUs cannot hold the model
        logging.getLogger("batch_llm.fetch").warning("%s", warning)
    m.write(layout.stage("fetch").path())
    return m


def quantize(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | dict) -> QuantizeManifest:
    """The W4A16 or FP8_DYNAMIC export when enabled (cached by model, revision, scheme and settings);
    otherwise the model as is."""
    ref = ModelRef.of(model)
    if not cfg.quantize.enabled:
        m = QuantizeManifest(id=ref.id, revision=ref.revision, local_dir=ref.local_dir, model_key=ref.model_key,
                             quantized=False, lora_dir=ref.lora_dir)
    else:
        from batch_llm.quantize import quantize_model

        q = quantize_model(ref.local_dir, cfg.quantize, model_key=ref.model_key)
        m = QuantizeManifest(id=ref.id, revision=ref.revision, local_dir=q["model_dir"], quantized=True,
                             quantization=q, model_key=f"{ref.model_key}+{Path(q['model_dir']).name}",
                             lora_dir=ref.lora_dir)
    m.write(layout.stage("quantize").path())
    return m


def plan_shards(cfg: PipelineConfig, layout: RunLayout) -> PlanManifest:
    return PlanManifest.read_if_done(layout.stage("plan").path()) or _plan.plan_shards(
        cfg, input_loc=layout.input, plan_dir=layout.stage("plan"))


def infer_shard(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                shard: ShardSpec | dict,
                say: Callable[[str], None] = print, started: dict | None = None,
                on_committed: Callable[[ShardManifest], None] | None = None) -> ShardManifest:
    """Runs one shard in this process (the GPU operator runs it in a spawned worker instead, which passes its
    own start times as ``started`` and reports from ``on_committed``, before the engine's shutdown)."""
    from batch_llm.infer import run_shard

    shard = ShardSpec.model_validate(shard)
    ref = ModelRef.of(model)
    return run_shard(cfg, shard=shard, shard_dir=layout.stage("infer").child(f"shard-{shard.index:05d}"),
                     model_dir=ref.local_dir, model_key=ref.model_key, lora_dir=ref.lora_dir,
                     cache_root=layout.cache_root(cfg), say=say, started=started, on_committed=on_committed)


def content_filter(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                   shards: list[ShardResult | ShardManifest | dict]) -> FilterManifest:
    """Merges the shards' outputs in input order (streamed) and applies the word lists; dropped rows go to
    ``dropped.jsonl`` (their ids and hits), so the manifest stays small whatever the run's size."""
    out_dir = layout.stage("filter")
    if m := FilterManifest.read_if_done(out_dir.path()):
        return m
    opts = layout.output_root.options
    results = [ShardResult.of(s) for s in shards]

    def merged(key: str) -> Iterator[dict]:
        # Each shard's files are in input order: a streamed merge puts the run in input order.
        return heapq.merge(*(iter_jsonl(Location(getattr(s, key), opts).path()) for s in results),
                           key=lambda r: r["idx"])

    skipped = f"task {cfg.engine.task}" if cfg.engine.task != "generate" else None  # vectors, classes: no words
    if cfg.filter.enabled and skipped is None:
        from batch_llm.content_filter import filter_rows  # pyahocorasick is not needed on GPU workers

        dropped_loc = out_dir.child("dropped.jsonl")
        with atomic_writer(dropped_loc.path()) as dropped:
            kept = filter_rows(merged("outputs"), cfg.filter, opts, dropped=dropped)
            n_kept = write_jsonl(out_dir.child("outputs.jsonl").path(), kept)
        summary = kept.summary(dropped=dropped_loc.url)
    else:
        n_kept = write_jsonl(out_dir.child("outputs.jsonl").path(), merged("outputs"))
        summary = FilterSummary(enabled=False, rows_scanned=n_kept)
    n_errors = write_jsonl(out_dir.child("errors.jsonl").path(), merged("errors"))
    m = FilterManifest(outputs=out_dir.child("outputs.jsonl").url, rows=n_kept,
                       inference_errors=out_dir.child("errors.jsonl").url, inference_error_rows=n_errors,
                       summary=summary, skipped=skipped)
    m.write(out_dir.path())
    return m


def evaluate(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest) -> EvaluateManifest:
    """Scores outputs against reference answers with EvalScope (a deterministic sample of
    ``evaluate.sample_rows`` rows); stores its report next to the run."""
    out_dir = layout.stage("evaluate")
    if not (m := EvaluateManifest.read_if_done(out_dir.path())):
        m = _evaluate(cfg, layout, plan, filtered, out_dir)
    score = m.metrics.get(cfg.evaluate.metric)
    if cfg.evaluate.enabled and cfg.evaluate.min_score is not None and score is not None \
            and score < cfg.evaluate.min_score:
        of = f" of {m.rows_with_references} rows with references" if m.sampled else ""
        raise EvaluationBelowThreshold(
            f"{cfg.evaluate.metric} = {score:.4f} is below evaluate.min_score = {cfg.evaluate.min_score} "
            f"({m.num_samples} samples{of}; report: {m.report_json})")
    return m


def _evaluate(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
              out_dir: Location) -> EvaluateManifest:
    opts = layout.output_root.options
    if cfg.engine.task != "generate":  # vectors, classes: no text to score against references
        m = EvaluateManifest(skipped=f"task {cfg.engine.task}")
    elif not cfg.evaluate.enabled:
        m = EvaluateManifest(skipped="evaluate.enabled is false")
    elif not plan.has_references:
        m = EvaluateManifest(skipped=f"no reference answers (column {cfg.input.reference_column!r})")
    else:
        from batch_llm.evaluate import sample_for_scoring, score_with_evalscope

        sample = sample_for_scoring(
            records=iter_jsonl(Location(plan.records, opts).path()),
            outputs=iter_jsonl(Location(filtered.outputs, opts).path()),
            shards=(iter_jsonl(Location(s.url, opts).path()) for s in plan.shards),
            size=cfg.evaluate.sample_rows, seed=cfg.evaluate.sample_seed)
        with tempfile.TemporaryDirectory(prefix="batch_llm_eval_") as tmp:
            t0 = time.perf_counter()
            res = score_with_evalscope(sample.records, Path(tmp), metric=cfg.evaluate.metric)
            seconds = time.perf_counter() - t0
            report_dir = out_dir.child("evalscope")
            uploaded = {}
            for key in ("report_json", "report_html"):
                if res.get(key):
                    src = Path(res[key])
                    # Not mkdir + write_bytes: on S3, mkdir(parents=True) creates a missing bucket.
                    write_bytes_atomic(report_dir.child(src.name).path(), src.read_bytes())
                    uploaded[key] = report_dir.child(src.name).url
        m = EvaluateManifest(metrics=res["metrics"], num_samples=res["num_samples"],
                             rows_with_references=sample.population, sample_seed=cfg.evaluate.sample_seed,
                             evalscope_version=res.get("evalscope_version"), seconds=round(seconds, 2),
                             report_json=uploaded.get("report_json"), report_html=uploaded.get("report_html"))
    m.write(out_dir.path())
    return m


def _publish_errors(plan: PlanManifest, filtered: FilterManifest, opts: dict) -> Iterator[dict]:
    """Every row that has no output, with its reason: the planner's (input order), then inference's. For
    OpenAI Batch input, as the lines of an OpenAI Batch error file."""
    errors = _row_errors(plan, filtered, opts)
    if plan.format != "openai_batch":
        yield from errors
        return
    for e in errors:
        where = f" ({e['source']} line {e['line']})" if e.get("source") else ""
        yield openai_error_line(e.get("id"), e["reason"] + where,
                                code="invalid_request" if e["stage"] == "plan" else "generation_failed")


def _row_errors(plan: PlanManifest, filtered: FilterManifest, opts: dict) -> Iterator[dict]:
    for e in iter_jsonl(Location(plan.errors, opts).path()):
        yield {**e, "stage": "plan"}
    for e in iter_jsonl(Location(filtered.inference_errors, opts).path()):
        yield {"id": e["id"], "reason": e["error"], "stage": "infer"}


def publish(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
            scores: EvaluateManifest, extra_manifests: dict | None = None) -> PublishManifest:
    """Writes the final dataset (input's format, streamed) and the run summary into a new version of the
    partition, then switches the partition's ``_CURRENT.json`` pointer to it: readers see the old or the new
    version, never a mix. Older versions but the previous one are removed. Last, the result cache's
    maintenance (retention, compaction) runs for the namespaces this pipeline writes."""
    out_dir = layout.stage("publish")
    if m := PublishManifest.read_if_done(out_dir.path()):
        return m
    t0 = time.perf_counter()
    opts = layout.output_root.options
    fmt = plan.format
    version = layout.published.child(f"v-{time.strftime('%Y%m%dT%H%M%S')}-{re.sub(r'[^A-Za-z0-9]', '', layout.run_id)[-12:]}")
    pairs = joined_outputs(iter_jsonl(Location(plan.records, opts).path()),
                           iter_jsonl(Location(filtered.outputs, opts).path()))
    data = version.child(f"data{FILE_SUFFIX[fmt]}")
    schema = OutputSchema(cfg.sampling.output_schema) if cfg.sampling.output_schema is not None else None
    n = write_rows(data.path(), (output_record(rec["record"], out, fmt, model=cfg.model.ref, schema=schema)
                                 for rec, out in pairs), fmt,
                   types=_structured_types(schema, plan, opts) or _embedding_types(filtered, fmt, opts)
                   or _class_types(cfg, plan, filtered, opts))
    n_errors = write_jsonl(version.child("errors.jsonl").path(), _publish_errors(plan, filtered, opts))
    manifests = RunManifests(plan=plan, filter=filtered, evaluate=scores, **(extra_manifests or {}))
    summary = RunSummary(
        pipeline=cfg.name, run_id=layout.run_id, partition=layout.partition, rows_published=n, format=fmt,
        dataset=data.url, errors=version.child("errors.jsonl").url, config=cfg.model_dump(mode="json"),
        manifests=manifests, published_at=dt.datetime.now(dt.timezone.utc),
        usage=TokenUsage.of_shards(manifests.shards), report=version.child("report.html").url)
    summary.write(version.path())
    from batch_llm.report import write_run_report  # matplotlib loads only here, not when DAGs are parsed

    report_url = write_run_report(summary, version, layout.pipeline_root)
    pointer = layout.published.child("_CURRENT.json")
    previous = read_json(pointer.path()).get("version") if exists(pointer.path()) else None
    write_json(pointer.path(), {"version": version.url, "dataset": data.url, "run_id": layout.run_id,
                                "rows": n, "committed_at": summary.published_at.isoformat(), "report": report_url})
    for old in list_files(layout.published.path()):
        if old.name.startswith("v-") and old.name not in (version.url.rsplit("/", 1)[-1],
                                                          (previous or "").rsplit("/", 1)[-1]):
            remove_tree(old)
    m = PublishManifest(partition=layout.published.url, version=version.url, dataset=data.url, rows=n,
                        summary=version.child(SUMMARY).url, errors=version.child("errors.jsonl").url,
                        error_rows=n_errors, report=report_url, usage=summary.usage, cache=maintain_cache(cfg, layout),
                        seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.write(out_dir.path())
    return m


def _structured_types(schema: OutputSchema | None, plan: PlanManifest, opts: dict) -> list | None:
    """The Parquet types of the output schema's columns (under the names ``output_record`` gives them)."""
    if schema is None or plan.format != "parquet":
        return None
    first = next(iter_jsonl(Location(plan.records, opts).path()), None)
    record = (first or {}).get("record") or {}
    return [f.with_name(structured_column(f.name, record)) for f in schema.arrow_fields()]


def _embedding_types(filtered: FilterManifest, fmt: str, opts: dict) -> list | None:
    """engine.task embed in Parquet: the vector as a fixed-size list of float32, its width the first
    output's (every vector of one model and run has the same width)."""
    if fmt != "parquet":
        return None
    first = next(iter_jsonl(Location(filtered.outputs, opts).path()), None)
    vec = (first or {}).get("embedding")
    if not isinstance(vec, list):
        return None
    import pyarrow as pa

    return [pa.field("embedding", pa.list_(pa.float32(), len(vec)))]


def _class_types(cfg: PipelineConfig, plan: PlanManifest, filtered: FilterManifest, opts: dict) -> list | None:
    """engine.task classify in Parquet: ``label`` a string and each class's ``score_<class>`` a float64, typed
    up front (a batch of error rows alone would have no value to infer them from); the classes are the first
    output's (one model and run: the same classes in every row)."""
    if cfg.engine.task != "classify" or plan.format != "parquet":
        return None
    first = next((r for r in iter_jsonl(Location(filtered.outputs, opts).path()) if r.get("scores")), None)
    if first is None:
        return None
    import pyarrow as pa

    rec = next(iter_jsonl(Location(plan.records, opts).path()), None)
    record = (rec or {}).get("record") or {}
    return [pa.field(class_label_column(record), pa.string()),
            *(pa.field(structured_column(class_score_column(c), record), pa.float64()) for c in first["scores"])]


def maintain_cache(cfg: PipelineConfig, layout: RunLayout) -> dict | None:
    """Retention and compaction of the result cache, once per run (a CPU task, not a GPU one): every
    namespace under the cache root, each cheap unless it is due (see ``result_cache.ResultCache.maintain``)."""
    if not cfg.cache.enabled:
        return None
    from batch_llm.result_cache import maintain_all

    return {"namespaces": maintain_all(layout.cache_root(cfg), max_age_days=cfg.cache.max_age_days,
                                       compact_after_tables=cfg.cache.compact_after_tables,
                                       max_runs=cfg.cache.max_runs)}
