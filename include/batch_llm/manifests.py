"""Typed manifests: what each stage commits next to its outputs, and the small references handed between tasks.

A stage writes its manifest last (``manifest.json`` in its folder), so a reader that finds one knows the
stage's outputs are complete; a retry that finds one returns it instead of redoing the stage. Manifests stay
small whatever the run's size (counts and locations, never rows).

The hand-off rule (``stages`` and the Airflow operators follow it):

- A stage's manifest lives in the run folder in storage (``<run>/<stage>/manifest.json``, a shard's in
  ``<run>/infer/shard-NNNNN/``) and is the record of what the stage did. A later stage that needs it reads it
  from there (``stages.read_manifest_at``, ``stages.shard_manifests``), never from XCom.
- XCom carries only a small typed reference, and only where Airflow needs one to wire the DAG or a step after
  the pipeline needs a value: ``ModelRef`` (fetch and quantize → the shards), the ``ShardSpec`` list (plan → the
  shard tasks mapped over it; with ``sharding.shards_per_task`` > 1 a list of such lists, one per task),
  ``ShardResult`` (each shard → the filter, which learns from it which mapped shards ran; a task of several
  shards returns its shards' results as a list), ``PublishedRef`` (publish → steps after the pipeline, the
  "Run report" link). The filter and evaluate tasks return a few counts for the task's XCom tab; no task reads them.
- Every operator builds the run's layout with ``stages.RunLayout.for_run`` (the DAG run's run_id as it is), so a
  task, its retries and its Clears all find the same run folder.
"""
from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_serializer, model_validator
from upath import UPath

from batch_llm.io.storage import MANIFEST, as_path, exists, iter_jsonl, read_json, write_json

M = TypeVar("M", bound="Manifest")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def write(self, directory: UPath) -> UPath:
        """The last write of a stage: the manifest that readers go by."""
        path = directory / MANIFEST
        write_json(path, self.model_dump(mode="json"))
        return path

    @classmethod
    def read(cls: type[M], directory: UPath) -> M:
        return cls.model_validate(read_json(directory / MANIFEST))

    @classmethod
    def read_if_done(cls: type[M], directory: UPath) -> M | None:
        """The manifest when the stage already committed in this folder, else None."""
        return cls.read(directory) if exists(directory / MANIFEST) else None


class ModelFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str       # path inside the model folder
    size: int
    sha256: str


class AdapterRecord(BaseModel):
    """The LoRA adapter of ``model.lora``, as fetched: where it came from, its content hash and how it is used
    (``merge``: merged into the manifest's model folder; ``serve``: the engine loads it beside the model)."""

    model_config = ConfigDict(extra="forbid")

    ref: str
    revision: str | None = None
    source: Literal["modelscope", "storage", "local"]
    local_dir: str                 # the adapter's folder on the worker
    content_hash: str
    mode: Literal["merge", "serve"]
    rank: int
    base_dir: str | None = None    # merge: the base model's folder the merge started from
    merge_cache_hit: bool | None = None


class ModelRef(BaseModel):
    """The model a shard loads: the reference fetch and quantize hand the shards through XCom (their manifests
    stay in the run folder)."""

    model_config = ConfigDict(extra="forbid")

    local_dir: str                 # the folder on the worker
    model_key: str                 # ref@revision#content hash (+ the export's name): keys the result cache
    id: str = ""                   # model.ref as configured
    revision: str | None = None
    quantized: bool = False
    lora_dir: str | None = None    # a LoRA adapter the engine serves beside the model (model.lora.merge: false)

    @classmethod
    def of(cls, model: "ModelRef | FetchManifest | QuantizeManifest | dict") -> "ModelRef":
        """The reference from a manifest, or from its JSON form (an XCom value)."""
        if isinstance(model, ModelRef):
            return model
        if isinstance(model, (FetchManifest, QuantizeManifest)):
            return model.ref()
        return cls.model_validate({k: v for k, v in model.items() if k in cls.model_fields})


class FetchManifest(Manifest):
    """The fetched model folder: where it is, what it holds (every file's size and hash) and its cache key."""

    stage: Literal["fetch"] = "fetch"
    source: Literal["modelscope", "storage", "local"]
    id: str
    revision: str | None = None
    local_dir: str
    cache_hit: bool
    chat_template: str | None = Field(None, description="where the chat template comes from; None: no template")
    files: list[ModelFile]
    total_bytes: int
    content_hash: str
    model_key: str
    seconds: float = 0.0
    adapter: AdapterRecord | None = Field(None, description="model.lora; merge: local_dir is the merged model")

    def ref(self) -> ModelRef:
        served = self.adapter.local_dir if self.adapter is not None and self.adapter.mode == "serve" else None
        return ModelRef(local_dir=self.local_dir, model_key=self.model_key, id=self.id, revision=self.revision,
                        lora_dir=served)


class QuantizeManifest(Manifest):
    """The model the shards serve: the fetched one as is, or its 4-bit export (``quantization``: the export's
    record, cached by model, revision and scheme)."""

    stage: Literal["quantize"] = "quantize"
    id: str = ""
    revision: str | None = None
    local_dir: str
    model_key: str
    quantized: bool
    quantization: dict[str, Any] | None = None
    lora_dir: str | None = None    # the served adapter, passed on from fetch

    def ref(self) -> ModelRef:
        return ModelRef(local_dir=self.local_dir, model_key=self.model_key, id=self.id, revision=self.revision,
                        quantized=self.quantized, lora_dir=self.lora_dir)


class ShardSpec(Manifest):
    """One planned shard: what one mapped inference task runs."""

    index: int
    rows: int
    url: str
    plan_key: str | None = None        # the plan it belongs to (PlanManifest.input_key): stale chunks are not resumed
    records: str | None = None         # output.parts: the shard's own records (its slice of records.jsonl)

    def ref(self) -> dict:
        """The XCom a shard task is mapped over: the references, ``records`` only where the plan wrote them."""
        return self.model_dump(exclude={"records"} if self.records is None else None)


class ShardMetrics(BaseModel):
    """A shard's counts and timings. Row counts cover every attempt's committed rows; ``*_this_attempt`` and
    the timings are the attempt that committed the manifest."""

    model_config = ConfigDict(extra="forbid")

    rows: int
    ok: int = 0
    errors: int = 0
    invalid_outputs: int = 0           # answers that do not fit sampling.output_schema (row outcomes)
    invalid_output_tokens: int = 0     # tokens generated for them
    input_tokens: int = 0
    cached_prompt_tokens: int = 0      # prompt tokens served from the engine's prefix cache
    output_tokens: int = 0             # completion tokens of the usable rows
    reasoning_tokens: int = 0          # the thinking part of them (engine.reasoning_parser)
    thinking_unfinished: int = 0       # rows whose thinking never ended: no answer (usable or not)
    chunks: int = 0
    engine_start_seconds: float = 0.0  # 0 where the shard started no engine or shared another shard's start
    engine_shared_from: int | None = None  # sharding.shards_per_task: the shard of its task whose engine it used
    generate_seconds: float = 0.0
    cached_rows: int = 0               # served from the result cache, not generated
    seconds: float = 0.0
    output_tokens_this_attempt: int = 0
    output_tokens_per_second: float = 0.0
    unique_prompts: int = 0
    peak_rss_mb: float = 0.0
    outputs_asked_again: int = 0       # sampling.output_retries re-asks

    @property
    def failed(self) -> int:
        """Rows that failed (an answer that does not fit the schema is a row outcome, not a failure)."""
        return self.errors - self.invalid_outputs


class EngineRecord(BaseModel):
    """The engine a shard ran: its kind and version, the settings it started with, each start attempt."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    version: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    attempts: list[dict[str, Any]] = Field(default_factory=list, description="memory back-off: one per start")


class Phase(BaseModel):
    """One interval of a shard's timeline (``timeline.PHASES``), seconds since the epoch."""

    model_config = ConfigDict(extra="forbid")

    name: str
    start: float
    end: float


class ShardResult(BaseModel):
    """The reference a shard task hands the filter through XCom: where its files are and its counts (small,
    whatever the shard's size); the shard's manifest stays in its folder."""

    model_config = ConfigDict(extra="forbid")

    shard: int
    outputs: str
    errors: str
    metrics: ShardMetrics
    engine: str | None = None          # the engine's kind
    plan_key: str | None = None        # the plan the shard ran (ShardSpec.plan_key)

    @classmethod
    def of(cls, shard: "ShardResult | ShardManifest | dict") -> "ShardResult":
        """The hand-off from a manifest, or from either one's JSON form (an XCom value)."""
        if isinstance(shard, ShardResult):
            return shard
        if isinstance(shard, dict):
            shard = ShardManifest.model_validate(shard) if "stage" in shard else cls.model_validate(shard)
            if isinstance(shard, ShardResult):
                return shard
        return shard.result()


class ShardManifest(Manifest):
    """One committed shard: its merged files, their checksum, counts, the engine and the phases."""

    stage: Literal["infer"] = "infer"
    shard: int
    status: Literal["ok"] = "ok"
    outputs: str                       # outputs.jsonl: the usable rows, in input order
    errors: str                        # errors.jsonl: rows with a reason (invalid outputs included)
    metrics: ShardMetrics
    checksum: str                      # of the ids in input order
    cache_lookup: dict[str, Any] | None = None
    engine: EngineRecord | None = None
    phases: list[Phase] = Field(default_factory=list)
    plan_key: str | None = None        # the plan the shard ran (ShardSpec.plan_key)

    def result(self) -> ShardResult:
        return ShardResult(shard=self.shard, outputs=self.outputs, errors=self.errors, metrics=self.metrics,
                           engine=self.engine.kind if self.engine else None, plan_key=self.plan_key)


class PlanManifest(Manifest):
    stage: Literal["plan"] = "plan"
    input: str
    input_files: int = 1
    format: str
    rows_read: int
    valid: int
    invalid: int
    duplicates: int = 0
    capped: int = 0          # rows whose own max_tokens was lowered to sampling.max_tokens_cap
    errors: str              # errors.jsonl: {source, line, id, reason}, in input order
    # records.jsonl: {idx, id, reference, record}, in input order; None for a plan in parts
    # (sharding.plan_part_bytes), whose records are each shard's own (ShardSpec.records, in shard order)
    records: str | None
    shards: list[ShardSpec]
    has_references: bool
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    input_key: str | None = Field(None, description="the input files' fingerprint and the settings the plan "
                                  "used, and the stamps of the images its rows read: a later plan of the run reuses "
                                  "this one only while it is the same")
    images_read: str | None = None  # images-read.jsonl: each image file or object the rows read, and its stamp
    parts: int | None = None        # a plan in parts: how many (stages.plan_parts); None: one task planned the day
    # the rows' order inside a shard (plan.shard_order_name): "budget, prefix, length", "budget, length", with a
    # length history "history, prefix, length", "history, length"; or "input"
    order: str | None = None
    # the output-length history the order read (cache/lengths.py): store, files, groups, rows_estimated
    length_history: dict | None = None

    def iter_records(self, options: dict) -> Iterator[dict]:
        """The plan's records in input order: its records file, or (a plan in parts) each shard's in shard order."""
        for url in [self.records] if self.records is not None else [s.records for s in self.shards]:
            if url is None:
                raise ValueError("a plan in parts lists a shard without its records file")
            yield from iter_jsonl(as_path(url, options))

    @model_validator(mode="after")
    def _shards_name_their_plan(self) -> "PlanManifest":
        for s in self.shards:
            if s.plan_key is None and self.input_key:
                s.plan_key = self.input_key[:16]
        return self


class ReviewSummary(BaseModel):
    """What the content review by a model did (``filter.review``, ``stages.review``): rows by verdict (``safe``,
    ``unsafe``, ``error``: the review could not judge the row) and by category, the actions taken, and the review
    pass's requests (one per row and sample) and tokens."""

    model_config = ConfigDict(extra="forbid")

    model: str = ""                    # the review model's key
    task: str = "generate"
    rows_reviewed: int = 0
    verdicts: dict[str, int] = Field(default_factory=dict)
    categories: dict[str, int] = Field(default_factory=dict)
    rows_flagged: int = 0
    rows_masked: int = 0
    rows_dropped: int = 0              # part of FilterSummary.rows_dropped
    requests: int = 0
    cached_requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    shards: list[int] = Field(default_factory=list)


class FilterSummary(BaseModel):
    """What the content filter did; per-word counts are bounded by the word lists, not by the run."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    rows_scanned: int = 0
    rows_affected: int = 0
    rows_dropped: int = 0
    rows_flagged: int = 0
    rows_masked: int = 0
    hits_per_list: dict[str, int] = Field(default_factory=dict)
    hits_per_word: dict[str, dict[str, int]] = Field(default_factory=dict)
    dropped_ids: list[str] = Field(default_factory=list, description="the first DROPPED_IDS_SHOWN dropped ids")
    dropped: str | None = Field(None, description="dropped.jsonl: every dropped row's id and hits")
    lists: list[dict[str, Any]] = Field(default_factory=list)
    review: ReviewSummary | None = Field(None, description="filter.review: the verdicts; rows_dropped above "
                                         "counts the rows the review dropped too")


class FilterPartRef(BaseModel):
    """One shard's part of a filter pass, as the join lists it: where its kept rows, its inference errors (the
    shard's own file) and its dropped rows are, and their counts."""

    model_config = ConfigDict(extra="forbid")

    shard: int
    outputs: str
    rows: int
    inference_errors: str
    inference_error_rows: int
    dropped: str | None = None
    data: str | None = None            # output.parts: the shard's published rows, in the input's format
    data_rows: int = 0


class FilterPart(Manifest):
    """One shard through the word lists and the review's verdicts (the ``filter_shard`` task): committed in
    ``<run>/filter/shard-NNNNN/``; the content filter joins the parts' counts."""

    stage: Literal["filter_part"] = "filter_part"
    shard: int
    outputs: str                       # the kept rows in input order (the shard's own outputs when the lists are off)
    rows: int
    inference_errors: str              # the shard's errors.jsonl, not copied
    inference_error_rows: int
    summary: FilterSummary
    skipped: str | None = None
    plan_key: str | None = None        # the plan the shard ran
    source: str = ""                   # the fingerprint of the shard outputs it read: a shard run again makes it stale
    generation: str = Field(default_factory=lambda: uuid.uuid4().hex[:16])
    data: str | None = None            # output.parts: the shard's rows as published (records joined to outputs)
    data_rows: int = 0

    def ref(self) -> FilterPartRef:
        return FilterPartRef(shard=self.shard, outputs=self.outputs, rows=self.rows,
                             inference_errors=self.inference_errors, inference_error_rows=self.inference_error_rows,
                             dropped=self.summary.dropped, data=self.data, data_rows=self.data_rows)


class FilterManifest(Manifest):
    """A filter pass over the run: the join of its shards' parts (``parts``, in shard order = input order);
    ``outputs`` and ``inference_errors`` are the single files of a pass made before the filter ran per shard."""

    stage: Literal["filter"] = "filter"
    outputs: str | None = None
    rows: int
    inference_errors: str | None = None
    inference_error_rows: int
    summary: FilterSummary
    parts: list[FilterPartRef] = Field(default_factory=list)
    skipped: str | None = None  # why the word lists were not applied (engine.task embed: no text)
    plan_key: str | None = None  # the plan whose shards it merged
    generation: str = Field(default_factory=lambda: uuid.uuid4().hex[:16],
                            description="this pass of the filter: evaluate and publish record the one they used")


class EvaluateManifest(Manifest):
    stage: Literal["evaluate"] = "evaluate"
    skipped: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    num_samples: int | None = None
    rows_with_references: int | None = Field(None, description="rows the sample was drawn from")
    sample_seed: int | None = None
    evalscope_version: str | None = None
    seconds: float | None = None
    report_json: str | None = None
    report_html: str | None = None
    filter_generation: str | None = None  # the filter pass it scored (FilterManifest.generation)

    @property
    def sampled(self) -> bool:
        return bool(self.num_samples is not None and self.rows_with_references
                    and self.num_samples < self.rows_with_references)


class TokenUsage(BaseModel):
    """Tokens of a run's rows (as OpenAI's ``usage``): prompt tokens, the part of them served from the engine's
    prefix cache (vLLM; 0 where the engine does not say), completion tokens of the usable rows and the thinking part
    of them (a reasoning model's, parted by engine.reasoning_parser: OpenAI's completion_tokens_details)."""

    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    @classmethod
    def of_shards(cls, shards: "list[ShardManifest | ShardResult]") -> "TokenUsage":
        metrics = [s.metrics for s in shards]
        return cls(prompt_tokens=sum(m.input_tokens for m in metrics),
                   cached_prompt_tokens=sum(m.cached_prompt_tokens for m in metrics),
                   completion_tokens=sum(m.output_tokens for m in metrics),
                   reasoning_tokens=sum(m.reasoning_tokens for m in metrics))


class PublishManifest(Manifest):
    stage: Literal["publish"] = "publish"
    partition: str
    version: str
    dataset: str
    rows: int
    summary: str
    errors: str
    error_rows: int
    report: str | None = None
    usage: TokenUsage = Field(default_factory=TokenUsage)
    cache: dict[str, Any] | None = Field(None, description="result-cache maintenance done after publishing")
    filter_generation: str | None = None  # the filter pass it published: a later publish of the same pass is a no-op
    replaced: str | None = None           # the version that was current before this one
    table: dict[str, Any] | None = Field(None, description="output.table: the commit (sinks.TableCommit: format, "
                                         "table, snapshot_id, previous_snapshot_id, partition, rows, attempts)")
    retention: dict[str, Any] | None = Field(None, description="output.table: what the table's retention removed")
    seconds: float = 0.0
    peak_rss_mb: float = 0.0

    def ref(self) -> "PublishedRef":
        return PublishedRef.model_validate(self.model_dump(include=set(PublishedRef.model_fields)))


class PublishedRef(BaseModel):
    """The reference the publish task hands on through XCom: the published version, for steps after the
    pipeline (a custom step reads ``dataset``; the "Run report" link opens ``report``). The manifest stays in
    the run folder."""

    model_config = ConfigDict(extra="forbid")

    partition: str
    dataset: str                       # the published data file
    rows: int
    summary: str                       # its summary.json
    errors: str                        # its errors.jsonl
    report: str | None = None          # its report.html
    table: dict[str, Any] | None = None  # output.table: the commit (dataset names the table)


SUMMARY = "summary.json"


class RunManifests(BaseModel):
    """The stage manifests a run summary carries: plan, filter and evaluate always; fetch, quantize and the
    shards when publish was handed them (a stage left out is left out of the JSON too)."""

    model_config = ConfigDict(extra="forbid")

    plan: PlanManifest
    filter: FilterManifest
    evaluate: EvaluateManifest
    fetch: FetchManifest | None = None
    quantize: QuantizeManifest | None = None
    infer: list[ShardManifest | ShardResult] | None = Field(
        None, description="the shards: their manifests, or (from XCom) their hand-offs")

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def shards(self) -> list[ShardManifest | ShardResult]:
        """The shards by index ([] when the summary has none)."""
        return sorted(self.infer or [], key=lambda s: s.shard)


class RowAccounting(BaseModel):
    """Where every input line of a run went: published, or an error line with its stage (the planner's
    invalid and duplicate rows, inference's failures, the rows the content filter dropped). ``balanced`` says
    they add up to the lines read."""

    model_config = ConfigDict(extra="forbid")

    read: int
    published: int
    plan_errors: int
    infer_errors: int
    dropped: int
    error_lines: int                   # the published errors file's lines (plan + infer + dropped)

    @property
    def balanced(self) -> bool:
        errors = self.plan_errors + self.infer_errors + self.dropped
        return self.read == self.published + errors and self.error_lines == errors

    @classmethod
    def of_run(cls, plan: PlanManifest, filtered: FilterManifest, *, published: int,
               error_lines: int) -> "RowAccounting":
        return cls(read=plan.rows_read, published=published, plan_errors=plan.invalid,
                   infer_errors=filtered.inference_error_rows, dropped=filtered.summary.rows_dropped,
                   error_lines=error_lines)


class RunSummary(BaseModel):
    """A published version's ``summary.json``: what the run published and where, the configuration it ran with,
    every stage's manifest and the tokens it used. The doctor, the report and ``batch-llm report``/``doctor``
    read it."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str
    run_id: str
    partition: str
    rows_published: int
    format: str
    dataset: str                       # the published data file
    errors: str                        # the published errors.jsonl
    config: dict[str, Any] = Field(
        description="the pipeline configuration the run used, as JSON (Params applied); "
        "kept as written, so a summary stays readable when the config model changes")
    manifests: RunManifests
    published_at: dt.datetime
    usage: TokenUsage = Field(default_factory=TokenUsage)
    report: str | None = None          # report.html next to the summary
    rows: RowAccounting | None = None  # where every input line went (summaries before it: None)

    @field_serializer("published_at")
    def _iso(self, value: dt.datetime) -> str:
        return value.isoformat()  # as written before the model: "+00:00", not pydantic's "Z"

    @model_serializer(mode="wrap")
    def _rows_only_when_counted(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("rows") is None:  # a summary from before the accounting reads and writes back the same
            out.pop("rows", None)
        return out

    def write(self, version_dir: UPath) -> UPath:
        path = version_dir / SUMMARY
        write_json(path, self.model_dump(mode="json"))
        return path

    @classmethod
    def read(cls, path: UPath) -> "RunSummary":
        """The summary in ``path``: a summary.json, or the published version's folder that holds one."""
        return cls.model_validate(read_json(path if path.name == SUMMARY else path / SUMMARY))
