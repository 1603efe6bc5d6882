"""The publish stage: the run's dataset, errors and summary into a new version of the partition, the
partition's ``_CURRENT.json`` switched to it, retention, and the result cache's upkeep after the commit."""
from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from batch_llm.config import PipelineConfig
from batch_llm.io.current_pointer import PointerState, read_pointer, switch_pointer
from batch_llm.io.formats import FILE_SUFFIX, write_rows
from batch_llm.io.retention import Partition, new_version_name, tidy_partition
from batch_llm.io.storage import (
    Location,
    copy_object,
    exists,
    iter_jsonl,
    list_files,
    peak_rss_mb,
    write_jsonl,
)
from batch_llm.manifests import (
    SUMMARY,
    EvaluateManifest,
    FilterManifest,
    FilterPart,
    PlanManifest,
    PublishManifest,
    RowAccounting,
    RunManifests,
    RunSummary,
    TokenUsage,
)
from batch_llm.output_schema import OutputSchema
from batch_llm.rows.records import (
    class_label_column,
    class_score_column,
    joined_outputs,
    openai_error_line,
    output_record,
    structured_column,
)
from batch_llm.stages.filter_parts import dropped_rows, filtered_outputs, inference_errors

if TYPE_CHECKING:
    from upath import UPath

from batch_llm.layout import RunLayout, shard_manifests


def _publish_errors(plan: PlanManifest, filtered: FilterManifest, opts: dict, run_id: str) -> Iterator[dict]:
    """Every row that has no output, with its stage and reason: the planner's (input order), inference's, then
    the rows the content filter dropped (its word lists, or the content review: stage ``review``). For OpenAI
    Batch input, as the lines of an OpenAI Batch error file (ids of the run ``run_id``)."""
    errors = row_errors(plan, filtered, opts)
    if plan.format != "openai_batch":
        yield from errors
        return
    codes = {"plan": "invalid_request", "infer": "generation_failed", "content_filter": "content_filter",
             "review": "content_review"}
    for e in errors:
        where = f" ({e['source']} line {e['line']})" if e.get("source") else ""
        place = f"row {e['idx']}" if e.get("idx") is not None else where.strip(" ()")
        yield openai_error_line(e.get("id"), e["reason"] + where, code=e.get("code") or codes[e["stage"]],
                                run_id=run_id, where=place)


def row_errors(plan: PlanManifest, filtered: FilterManifest, opts: dict) -> Iterator[dict]:
    """Every row of the run that is not published, once, with its reason and the stage that refused it (plan,
    infer, review, content_filter), and its ``row_id`` (``error_row_id``)."""
    for e in iter_jsonl(Location(plan.errors, opts).path()):
        yield {**e, "stage": "plan", "row_id": error_row_id(e)}
    for e in inference_errors(filtered, opts):
        # error_code: a row a stopped batch never ran (batch_api.stop: batch_cancelled, batch_expired)
        yield {"id": e["id"], "idx": e.get("idx"), "reason": e["error"], "stage": "infer", "row_id": str(e["id"]),
               **({"code": e["error_code"]} if e.get("error_code") else {})}
    for d in dropped_rows(filtered, opts):
        if d.get("reason"):  # dropped by the content review (filter.review), which says why
            yield {"id": d["id"], "idx": d.get("idx"), "reason": d["reason"], "stage": d.get("stage", "review"),
                   "row_id": str(d["id"])}
            continue
        words = ", ".join(sorted({f"{h['word']!r} ({h['list']})" for h in d.get("hits") or []}))
        yield {"id": d["id"], "idx": d.get("idx"), "reason": f"dropped by the content filter: {words}",
               "stage": "content_filter", "row_id": str(d["id"])}


def error_row_id(e: dict) -> str | None:
    """A row's stable id, unique in its run: a planned row's is its input id (unique: a later row with the same id
    is a plan error); a row the planner refused is named by its file and line (``prompts.jsonl:7``): it may have no
    id, or the id of another row (a duplicate, or an invalid row whose id a valid one has)."""
    if e.get("source") and e.get("line") is not None:
        return f"{e['source']}:{e['line']}"
    return _text(e.get("id"))


def published_lines(dataset: str, options: dict | None = None) -> Iterator[dict]:
    """A published JSONL dataset's rows in input order: its file, or (``output.parts``) its folder's part files
    in name order, which is shard order."""
    path = Location(dataset, options or {}).path()
    for f in list_files(path, ".jsonl") if path.is_dir() else [path]:
        yield from iter_jsonl(f)


def _version_name(run_id: str) -> str:
    """A new version's folder name (``retention.VERSION_NAME``: retention deletes no other)."""
    return new_version_name(run_id)


def publish(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
            scores: EvaluateManifest, extra_manifests: dict | None = None, *,
            catalog_properties: dict[str, str] | None = None) -> PublishManifest:
    """Writes the final dataset (input's format, streamed), its errors and the run summary into a new version
    of the partition, then switches the partition's ``_CURRENT.json`` to it with a compare-and-swap
    (``current_pointer``): readers see the old or the new version, never a mix, and of two runs of one day
    publishing at once the last to finish is current. The version it replaced is kept; the one before that is
    removed, and so are orphans of killed publishers older than ``output.orphan_grace_hours``, each only when
    proven a version of this partition (``retention``: its marker, name and place).

    With ``output.table`` the rows go into a Delta or Iceberg table instead (``publish_to_table``;
    ``catalog_properties``: the Iceberg catalog's connection, resolved by the caller).

    A publish of a filter pass already published (a retry after the switch) returns that publish. Last, the
    result cache's maintenance runs; it never fails a run whose data is published."""
    if cfg.output.table is not None:
        return publish_to_table(cfg, layout, plan, filtered, scores, extra_manifests,
                                catalog_properties=catalog_properties)
    out_dir = layout.stage("publish")
    opts = layout.output_root.options
    done = PublishManifest.read_if_done(out_dir.path())
    if done is not None and done.filter_generation == filtered.generation \
            and exists(Location(done.version, opts).child(SUMMARY).path()):
        return done
    t0 = time.perf_counter()
    fmt = plan.format
    if cfg.output.parts and not all(p.data for p in filtered.parts):
        raise ValueError("output.parts: the filter pass has no published rows of its shards (made before "
                         "output.parts was set); clear filter_shard with its downstream tasks")
    part = Partition(layout.published, layout.pipeline, layout.partition)
    version = layout.published.child(_version_name(layout.run_id))
    part.write_marker(version, layout.run_id)  # first: the proof retention asks for before it deletes a version
    if cfg.output.parts:  # the shards' files, written by their filter tasks, linked in: no row read here
        data = version.child("data")
        n = 0
        for p in filtered.parts:
            assert p.data is not None
            copy_object(Location(p.data, opts).path(), data.child(f"part-{p.shard:05d}{FILE_SUFFIX[fmt]}").path())
            n += p.data_rows
    else:
        data = version.child(f"data{FILE_SUFFIX[fmt]}")
        n = _write_dataset(cfg, layout, plan, filtered, plan.iter_records(opts), data)
    n_errors = write_jsonl(version.child("errors.jsonl").path(), _publish_errors(plan, filtered, opts, layout.run_id))
    manifests = RunManifests(plan=plan, filter=filtered, evaluate=scores, **(extra_manifests or {}))
    summary = RunSummary(
        pipeline=cfg.name, run_id=layout.run_id, partition=layout.partition, rows_published=n, format=fmt,
        dataset=data.url, errors=version.child("errors.jsonl").url, config=cfg.model_dump(mode="json"),
        manifests=manifests, published_at=dt.datetime.now(dt.timezone.utc),
        usage=TokenUsage.of_shards(manifests.shards), report=version.child("report.html").url,
        rows=RowAccounting.of_run(plan, filtered, published=n, error_lines=n_errors))
    summary.write(version.path())
    from batch_llm.analysis.report import write_run_report  # matplotlib loads only here, not when DAGs are parsed

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


def _write_dataset(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
                   records: Iterator[dict], data: Location) -> int:
    """The published rows (the records joined to the kept outputs) in the input's format, streamed; their count."""
    opts = layout.output_root.options
    fmt = plan.format
    schema = OutputSchema(cfg.sampling.output_schema) if cfg.sampling.output_schema is not None else None
    pairs = joined_outputs(records, filtered_outputs(filtered, opts))
    return write_rows(data.path(), (output_record(rec["record"], out, fmt, model=cfg.model.ref, schema=schema,
                                                  run_id=layout.run_id) for rec, out in pairs), fmt,
                      types=_structured_types(schema, plan, opts) or _embedding_types(filtered, fmt, opts)
                      or _class_types(cfg, plan, filtered, opts))


def publish_part(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, part: FilterPart) -> FilterPart:
    """``output.parts``: one shard's published rows, its records (``ShardSpec.records``) joined to the rows its
    filter kept, into ``data.<format>`` beside its filter part; publish links the file into the version. Run by
    the shard's ``filter_shard`` task, so the day's rows are written by as many tasks as it has shards."""
    spec = next((s for s in plan.shards if s.index == part.shard), None)
    if spec is None or spec.records is None:
        raise ValueError(f"output.parts: shard {part.shard} has no records of its own in the run's plan (planned "
                         "before output.parts was set); clear plan_shards with its downstream tasks")
    opts = layout.output_root.options
    one = FilterManifest(rows=part.rows, inference_error_rows=part.inference_error_rows, summary=part.summary,
                         parts=[part.ref()])
    data = layout.shard_dir(part.shard, "filter").child(f"data{FILE_SUFFIX[plan.format]}")
    part.data_rows = _write_dataset(cfg, layout, plan, one, iter_jsonl(Location(spec.records, opts).path()), data)
    part.data = data.url
    return part


# The columns every table row gets besides the input's and the generated ones (docs/operating.md lists them).
ROW_ID, STATUS, ERROR_STAGE, ERROR = "_row_id", "_status", "_error_stage", "_error"


def publish_to_table(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, filtered: FilterManifest,
                     scores: EvaluateManifest, extra_manifests: dict | None = None, *,
                     catalog_properties: dict[str, str] | None = None) -> PublishManifest:
    """The run's rows as the partition of ``output.table``, replaced in one commit of the table format
    (``batch_llm.sinks``): rows with an output (``_status`` ok: the input's columns, the generated ones typed as
    in a Parquet file, the provenance columns) and every row without one (``_status`` error, with its stage and
    reason), so one commit holds the whole day. The commit's metadata names the run, the model and the row
    accounting. The run's summary, errors file and report stay in its ``publish`` folder. After the commit the
    table's retention runs (never failing the run). A publish of a filter pass already committed returns that
    publish; a retry after a commit whose manifest was not written replaces the day again with the same rows."""
    from batch_llm.io.identity import stable_hash
    from batch_llm.sinks.configured import partition_values, sink_for
    from batch_llm.sinks.rows import spooled_rows

    out_dir = layout.stage("publish")
    opts = layout.output_root.options
    done = PublishManifest.read_if_done(out_dir.path())
    if done is not None and done.table is not None and done.filter_generation == filtered.generation:
        return done
    t0 = time.perf_counter()
    table_cfg = cfg.output.table
    assert table_cfg is not None
    sink = sink_for(cfg, layout, catalog_properties=catalog_properties)
    values = partition_values(cfg, layout)
    manifests = RunManifests(plan=plan, filter=filtered, evaluate=scores, **(extra_manifests or {}))
    model_key = next((m.model_key for m in (manifests.quantize, manifests.fetch) if m is not None), cfg.model.ref)
    provenance = {"_run_id": layout.run_id, "_model": cfg.model.ref, "_model_hash": model_key,
                  "_config_hash": stable_hash(cfg.model_dump(mode="json"))[:16]}
    schema = OutputSchema(cfg.sampling.output_schema) if cfg.sampling.output_schema is not None else None
    errors_loc = out_dir.child("errors.jsonl")
    n_errors = write_jsonl(errors_loc.path(), _publish_errors(plan, filtered, opts, layout.run_id))
    published = [0]
    # error rows carry the input's id in the input's id column, typed as the published rows have it
    id_column = "custom_id" if plan.format == "openai_batch" else cfg.input.id_column
    as_input_id = _input_id_type(plan, opts, id_column)

    def rows() -> Iterator[dict]:
        for rec, out in joined_outputs(plan.iter_records(opts),
                                       filtered_outputs(filtered, opts)):
            published[0] += 1
            row = output_record(_table_record(rec["record"], plan.format), out, "parquet", model=cfg.model.ref,
                                schema=schema)
            yield {**row, ROW_ID: _text(rec["id"]), STATUS: "ok", **provenance}
        for e in row_errors(plan, filtered, opts):
            where = f" ({e['source']} line {e['line']})" if e.get("source") else ""
            yield {id_column: as_input_id(e.get("id")), ROW_ID: e["row_id"], STATUS: "error", ERROR_STAGE: e["stage"],
                   ERROR: e["reason"] + where, **provenance}

    as_parquet = plan if plan.format == "parquet" else plan.model_copy(update={"format": "parquet"})
    types = (_structured_types(schema, as_parquet, opts) or _embedding_types(filtered, "parquet", opts)
             or _class_types(cfg, as_parquet, filtered, opts) or [])
    import pyarrow as pa

    # typed on a day without errors too
    types += [pa.field(c, pa.string()) for c in (ROW_ID, STATUS, ERROR_STAGE, ERROR)]
    with spooled_rows(rows(), types=types) as batches:
        accounting = RowAccounting.of_run(plan, filtered, published=published[0], error_lines=n_errors)
        metadata = {"run_id": layout.run_id, "pipeline": cfg.name, "model": cfg.model.ref, "model_hash": model_key,
                    "config_hash": provenance["_config_hash"], "filter_generation": filtered.generation or "",
                    **{f"rows_{k}": str(v) for k, v in accounting.model_dump().items()}}
        commit = sink.publish(batches, values, metadata)
    summary = RunSummary(
        pipeline=cfg.name, run_id=layout.run_id, partition=layout.partition, rows_published=published[0],
        format=plan.format, dataset=commit.table, errors=errors_loc.url, config=cfg.model_dump(mode="json"),
        manifests=manifests, published_at=dt.datetime.now(dt.timezone.utc),
        usage=TokenUsage.of_shards(manifests.shards), report=out_dir.child("report.html").url, rows=accounting)
    summary.write(out_dir.path())
    from batch_llm.analysis.report import write_run_report  # matplotlib loads only here, not when DAGs are parsed

    report_url = write_run_report(summary, out_dir, layout.pipeline_root)
    m = PublishManifest(partition=layout.partition, version=f"{commit.table}@{commit.snapshot_id}",
                        dataset=commit.table, rows=published[0], summary=out_dir.child(SUMMARY).url,
                        errors=errors_loc.url, error_rows=n_errors, report=report_url, usage=summary.usage,
                        filter_generation=filtered.generation, replaced=None if commit.previous_snapshot_id is None
                        else f"{commit.table}@{commit.previous_snapshot_id}", table=commit.to_dict(),
                        seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.retention = _table_retention(sink, table_cfg.retention_hours)
    m.cache = _cache_maintenance_after_publish(cfg, layout)
    m.write(out_dir.path())
    return m


def _text(row_id: str | int | None) -> str | None:
    return None if row_id is None else str(row_id)  # an input's ids may be numbers: one column type


def _input_id_type(plan: PlanManifest, opts: dict, column: str):
    """Casts an error row's id to the type the input's id column has in the published rows (the first record's):
    integer ids stay integers (an inference error knows its id as text), any other id is text."""
    first = next(plan.iter_records(opts), None)
    integers = isinstance(((first or {}).get("record") or {}).get(column), int)

    def cast(rid: str | int | None) -> str | int | None:
        if rid is None or isinstance(rid, bool):
            return None
        if integers:
            try:
                return int(rid)
            except ValueError:  # an id of another type, in a run of integer ids: its row_id still names it
                return None
        return str(rid)

    return cast


def _table_record(record: dict, fmt: str) -> dict:
    """An input record as table columns: an OpenAI Batch request's ``body`` is a request document whose shape
    varies by request (messages of text or of parts, tools), kept as its JSON text."""
    if fmt == "openai_batch" and isinstance(record.get("body"), dict | list):
        import json

        return {**record, "body": json.dumps(record["body"], ensure_ascii=False)}
    return record


def _table_retention(sink, hours: float) -> dict:
    """The table format's retention after the commit; a failure is logged and recorded, never raised (the
    day is committed)."""
    try:
        return sink.expire(hours)
    except Exception as e:  # noqa: BLE001 - retention is housekeeping
        logging.getLogger("batch_llm.publish").warning("retention of table %s failed: %s", sink.name, e)
        return {"error": f"{type(e).__name__}: {e}"}


def _retire_versions(part: Partition, pointer: UPath, *, own: str, retire: list[str], grace_s: float) -> None:
    """Removes the versions two replacements old and the orphans past their grace, keeping whatever the pointer
    names now (read again: another run may have switched since). A failure is logged, not raised: the data is
    published."""
    try:
        tidy_partition(part, pointer=read_pointer(pointer).value, own=own, retire=retire, grace_s=grace_s)
    except Exception as e:  # noqa: BLE001 - retention is housekeeping
        logging.getLogger("batch_llm.stages.publish").warning("retention in %s failed: %s", part.location.url, e)


def _cache_maintenance_after_publish(cfg: PipelineConfig, layout: RunLayout) -> dict | None:
    """The cache's maintenance, after the switch: a failure is recorded in the manifest, never raised (the
    run's data is published; a retry must not publish it again)."""
    try:
        return maintain_cache(cfg, layout)
    except Exception as e:  # noqa: BLE001 - housekeeping after the commit
        logging.getLogger("batch_llm.stages.publish").warning("result-cache maintenance failed: %s", e)
        return {"error": f"{type(e).__name__}: {e}"}


def _structured_types(schema: OutputSchema | None, plan: PlanManifest, opts: dict) -> list | None:
    """The Parquet types of the output schema's columns (under the names ``output_record`` gives them)."""
    if schema is None or plan.format != "parquet":
        return None
    first = next(plan.iter_records(opts), None)
    record = (first or {}).get("record") or {}
    return [f.with_name(structured_column(f.name, record)) for f in schema.arrow_fields()]


def _embedding_types(filtered: FilterManifest, fmt: str, opts: dict) -> list | None:
    """engine.task embed in Parquet: the vector as a fixed-size list of float32, its width the first
    output's (every vector of one model and run has the same width)."""
    if fmt != "parquet":
        return None
    first = next(filtered_outputs(filtered, opts), None)
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
    first = next((r for r in filtered_outputs(filtered, opts) if r.get("scores")), None)
    if first is None:
        return None
    import pyarrow as pa

    rec = next(plan.iter_records(opts), None)
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
        from batch_llm.cache.results import maintain_all, record_retention

        root, c = layout.cache_root(cfg), cfg.cache
        written = sorted({ns for s in shard_manifests(layout) if (ns := (s.cache_lookup or {}).get("namespace"))})
        for ns in written:
            record_retention(root, ns, cfg.name, max_age_days=c.max_age_days,
                             compact_after_tables=c.compact_after_tables, max_runs=c.max_runs)
        return {"recorded": written,
                "namespaces": maintain_all(root, compact_after_tables=c.compact_after_tables, max_runs=c.max_runs)}
    except Exception as e:  # noqa: BLE001 - the published data is committed; its cache's upkeep can wait a run
        logging.getLogger("batch_llm.cache.results").warning("result cache maintenance failed: %s", e, exc_info=True)
        return {"error": f"{type(e).__name__}: {e}"}
