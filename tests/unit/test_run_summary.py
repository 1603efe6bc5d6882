"""The run summary (``summary.json`` of a published version) as a typed model: what publish writes, read back the
same, and summaries written before the model (plain dicts of the stage manifests' JSON) still read."""
from __future__ import annotations

import datetime as dt
import json

from batch_llm.config import parse_config
from batch_llm.io.storage import Location, read_json, write_json, write_jsonl
from batch_llm.manifests import (
    EngineRecord,
    EvaluateManifest,
    FetchManifest,
    FilterManifest,
    FilterSummary,
    PlanManifest,
    QuantizeManifest,
    RunSummary,
    ShardManifest,
    ShardMetrics,
    ShardResult,
    ShardSpec,
    TokenUsage,
)

KEYS = ["pipeline", "run_id", "partition", "rows_published", "format", "dataset", "errors", "config", "manifests",
        "published_at", "usage", "report"]
PUBLISHED_KEYS = [*KEYS, "rows"]  # publish also writes where every input line went


def _manifests(tmp_path):
    plan = PlanManifest(input=str(tmp_path / "in.jsonl"), format="jsonl", rows_read=3, valid=2, invalid=1,
                        errors="plan/errors.jsonl", records="plan/records.jsonl", has_references=True,
                        shards=[ShardSpec(index=0, rows=2, url="plan/shard-00000.jsonl")])
    filtered = FilterManifest(outputs="filter/outputs.jsonl", rows=2, inference_errors="filter/errors.jsonl",
                              inference_error_rows=0, summary=FilterSummary(rows_scanned=2, hits_per_list={"en": 1},
                                                                            lists=[{"name": "en", "action": "mask"}]))
    scores = EvaluateManifest(metrics={"Rouge-L-F": 0.5}, num_samples=2, rows_with_references=2, sample_seed=0)
    fetched = FetchManifest(source="local", id="org/m", revision="main", local_dir=str(tmp_path / "m"), cache_hit=True,
                            files=[], total_bytes=0, content_hash="ab" * 32, model_key="org/m@main#ab")
    quantized = QuantizeManifest(id="org/m", revision="main", local_dir=str(tmp_path / "m"), model_key="org/m@main#ab",
                                 quantized=False)
    shard = ShardManifest(shard=0, outputs="infer/shard-00000/outputs.jsonl", errors="infer/shard-00000/errors.jsonl",
                          checksum="c0ffee", metrics=ShardMetrics(rows=2, ok=2, input_tokens=20, cached_prompt_tokens=4,
                                                                  output_tokens=8, unique_prompts=2),
                          engine=EngineRecord(kind="vllm", version="0.1", settings={"max_num_seqs": 256},
                                              attempts=[{"ok": True}]),
                          phases=[{"name": "engine", "start": 1.0, "end": 2.5}])
    return plan, filtered, scores, fetched, quantized, shard


def _summary_as_publish_wrote_it(tmp_path) -> dict:
    """summary.json as publish built it before the model: a dict of the manifests' JSON, key for key."""
    plan, filtered, scores, fetched, quantized, shard = _manifests(tmp_path)
    cfg = parse_config({"name": "pub", "model": {"ref": "org/m"}, "input": {"path": str(tmp_path / "in.jsonl")},
                        "output": {"path": str(tmp_path / "out")}})
    summary = {"pipeline": "pub", "run_id": "manual__1", "partition": "dt=2026-12-03", "rows_published": 2,
               "format": "jsonl", "dataset": "v-1/data.jsonl", "errors": "v-1/errors.jsonl",
               "config": cfg.model_dump(mode="json"),
               "manifests": {"plan": plan.model_dump(mode="json"), "filter": filtered.model_dump(mode="json"),
                             "evaluate": scores.model_dump(mode="json"), "fetch": fetched.model_dump(mode="json"),
                             "quantize": quantized.model_dump(mode="json"),
                             "infer": [shard.model_dump(mode="json")]},
               "published_at": dt.datetime.now(dt.timezone.utc).isoformat()}
    summary["usage"] = TokenUsage.of_shards([ShardResult.of(shard)]).model_dump()
    summary["report"] = "v-1/report.html"
    return summary


def test_a_summary_written_before_the_model_reads_and_writes_back_the_same(tmp_path):
    old = _summary_as_publish_wrote_it(tmp_path)
    write_json(Location(str(tmp_path / "v-1")).child("summary.json").path(), old)
    s = RunSummary.read(Location(str(tmp_path / "v-1")).path())
    assert isinstance(s.manifests.plan, PlanManifest) and isinstance(s.manifests.fetch, FetchManifest)
    assert isinstance(s.manifests.shards[0], ShardManifest) and s.manifests.shards[0].engine.kind == "vllm"
    assert s.manifests.shards[0].phases[0].end == 2.5
    assert s.usage == TokenUsage(prompt_tokens=20, cached_prompt_tokens=4, completion_tokens=8)
    assert s.published_at.tzinfo is not None and s.published_at.isoformat() == old["published_at"]
    assert json.dumps(s.model_dump(mode="json")) == json.dumps(old)     # same keys, same order, same values
    again = RunSummary.model_validate_json(json.dumps(s.model_dump(mode="json")))
    assert again == s


def test_shards_handed_on_through_xcom_and_stages_left_out(tmp_path):
    """The shards as their XCom hand-offs (engine: its kind only) read as ShardResult; a summary published without
    fetch, quantize or shards leaves those keys out, as before."""
    old = _summary_as_publish_wrote_it(tmp_path)
    shard = old["manifests"]["infer"][0]
    old["manifests"]["infer"] = [ShardResult.of(shard).model_dump(mode="json")]
    s = RunSummary.model_validate(old)
    assert isinstance(s.manifests.shards[0], ShardResult) and s.manifests.shards[0].engine == "vllm"
    assert s.model_dump(mode="json") == old
    for stage in ("fetch", "quantize", "infer"):
        del old["manifests"][stage]
    s = RunSummary.model_validate(old)
    assert s.manifests.shards == [] and s.manifests.fetch is None
    assert list(s.model_dump(mode="json")["manifests"]) == ["plan", "filter", "evaluate"]
    assert s.model_dump(mode="json") == old


def test_publish_writes_the_summary_model(tmp_path):
    from batch_llm.api import publish
    from batch_llm.layout import RunLayout

    plan, filtered, scores, fetched, quantized, shard = _manifests(tmp_path)
    cfg = parse_config({"name": "pub", "model": {"ref": "org/m"}, "input": {"path": str(tmp_path / "in.jsonl")},
                        "output": {"path": str(tmp_path / "out")}})
    layout = RunLayout.for_run(cfg, run_id="t1", ds="2026-12-03")
    plan_dir, filt_dir = layout.stage("plan"), layout.stage("filter")
    write_jsonl(plan_dir.child("records.jsonl").path(),
                [{"idx": i, "id": k, "reference": None, "record": {"id": k, "prompt": "hi"}} for i, k in enumerate("ab")])
    write_jsonl(plan_dir.child("errors.jsonl").path(), [])
    write_jsonl(filt_dir.child("outputs.jsonl").path(), [{"id": k, "idx": i, "output": "hello", "prompt_tokens": 10,
                                                          "completion_tokens": 4, "finish_reason": "stop"}
                                                         for i, k in enumerate("ab")])
    write_jsonl(filt_dir.child("errors.jsonl").path(), [])
    plan = plan.model_copy(update={"records": plan_dir.child("records.jsonl").url,
                                   "errors": plan_dir.child("errors.jsonl").url})
    filtered = filtered.model_copy(update={"outputs": filt_dir.child("outputs.jsonl").url,
                                           "inference_errors": filt_dir.child("errors.jsonl").url})
    m = publish(cfg, layout, plan, filtered, scores,
                extra_manifests={"fetch": fetched, "quantize": quantized, "infer": [shard]})
    written = read_json(Location(m.summary).path())
    assert list(written) == PUBLISHED_KEYS
    assert list(written["manifests"]) == ["plan", "filter", "evaluate", "fetch", "quantize", "infer"]
    s = RunSummary.read(Location(m.summary).path())
    assert s.model_dump(mode="json") == written
    assert (s.pipeline, s.run_id, s.partition, s.rows_published, s.format) == ("pub", "t1", layout.partition, 2, "jsonl")
    assert s.manifests.plan == plan and s.manifests.filter == filtered and s.manifests.evaluate == scores
    assert s.manifests.fetch == fetched and s.manifests.quantize == quantized and s.manifests.shards == [shard]
    assert s.usage == m.usage == TokenUsage(prompt_tokens=20, cached_prompt_tokens=4, completion_tokens=8)
    assert s.report == m.report and s.dataset == m.dataset and s.errors == m.errors
    assert s.config == cfg.model_dump(mode="json")
    current = read_json(layout.published.child("_CURRENT.json").path())
    assert current["committed_at"] == written["published_at"] == s.published_at.isoformat()
