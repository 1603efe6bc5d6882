"""The stages, one function each: the public facade of the stage library.

Each takes the pipeline config, the run's layout and what it needs of the stages before it, writes its
artifacts plus ``manifest.json`` under ``<run>/<stage>/``, and returns that manifest. The Airflow operators,
the CLI, the benchmarks and the tests all call these same functions::

    layout = RunLayout.for_run(cfg, run_id="manual__1", ds="2026-11-30")
    model = fetch(cfg, layout)
    model = quantize(cfg, layout, model)
    plan = plan_shards(cfg, layout)
    shards = [infer_shard(cfg, layout, model, s) for s in plan.shards]
    # or, one engine for k consecutive shards (sharding.shards_per_task):
    shards = [m for group in shard_tasks(cfg, plan) for m in infer_shards(cfg, layout, model, group)]
    filtered = content_filter(cfg, layout, plan, shards)
    scores = evaluate(cfg, layout, plan, filtered)
    publish(cfg, layout, plan, filtered, scores)

Hand-off between stages (the rule ``batch_llm.manifests`` states; the operators follow it): a stage's manifest
lives in its run folder in storage and is the record of what it did; between Airflow tasks XCom carries only a
small typed reference (``ModelRef``, the ``ShardSpec`` list (or, with ``sharding.shards_per_task`` > 1, one
list of ``ShardSpec`` per task: ``shard_tasks``), ``ShardResult`` (a list of them from a task of several
shards), ``PublishedRef``). A stage that
needs more of an upstream stage than its reference reads the manifest from the run folder
(``read_manifest_at``, ``shard_manifests``). Every caller builds the run's layout with ``RunLayout.for_run``.
"""
from __future__ import annotations

import datetime as dt
import heapq
import logging
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batch_llm import path_policy
from batch_llm import plan as _plan
from batch_llm.config import ConfigError, PipelineConfig
from batch_llm.current_pointer import PointerState, read_pointer, switch_pointer
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
    RowAccounting,
    RunManifests,
    RunSummary,
    ShardManifest,
    ShardResult,
    ShardSpec,
    TokenUsage,
)
from batch_llm.output_schema import OutputSchema
from batch_llm.retention import Partition, new_version_name, tidy_partition
from batch_llm.sizing_inputs import fetch_fit_warning
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

if TYPE_CHECKING:
    from upath import UPath

    from batch_llm.infer import SharedEngine


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
                output_options: dict | None = None, input_options: dict | None = None,
                output_location: Location | None = None, input_location: Location | None = None) -> "RunLayout":
        """The layout of one run of ``cfg``: the one place a pipeline run's layout is built (operators, CLI,
        benchmarks, tests). ``ds`` fills ``{ds}`` of the partition and the input path (default: today).
        ``output_location`` / ``input_location``: the locations already resolved (the operators' storage hook,
        with the connection's credentials: ``cfg.output.path`` and ``cfg.input.path`` with ``{ds}`` filled);
        otherwise they are made from the config's paths and ``*_options``."""
        ds = ds or dt.date.today().isoformat()
        partition = cfg.output.partition.format(ds=ds)
        if problem := path_policy.partition_problem(partition):  # a ds of "../x" would fill it out of the pipeline
            raise ConfigError(f"output.partition {cfg.output.partition!r} with ds {ds!r}: {problem}")
        return cls(output_root=output_location or Location(cfg.output.path, output_options or {}),
                   pipeline=cfg.name, partition=partition, run_id=run_id,
                   input=input_location or Location(cfg.input.path.format(ds=ds), input_options or {}))

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
    """The manifest a stage of this run committed: what a later stage reads of it (XCom carries references)."""
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
    """The run's plan: the committed one while the input files and the settings it was made from are unchanged
    (a retry, a Clear), else a new one (a Clear after late files landed or a file was fixed); its shards carry
    its key, so chunks committed for an earlier plan are not resumed."""
    key = plan_input_key(cfg, layout.input)
    done = PlanManifest.read_if_done(layout.stage("plan").path())
    if done is not None and done.input_key == key:
        return done
    if done is not None:
        logging.getLogger("batch_llm.plan").info("the input or the plan's settings changed since the run's last "
                                                 "plan: planning again")
    return _plan.plan_shards(cfg, input_loc=layout.input, plan_dir=layout.stage("plan"), input_key=key)


def plan_input_key(cfg: PipelineConfig, input_loc: Location) -> str:
    """What a plan is made from: the input files' fingerprints and every setting the planner reads."""
    from batch_llm.formats import input_files
    from batch_llm.identity import files_key, stable_hash

    settings = cfg.model_dump(mode="json", include={"input", "sharding", "sampling"})
    settings["sharding"].pop("shards_per_task", None)  # how shards are run, not what they hold
    return stable_hash({"files": files_key(input_files(input_loc.path())), "settings": settings,
                        "task": cfg.engine.task})


def shard_inputs(cfg: PipelineConfig, ref: ModelRef, shard: ShardSpec) -> dict[str, str]:
    """What a shard's committed chunks are made from, part by part (short hashes): its plan and everything that
    changes an output (``infer.output_identity``, which the result cache's namespace hashes too)."""
    from batch_llm.identity import identity_parts, stable_hash
    from batch_llm.infer import output_identity

    return {"plan": stable_hash([shard.plan_key, shard.index, shard.rows])[:16],
            **identity_parts(output_identity(cfg, model_key=ref.model_key, model_dir=ref.local_dir))}


def shard_input_key(cfg: PipelineConfig, ref: ModelRef, shard: ShardSpec) -> str:
    """One key for ``shard_inputs``: the same while the shard's committed chunks hold."""
    from batch_llm.identity import stable_hash

    return stable_hash(shard_inputs(cfg, ref, shard))


def _drop_stale_shard(shard_dir: Location, inputs: dict[str, str], say: Callable[[str], None] = print) -> None:
    """Removes what the shard folder holds when it was made from other inputs (``shard_inputs``: the plan, the
    model, a setting that changes an output), saying which, then records the inputs it is now for (and why it
    started over) in ``inputs.json``. Chunks of the same inputs are kept: the shard resumes."""
    from batch_llm.identity import stable_hash, what_changed

    key = stable_hash(inputs)
    marker = shard_dir.child("inputs.json").path()
    before = read_json(marker) if exists(marker) else {}
    if before.get("key") == key:
        return
    record: dict = {"key": key, "parts": inputs}
    if list_files(shard_dir.path()):
        why = what_changed(before["parts"], inputs) if "parts" in before else "its inputs were not recorded by part"
        say(f"{shard_dir.url} was made from other inputs ({why}): starting it over")
        logging.getLogger("batch_llm.infer").info("%s was made from other inputs (%s): starting it over",
                                                  shard_dir.url, why)
        remove_tree(shard_dir.path())
        record["started_over"] = why
    write_json(marker, record)


def shard_tasks(cfg: PipelineConfig, plan: PlanManifest) -> list[list[ShardSpec]]:
    """The plan's shards as the inference tasks run them: ``sharding.shards_per_task`` consecutive shards a
    task (the last task may have fewer), each task one engine (``infer_shards``)."""
    k = cfg.sharding.shards_per_task
    return [plan.shards[i:i + k] for i in range(0, len(plan.shards), k)]


def infer_shards(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                 shards: list[ShardSpec | dict], say: Callable[[str], None] = print, started: dict | None = None,
                 on_committed: Callable[[list[ShardManifest]], None] | None = None) -> list[ShardManifest]:
    """Runs one task's shards in turn on one engine (``infer.SharedEngine``): the first shard that generates
    starts it, the others use it, and it is closed after the last. Each shard keeps its own folder, chunk
    commits and manifest, so a retry skips the shards already committed and resumes the one that was cut
    short. ``on_committed`` is called with every shard's manifest once the last one is durable (the worker
    reports there and ends the engine's processes itself); ``started`` (the worker's clock) goes to the
    first shard's timeline. One shard: ``infer_shard`` as it is.

    A shard with too many error rows (``ShardFailed``: its outputs, errors and manifest are written) does not stop
    the task's other shards: they run and commit, then the task fails naming the failed shards, as separate
    tasks would have (a re-run with a higher ``engine.max_error_rate`` takes every committed shard as it is)."""
    from batch_llm.infer import ShardFailed, SharedEngine

    specs = [ShardSpec.model_validate(s) for s in shards]
    if len(specs) == 1:
        last = (lambda m: on_committed([m])) if on_committed is not None else None
        return [infer_shard(cfg, layout, model, specs[0], say=say, started=started, on_committed=last)]
    engine = SharedEngine()
    done: list[ShardManifest] = []
    failed: list[str] = []
    try:
        for i, spec in enumerate(specs):
            last = None
            if on_committed is not None and i == len(specs) - 1 and not failed:  # reported only if all passed
                last = lambda m: on_committed([*done, m])  # noqa: E731
            try:
                done.append(infer_shard(cfg, layout, model, spec, say=say, started=started if i == 0 else None,
                                        on_committed=last, shared_engine=engine))
            except ShardFailed as e:
                failed.append(str(e))
                say(f"{e}; the task's other shards go on")
    finally:
        engine.close()
    say(f"{len(specs)} shards on one engine: started {engine.starts} time(s)")
    if failed:
        raise ShardFailed(f"{len(failed)} of {len(specs)} shards of this task failed (the others committed): "
                          + " | ".join(failed))
    return done


def infer_shard(cfg: PipelineConfig, layout: RunLayout, model: ModelRef | FetchManifest | QuantizeManifest | dict,
                shard: ShardSpec | dict,
                say: Callable[[str], None] = print, started: dict | None = None,
                on_committed: Callable[[ShardManifest], None] | None = None,
                shared_engine: "SharedEngine | None" = None) -> ShardManifest:
    """Runs one shard in this process (the GPU operator runs it in a spawned worker instead, which passes its
    own start times as ``started`` and reports from ``on_committed``, before the engine's shutdown).
    ``shared_engine``: the ``infer.SharedEngine`` of the task's shards (``infer_shards``)."""
    from batch_llm.infer import run_shard

    shard = ShardSpec.model_validate(shard)
    ref = ModelRef.of(model)
    shard_dir = layout.stage("infer").child(f"shard-{shard.index:05d}")
    _drop_stale_shard(shard_dir, shard_inputs(cfg, ref, shard), say)
    return run_shard(cfg, shard=shard, shard_dir=shard_dir,
                     model_dir=ref.local_dir, model_key=ref.model_key, lora_dir=ref.lora_dir,
                     cache_root=layout.cache_root(cfg), say=say, started=started, on_committed=on_committed,
                     shared_engine=shared_engine)


def content_filter(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                   shards: Sequence[ShardResult | ShardManifest | dict | list]) -> FilterManifest:
    """Merges the shards' outputs in input order (streamed) and applies the word lists; dropped rows go to
    ``dropped.jsonl`` (their ids and hits), so the manifest stays small whatever the run's size.

    Done again each time it runs (a retry or a Clear: the word lists may have changed); each pass is a new
    ``generation``, which evaluate and publish go by. ``shards``: one result per shard, or, from tasks of
    several shards (``sharding.shards_per_task``), one list of results per task."""
    out_dir = layout.stage("filter")
    opts = layout.output_root.options
    results = [ShardResult.of(s) for t in shards for s in (t if isinstance(t, (list, tuple)) else [t])]
    check_shards_of_plan(plan, results)

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
    m = FilterManifest(outputs=out_dir.child("outputs.jsonl").url, rows=n_kept, plan_key=plan.input_key,
                       inference_errors=out_dir.child("errors.jsonl").url, inference_error_rows=n_errors,
                       summary=summary, skipped=skipped)
    m.write(out_dir.path())
    return m


def check_shards_of_plan(plan: PlanManifest, shards: list[ShardResult]) -> None:
    """Every planned shard committed, for this plan (a plan made again after its shards ran has other rows)."""
    got = {s.shard: s for s in shards}
    missing = [s.index for s in plan.shards if s.index not in got]
    stale = [s.shard for s in shards if s.plan_key and plan.input_key and s.plan_key != plan.input_key[:16]]
    if missing or stale:
        raise ValueError(f"the shards handed over do not match the run's plan ({len(plan.shards)} shards): "
                         f"missing {missing or 'none'}, made for another plan {stale or 'none'}; clear the plan "
                         f"task with its downstream tasks so that every shard runs on the current plan")


def evaluate(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest) -> EvaluateManifest:
    """Scores outputs against reference answers with EvalScope (a deterministic sample of
    ``evaluate.sample_rows`` rows); stores its report next to the run."""
    out_dir = layout.stage("evaluate")
    m = EvaluateManifest.read_if_done(out_dir.path())
    if m is None or m.filter_generation != filtered.generation:  # scored on another pass of the filter
        m = _evaluate(cfg, layout, plan, filtered, out_dir)
    ev = cfg.evaluate
    if not ev.enabled or ev.min_score is None or m.skipped:  # a skipped evaluation names why in its manifest
        return m
    from batch_llm.evaluate import MetricNotScored, metric_score

    score = metric_score(m.metrics, ev.metric)
    if score is None:  # the gate fails closed: a metric it cannot find is not a pass
        raise MetricNotScored(
            f"evaluate.min_score = {ev.min_score} applies to {ev.metric}, which the scores do not hold "
            f"(found: {', '.join(sorted(m.metrics)) or 'none'}; report: {m.report_json})")
    if score < ev.min_score:
        of = f" of {m.rows_with_references} rows with references" if m.sampled else ""
        raise EvaluationBelowThreshold(
            f"{ev.metric} = {score:.4f} is below evaluate.min_score = {ev.min_score} "
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
    m.filter_generation = filtered.generation
    m.write(out_dir.path())
    return m


def _publish_errors(plan: PlanManifest, filtered: FilterManifest, opts: dict) -> Iterator[dict]:
    """Every row that has no output, with its stage and reason: the planner's (input order), inference's, then
    the rows the content filter dropped. For OpenAI Batch input, as the lines of an OpenAI Batch error file."""
    errors = _row_errors(plan, filtered, opts)
    if plan.format != "openai_batch":
        yield from errors
        return
    codes = {"plan": "invalid_request", "infer": "generation_failed", "content_filter": "content_filter"}
    for e in errors:
        where = f" ({e['source']} line {e['line']})" if e.get("source") else ""
        yield openai_error_line(e.get("id"), e["reason"] + where, code=codes[e["stage"]])


def _row_errors(plan: PlanManifest, filtered: FilterManifest, opts: dict) -> Iterator[dict]:
    for e in iter_jsonl(Location(plan.errors, opts).path()):
        yield {**e, "stage": "plan"}
    for e in iter_jsonl(Location(filtered.inference_errors, opts).path()):
        yield {"id": e["id"], "reason": e["error"], "stage": "infer"}
    if filtered.summary.dropped:
        for d in iter_jsonl(Location(filtered.summary.dropped, opts).path()):
            words = ", ".join(sorted({f"{h['word']!r} ({h['list']})" for h in d.get("hits") or []}))
            yield {"id": d["id"], "reason": f"dropped by the content filter: {words}", "stage": "content_filter"}


def _version_name(run_id: str) -> str:
    """A new version's folder name (``retention.VERSION_NAME``: retention deletes no other)."""
    return new_version_name(run_id)


def publish(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
            scores: EvaluateManifest, extra_manifests: dict | None = None) -> PublishManifest:
    """Writes the final dataset (input's format, streamed), its errors and the run summary into a new version
    of the partition, then switches the partition's ``_CURRENT.json`` to it with a compare-and-swap
    (``current_pointer``): readers see the old or the new version, never a mix, and of two runs of one day
    publishing at once the last to finish is current. The version it replaced is kept; the one before that is
    removed, and so are orphans of killed publishers older than ``output.orphan_grace_hours``, each only when
    proven a version of this partition (``retention``: its marker, name and place).

    A publish of a filter pass already published (a retry after the switch) returns that publish. Last, the
    result cache's maintenance runs; it never fails a run whose data is published."""
    out_dir = layout.stage("publish")
    opts = layout.output_root.options
    done = PublishManifest.read_if_done(out_dir.path())
    if done is not None and done.filter_generation == filtered.generation \
            and exists(Location(done.version, opts).child(SUMMARY).path()):
        return done
    t0 = time.perf_counter()
    fmt = plan.format
    part = Partition(layout.published, layout.pipeline, layout.partition)
    version = layout.published.child(_version_name(layout.run_id))
    part.write_marker(version, layout.run_id)  # first: the proof retention asks for before it deletes a version
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
        usage=TokenUsage.of_shards(manifests.shards), report=version.child("report.html").url,
        rows=RowAccounting.of_run(plan, filtered, published=n, error_lines=n_errors))
    summary.write(version.path())
    from batch_llm.report import write_run_report  # matplotlib loads only here, not when DAGs are parsed

    report_url = write_run_report(summary, version, layout.pipeline_root)

    def new_pointer(replacing: PointerState) -> dict:
        return {"version": version.url, "dataset": data.url, "run_id": layout.run_id, "rows": n,
                "committed_at": summary.published_at.isoformat(), "report": report_url, "seq": replacing.seq + 1,
                "history": [replacing.version] if replacing.version not in (None, version.url) else []}

    pointer = layout.published.child("_CURRENT.json").path()
    replaced, _ = switch_pointer(pointer, new_pointer, before_write=lambda _: part.require(version))
    _retire_versions(part, pointer, own=version.url, retire=replaced.history,
                     grace_s=cfg.output.orphan_grace_hours * 3600)
    m = PublishManifest(partition=layout.published.url, version=version.url, dataset=data.url, rows=n,
                        summary=version.child(SUMMARY).url, errors=version.child("errors.jsonl").url,
                        error_rows=n_errors, report=report_url, usage=summary.usage,
                        filter_generation=filtered.generation, replaced=replaced.version,
                        seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.cache = _cache_maintenance_after_publish(cfg, layout)
    m.write(out_dir.path())
    return m


def _retire_versions(part: Partition, pointer: UPath, *, own: str, retire: list[str], grace_s: float) -> None:
    """Removes the versions two replacements old and the orphans past their grace, keeping whatever the pointer
    names now (read again: another run may have switched since). A failure is logged, not raised: the data is
    published."""
    try:
        tidy_partition(part, pointer=read_pointer(pointer).value, own=own, retire=retire, grace_s=grace_s)
    except Exception as e:  # noqa: BLE001 - retention is housekeeping
        logging.getLogger("batch_llm.publish").warning("retention in %s failed: %s", part.location.url, e)


def _cache_maintenance_after_publish(cfg: PipelineConfig, layout: RunLayout) -> dict | None:
    """The cache's maintenance, after the switch: a failure is recorded in the manifest, never raised (the
    run's data is published; a retry must not publish it again)."""
    try:
        return maintain_cache(cfg, layout)
    except Exception as e:  # noqa: BLE001 - housekeeping after the commit
        logging.getLogger("batch_llm.publish").warning("result-cache maintenance failed: %s", e)
        return {"error": f"{type(e).__name__}: {e}"}


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
    """Retention and compaction of the result cache, once per run (a CPU task, not a GPU one): records this
    pipeline's cache settings in the namespaces its shards wrote, then maintains every namespace under the
    cache root with the settings its own writers recorded (``result_cache.maintain_all``), each cheap unless it
    is due. Never raises: a failure is returned as ``error`` (publish must not fail for its cache)."""
    if not cfg.cache.enabled:
        return None
    try:
        from batch_llm.result_cache import maintain_all, record_retention

        root, c = layout.cache_root(cfg), cfg.cache
        written = sorted({ns for s in shard_manifests(layout) if (ns := (s.cache_lookup or {}).get("namespace"))})
        for ns in written:
            record_retention(root, ns, cfg.name, max_age_days=c.max_age_days,
                             compact_after_tables=c.compact_after_tables, max_runs=c.max_runs)
        return {"recorded": written,
                "namespaces": maintain_all(root, compact_after_tables=c.compact_after_tables, max_runs=c.max_runs)}
    except Exception as e:  # noqa: BLE001 - the published data is committed; its cache's upkeep can wait a run
        logging.getLogger("batch_llm.result_cache").warning("result cache maintenance failed: %s", e, exc_info=True)
        return {"error": f"{type(e).__name__}: {e}"}
