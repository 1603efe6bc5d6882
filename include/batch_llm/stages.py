"""The stages, one function each: the public facade of the stage library.

Each takes the pipeline config, the run's layout and the manifests of the stages before it, writes its
artifacts plus ``manifest.json`` under ``<run>/<stage>/``, and returns that manifest. The Airflow operators,
the CLI, the benchmarks and the tests all call these same functions::

    layout = RunLayout.for_run(cfg, run_id="manual__1", ds="2026-11-30")
    model = fetch(cfg, layout)
    model = quantize(cfg, layout, model)
    plan = plan_shards(cfg, layout)
    shards = [infer_shard(cfg, layout, model, s) for s in plan["shards"]]
    filtered = content_filter(cfg, layout, plan, shards)
    scores = evaluate(cfg, layout, plan, filtered)
    publish(cfg, layout, plan, filtered, scores)
"""
from __future__ import annotations

import datetime as dt
import heapq
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from batch_llm import plan as _plan
from batch_llm.config import PipelineConfig
from batch_llm.fetch import fetch_model
from batch_llm.formats import FILE_SUFFIX, output_record, write_rows
from batch_llm.storage import Location, exists, iter_jsonl, list_files, read_json, read_manifest, remove_tree, \
    write_bytes_atomic, write_json, write_jsonl, write_manifest


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


def _done(stage_dir: Location) -> dict | None:
    """A stage whose manifest exists already ran for this run: a retry returns it instead of redoing it."""
    p = stage_dir.path() / "manifest.json"
    return read_manifest(p) if exists(p) else None


def read_manifest_at(layout: RunLayout, stage: str) -> dict:
    """The manifest a stage of this run committed (stages downstream go by it, not by XCom)."""
    return read_manifest(layout.stage(stage).path())


def shard_manifests(layout: RunLayout) -> list[dict]:
    infer_dir = layout.stage("infer").path()
    return [read_manifest(d) for d in list_files(infer_dir) if exists(d / "manifest.json")]


# ------------------------------------------------------------------------------------------ stages
def fetch(cfg: PipelineConfig, layout: RunLayout, *, storage_options: dict | None = None) -> dict:
    t0 = time.perf_counter()
    m = fetch_model(cfg.model, storage_options=storage_options)
    m["seconds"] = round(time.perf_counter() - t0, 2)
    write_manifest(layout.stage("fetch").path(), m)
    return m


def quantize(cfg: PipelineConfig, layout: RunLayout, model: dict) -> dict:
    """AWQ W4A16 export when enabled (cached by model, revision and scheme); otherwise the model as is."""
    if not cfg.quantize.enabled:
        m = {**model, "stage": "quantize", "quantized": False}
    else:
        from batch_llm.quantize import quantize_model

        q = quantize_model(model["local_dir"], cfg.quantize, model_key=model["model_key"])
        m = {**model, "stage": "quantize", "quantized": True, "quantization": q,
             "local_dir": q["model_dir"], "model_key": f"{model['model_key']}+{Path(q['model_dir']).name}"}
    write_manifest(layout.stage("quantize").path(), m)
    return m


def plan_shards(cfg: PipelineConfig, layout: RunLayout) -> dict:
    return _done(layout.stage("plan")) or _plan.plan_shards(cfg, input_loc=layout.input,
                                                            plan_dir=layout.stage("plan"))


def infer_shard(cfg: PipelineConfig, layout: RunLayout, model: dict, shard: dict,
                say: Callable[[str], None] = print) -> dict:
    """Runs one shard in this process (the GPU operator runs it in a spawned worker instead)."""
    from batch_llm.infer import run_shard

    return run_shard(cfg, shard=shard, shard_dir=layout.stage("infer").child(f"shard-{shard['index']:05d}"),
                     model_dir=model["local_dir"], model_key=model["model_key"],
                     cache_root=layout.cache_root(cfg), say=say)


def content_filter(cfg: PipelineConfig, layout: RunLayout, plan: dict, shards: list[dict]) -> dict:
    """Merges the shards' outputs in input order (streamed) and applies the word lists."""
    out_dir = layout.stage("filter")
    if m := _done(out_dir):
        return m
    opts = layout.output_root.options

    def merged(key: str) -> Iterator[dict]:
        # Each shard's files are in input order: a streamed merge puts the run in input order.
        return heapq.merge(*(iter_jsonl(Location(s[key], opts).path()) for s in shards), key=lambda r: r["idx"])

    summary: dict = {}
    counts = {"kept": 0, "scanned": 0}

    def counted(rows: Iterator[dict], name: str) -> Iterator[dict]:
        for r in rows:
            counts[name] += 1
            yield r

    if cfg.filter.enabled:
        from batch_llm import content_filter as _filter  # pyahocorasick is not needed on GPU workers

        kept = _filter.filter_rows(merged("outputs"), cfg.filter, opts, summary=summary)
    else:
        kept = counted(merged("outputs"), "scanned")
    write_jsonl(out_dir.child("outputs.jsonl").path(), counted(kept, "kept"))
    if not cfg.filter.enabled:
        summary = {"enabled": False, "rows_scanned": counts["scanned"]}
    n_errors = write_jsonl(out_dir.child("errors.jsonl").path(), merged("errors"))
    m = {"stage": "filter", "outputs": out_dir.child("outputs.jsonl").url, "rows": counts["kept"],
         "inference_errors": out_dir.child("errors.jsonl").url, "inference_error_rows": n_errors,
         "summary": summary}
    write_manifest(out_dir.path(), m)
    return m


def evaluate(cfg: PipelineConfig, layout: RunLayout, plan: dict, filtered: dict) -> dict:
    """Scores outputs against reference answers with EvalScope; stores its report next to the run."""
    out_dir = layout.stage("evaluate")
    if not (m := _done(out_dir)):
        m = _evaluate(cfg, layout, plan, filtered, out_dir)
    score = m.get("metrics", {}).get(cfg.evaluate.metric)
    if cfg.evaluate.enabled and cfg.evaluate.min_score is not None and score is not None \
            and score < cfg.evaluate.min_score:
        raise EvaluationBelowThreshold(
            f"{cfg.evaluate.metric} = {score:.4f} is below evaluate.min_score = {cfg.evaluate.min_score} "
            f"({m['num_samples']} samples; report: {m['report_json']})")
    return m


def _evaluate(cfg: PipelineConfig, layout: RunLayout, plan: dict, filtered: dict, out_dir: Location) -> dict:
    opts = layout.output_root.options
    if not cfg.evaluate.enabled:
        m = {"stage": "evaluate", "skipped": "evaluate.enabled is false", "metrics": {}}
    elif not plan.get("has_references"):
        m = {"stage": "evaluate", "skipped": f"no reference answers (column {cfg.input.reference_column!r})",
             "metrics": {}}
    else:
        from batch_llm.evaluate import score_with_evalscope

        refs = {r["id"]: r["reference"] for r in iter_jsonl(Location(plan["records"], opts).path())
                if r["reference"]}
        questions = {}
        for s in plan["shards"]:
            for r in iter_jsonl(Location(s["url"], opts).path()):
                if r["id"] in refs:
                    questions[r["id"]] = next((m["content"] for m in reversed(r["messages"]) if m["role"] == "user"), "")
        records = [{"id": r["id"], "question": questions.get(r["id"], ""), "output": r["output"],
                    "reference": refs[r["id"]]} for r in iter_jsonl(Location(filtered["outputs"], opts).path())
                   if r["id"] in refs]
        with tempfile.TemporaryDirectory(prefix="batch_llm_eval_") as tmp:
            t0 = time.perf_counter()
            res = score_with_evalscope(records, Path(tmp), metric=cfg.evaluate.metric)
            seconds = time.perf_counter() - t0
            report_dir = out_dir.child("evalscope")
            uploaded = {}
            for key in ("report_json", "report_html"):
                if res.get(key):
                    src = Path(res[key])
                    dest = report_dir.child(src.name)
                    # Not mkdir + write_bytes: on S3, mkdir(parents=True) creates a missing bucket.
                    write_bytes_atomic(dest.path(), src.read_bytes())
                    uploaded[key] = dest.url
        m = {"stage": "evaluate", "metrics": res["metrics"], "num_samples": res["num_samples"],
             "evalscope_version": res.get("evalscope_version"), "seconds": round(seconds, 2),
             "report_json": uploaded.get("report_json"), "report_html": uploaded.get("report_html")}
    write_manifest(out_dir.path(), m)
    return m


def publish(cfg: PipelineConfig, layout: RunLayout, plan: dict, filtered: dict, scores: dict,
            extra_manifests: dict | None = None) -> dict:
    """Writes the final dataset (input's format) and the run summary into a new version of the partition,
    then switches the partition's ``_CURRENT.json`` pointer to it: readers see the old or the new version,
    never a mix. Older versions but the previous one are removed."""
    out_dir = layout.stage("publish")
    if m := _done(out_dir):
        return m
    opts = layout.output_root.options
    fmt = plan["format"]
    results = {r["id"]: r for r in iter_jsonl(Location(filtered["outputs"], opts).path())}
    version = layout.published.child(f"v-{time.strftime('%Y%m%dT%H%M%S')}-{re.sub(r'[^A-Za-z0-9]', '', layout.run_id)[-12:]}")
    rows = (output_record(rec["record"], results[rec["id"]], fmt)
            for rec in iter_jsonl(Location(plan["records"], opts).path()) if rec["id"] in results)
    data = version.child(f"data{FILE_SUFFIX[fmt]}")
    n = write_rows(data.path(), rows, fmt)
    errors = list(iter_jsonl(Location(plan["errors"], opts).path())) + [
        {"id": e["id"], "reason": e["error"], "stage": "infer"}
        for e in iter_jsonl(Location(filtered["inference_errors"], opts).path())]
    write_jsonl(version.child("errors.jsonl").path(), errors)
    summary = {"pipeline": cfg.name, "run_id": layout.run_id, "partition": layout.partition,
               "rows_published": n, "format": fmt, "dataset": data.url, "errors": version.child("errors.jsonl").url,
               "config": cfg.model_dump(mode="json"),
               "manifests": {"plan": plan, "filter": filtered, "evaluate": scores, **(extra_manifests or {})},
               "published_at": dt.datetime.now(dt.timezone.utc).isoformat()}
    summary["report"] = version.child("report.html").url
    write_json(version.child("summary.json").path(), summary)
    from batch_llm.report import write_run_report  # matplotlib loads only here, not when DAGs are parsed

    report_url = write_run_report(summary, version, layout.pipeline_root)
    pointer = layout.published.child("_CURRENT.json")
    previous = read_json(pointer.path()).get("version") if exists(pointer.path()) else None
    write_json(pointer.path(), {"version": version.url, "dataset": data.url, "run_id": layout.run_id,
                                "rows": n, "committed_at": summary["published_at"], "report": report_url})
    for old in list_files(layout.published.path()):
        if old.name.startswith("v-") and old.name not in (version.url.rsplit("/", 1)[-1],
                                                          (previous or "").rsplit("/", 1)[-1]):
            remove_tree(old)
    m = {"stage": "publish", "partition": layout.published.url, "version": version.url, "dataset": data.url,
         "rows": n, "summary": version.child("summary.json").url, "errors": version.child("errors.jsonl").url,
         "error_rows": len(errors), "report": report_url}
    write_manifest(out_dir.path(), m)
    return m


def read_published(partition: Location) -> Location:
    """The dataset of a partition's current version (what a reader should go by)."""
    return Location(read_json(partition.child("_CURRENT.json").path())["dataset"], partition.options)
