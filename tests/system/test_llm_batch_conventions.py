"""common-ai's batch conventions on this project's engines: ``GPULLMBatchOperator`` / ``@task.gpu_llm_batch``.

The names and values compared against are apache-airflow-providers-common-ai 1.0.0's (``batch/results.py``:
the row keys, the statuses, ``assemble_manifest``'s keys and buckets, ``schema_version`` 1; ``batch/state.py``:
the identity key). That the two providers install side by side, and the example DAG parses with either
backend, is checked in tests/system/test_provider_wheel.py (one venv for both).

- The example DAG (``dags/example_llm_batch_switch.py``) through ``dag.test()`` on the transformers engine:
  both batches land rows and manifests in common-ai's shape, common-ai's own result reader runs on them, a
  structured answer that cannot match ``output_type`` is an ``invalid_output`` row (not a failed task), and a
  second run of the same DAG run (what a clear does) re-attaches: a shard whose results were lost resumes from
  its committed chunks and generates nothing.
- Without an engine: every outcome bucket from requests refused at prepare and by the planner and from shard
  rows (valid, invalid for pydantic only, invalid in the shard, engine errors, lost), merged over shards in
  index order; re-attaching and starting fresh; what is refused when the DAG is parsed; the dependencies.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, field_validator

ROOT = Path(__file__).resolve().parents[2]

# common-ai 1.0.0, batch/results.py: a result row's keys, and assemble_manifest()'s keys and buckets.
COMMON_AI_ROW_KEYS = {"custom_id", "index", "status", "output", "raw_output", "error", "model", "usage",
                      "finish_reason"}
COMMON_AI_MANIFEST_KEYS = {"schema_version", "batch_id", "adapter", "llm_conn_id", "model_id", "output_type_ref",
                           "structured", "result_uri", "request_count", "counts", "duplicate_result_count",
                           "out_of_range_result_count", "ordered", "rejoin_key", "custom_id_prefix",
                           "terminal_reason", "submitted_at", "completed_at"}
COMMON_AI_BUCKETS = ["succeeded", "errored", "invalid_output", "expired", "cancelled", "missing"]
RUN_AFTER = dt.datetime(2026, 11, 5, 1, tzinfo=dt.timezone.utc)


def common_ai_key16(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> str:
    """common-ai's batch/state.py compute_identity_key() + key16(), written out."""
    return hashlib.sha256("\x00".join([dag_id, task_id, run_id, str(map_index)]).encode()).hexdigest()[:16]


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def _manifests(dr) -> dict[str, dict]:
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    return {t: tis[t].xcom_pull(task_ids=t) for t in ("classify_reviews", "build_summary_requests",
                                                        "summarize_manifest", "summarize_summaries", "count_mapped")}


# ------------------------------------------------------------------------------------------ the real run
@pytest.mark.timeout(900)
def test_example_dag_lands_like_common_ai_and_a_rerun_reattaches(tmp_path, airflow_db, demo_model_dir):
    sys.path.insert(0, str(ROOT / "dags"))
    from example_llm_batch_switch import REVIEWS, Sentiment, build_dag

    # The cheap real engine; 4 output tokens: no Sentiment object fits, so every answer is invalid_output.
    dag = build_dag(result_root=str(tmp_path / "results"), gpu_overrides={
        "engine.kind": "transformers", "sampling.max_tokens": 4, "sharding.num_shards": 1})
    dr = dag.test(run_after=RUN_AFTER, logical_date=RUN_AFTER)
    assert str(dr.state).endswith("success"), dr.state
    m = _manifests(dr)
    classify, summaries = m["classify_reviews"], m["build_summary_requests"]
    for manifest, task_id in ((classify, "classify_reviews"), (summaries, "build_summary_requests")):
        assert set(manifest) == COMMON_AI_MANIFEST_KEYS | {"batch_llm"}, manifest
        assert manifest["schema_version"] == 1 and list(manifest["counts"]) == COMMON_AI_BUCKETS
        assert manifest["request_count"] == len(REVIEWS) == sum(manifest["counts"].values())
        key16 = common_ai_key16(dag.dag_id, task_id, dr.run_id)
        assert manifest["custom_id_prefix"] == key16 and manifest["result_uri"].endswith(f"/{key16}.jsonl")
        rows = _rows(manifest["result_uri"])
        assert [r["index"] for r in rows] == list(range(len(REVIEWS)))
        assert [r["custom_id"] for r in rows] == [f"{key16}-{i}" for i in range(len(REVIEWS))]
        assert all(set(r) == COMMON_AI_ROW_KEYS for r in rows), rows[0]
        assert all(r["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and r["usage"]["output_tokens"] <= 4
                   for r in rows)

    assert classify["structured"] and classify["output_type_ref"] == f"{Sentiment.__module__}.Sentiment"
    assert classify["counts"]["invalid_output"] == 4 and classify["terminal_reason"] == "partial"
    for r in _rows(classify["result_uri"]):
        assert r["status"] == "invalid_output" and r["output"] is None and r["raw_output"] is not None
        assert r["error"]["type"] == "output_validation_error" and r["error"]["stage"] == "output_validation"
    assert not summaries["structured"] and summaries["counts"]["succeeded"] == 4
    assert summaries["terminal_reason"] == "succeeded"
    assert all(isinstance(r["output"], str) and r["output"] for r in _rows(summaries["result_uri"]))
    # common-ai's own reader (howto_operator_llm_batch_read_results), run on the GPU batch's manifests
    assert m["summarize_manifest"] == {"status:invalid_output": 4}
    assert m["summarize_summaries"] == {"text": 4, "status:succeeded": 4}
    assert classify["batch_llm"]["engine"] == "transformers" and not classify["batch_llm"]["reattached"]

    # The same decorated task mapped (.override(task_id=...).expand(reviews=[2 groups])): one batch per map index,
    # each named by common-ai's identity of that task instance (its map index in the key), its own result file.
    groups = _mapped_manifests(dr, "summaries_by_group")
    assert [g["request_count"] for g in groups] == [2, 2]
    for i, g in enumerate(groups):
        key16 = common_ai_key16(dag.dag_id, "summaries_by_group", dr.run_id, i)
        assert set(g) == COMMON_AI_MANIFEST_KEYS | {"batch_llm"} and g["custom_id_prefix"] == key16
        assert g["result_uri"].endswith(f"/{key16}.jsonl") and g["counts"]["succeeded"] == 2
        assert [r["custom_id"] for r in _rows(g["result_uri"])] == [f"{key16}-0", f"{key16}-1"]
    mapped_counts = m["count_mapped"]
    assert mapped_counts == {"batches": 2, "requests": 4, "result_uris": [g["result_uri"] for g in groups]}

    # A clear of the run: the shard's merged results and the landing are lost, its committed chunks are not.
    first_rows = _rows(classify["result_uri"])
    run_dir = Path(classify["batch_llm"]["run_dir"])
    shard = run_dir / "infer" / "shard-00000"
    chunks = sorted(p.name for p in (shard / "chunks").iterdir())
    for f in ("manifest.json", "outputs.jsonl", "errors.jsonl"):
        (shard / f).unlink()
    (run_dir / "land" / "manifest.json").unlink()
    dr2 = dag.test(run_after=RUN_AFTER, logical_date=RUN_AFTER)
    assert str(dr2.state).endswith("success") and dr2.run_id == dr.run_id
    m2 = _manifests(dr2)
    again = m2["classify_reviews"]
    assert again["batch_llm"]["reattached"] and again["batch_llm"]["run_dir"] == str(run_dir)
    assert _rows(again["result_uri"]) == first_rows and again["counts"] == classify["counts"]
    resumed = json.loads((shard / "manifest.json").read_text())["metrics"]
    assert resumed["output_tokens_this_attempt"] == 0, resumed       # resumed from the chunks: nothing generated
    assert sorted(p.name for p in (shard / "chunks").iterdir()) == chunks
    assert m2["build_summary_requests"] == summaries  # landed before: returned as it was (same completed_at)
    assert m2["count_mapped"] == mapped_counts


def _mapped_manifests(dr, task_id: str) -> list[dict]:
    tis = sorted((ti for ti in dr.get_task_instances() if ti.task_id == task_id), key=lambda ti: ti.map_index)
    return [ti.xcom_pull(task_ids=task_id, map_indexes=ti.map_index) for ti in tis]


# ------------------------------------------------------------------------------------------ no engine
class Opinion(BaseModel):
    label: Literal["positive", "negative"]
    score: float

    @field_validator("score")
    @classmethod
    def _unit(cls, v: float) -> float:  # a rule JSON Schema does not carry: only pydantic sees it
        if not 0 <= v <= 1:
            raise ValueError("score must be in [0, 1]")
        return v


def _prepared(tmp_path, requests, *, overrides=None, request_params=None):
    from batch_llm import api
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm.io.storage import Location

    out = llm_batch.OutputType.of(Opinion)
    cfg = llm_batch.batch_config(name="opinions", model_id="/models/any", result_path=str(tmp_path / "res"),
                                 max_tokens=32, output=out, overrides={"engine.kind": "transformers",
                                                                       "sharding.rows_per_shard": 2, **(overrides or {})})
    key = llm_batch.identity_key(dag_id="d", task_id="opinions", run_id="r")
    batch = llm_batch.prepare(cfg, Location(str(tmp_path / "res")).child(llm_batch.STATE_DIR), key=key,
                              requests=llm_batch.normalize_requests(requests), system_prompt="Rate it.",
                              request_params=request_params)
    return batch, api.plan_shards(batch.config, batch.layout), out


def _commit_shard(batch, spec, rows: list[dict]) -> None:
    """What a finished shard leaves: outputs.jsonl, errors.jsonl (each in input order) and its manifest."""
    d = Path(batch.layout.stage("infer").child(f"shard-{spec.index:05d}").url)
    d.mkdir(parents=True)
    ok = [r for r in rows if not r.get("error")]
    bad = [r for r in rows if r.get("error")]
    for name, part in (("outputs.jsonl", ok), ("errors.jsonl", bad)):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    (d / "manifest.json").write_text(json.dumps({"shard": spec.index, "metrics": {"rows": len(rows)}}))


def _shard_row(custom_id: str, text: str | None, error: str | None = None, kind: str | None = None) -> dict:
    return {"id": custom_id, "output": text, "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 7,
            "error": error, **({"error_kind": kind} if kind else {})}


def test_every_bucket_lands_in_index_order_over_shards(tmp_path):
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm.io.storage import Location

    requests = ["good", {"prompt": "range", "max_tokens": 8}, "shard said invalid", "engine failed",
                {"prompt": "penalty", "params": {"presence_penalty": 0.5}},     # transformers: refused by the plan
                {"prompt": "effort", "params": {"reasoning_effort": "low"}},     # no such sampling parameter
                "lost", "good too"]
    batch, plan, out = _prepared(tmp_path, requests, request_params={"temperature": 0.0, "user": "me"})
    assert batch.manifest.request_count == 8 and batch.manifest.refused_count == 1
    lines = [json.loads(x) for x in Path(batch.manifest.requests).read_text().splitlines()]
    first = lines[0]["body"]
    assert first["messages"] == [{"role": "system", "content": "Rate it."}, {"role": "user", "content": "good"}]
    assert first["max_tokens"] == 32 and first["temperature"] == 0.0 and "user" not in first
    assert lines[1]["body"]["max_tokens"] == 8
    assert plan.invalid == 1 and len(plan.shards) == 3  # 6 planned, 2 per shard: the batch fans out
    p = batch.manifest.key16
    by_shard = {0: [_shard_row(f"{p}-0", '{"label": "positive", "score": 0.9}'),
                    _shard_row(f"{p}-1", '{"label": "negative", "score": 7}')],
                1: [_shard_row(f"{p}-2", '{"label": "meh"', "invalid_output: not JSON", "invalid_output"),
                    _shard_row(f"{p}-3", None, "request refused by the engine")],
                2: [_shard_row(f"{p}-7", '{"label": "negative", "score": 0.1}')]}   # request 6 never came back
    for spec in plan.shards:
        _commit_shard(batch, spec, by_shard[spec.index])
    result = Location(str(tmp_path / "res")).child(f"{p}.jsonl")
    m = llm_batch.land(batch.config, batch.layout, batch.manifest, out, result=result, result_uri=result.url)

    assert m.counts.model_dump() == {"succeeded": 2, "errored": 3, "invalid_output": 2, "expired": 0, "cancelled": 0,
                                     "missing": 1}
    assert m.schema_version == 1 and m.request_count == 8 and m.terminal_reason == "partial" and m.ordered
    assert m.batch_llm.shards == 3 and m.partial_buckets() == {"errored": 3, "invalid_output": 2, "missing": 1}
    rows = _rows(result.url)
    assert [r["index"] for r in rows] == list(range(8)) and all(set(r) == COMMON_AI_ROW_KEYS for r in rows)
    by = {r["index"]: r for r in rows}
    assert by[0]["status"] == "success" and by[0]["output"] == {"label": "positive", "score": 0.9}
    assert by[0]["usage"] == {"input_tokens": 5, "output_tokens": 7}
    assert by[1]["status"] == "invalid_output" and "score must be in [0, 1]" in by[1]["error"]["message"]
    assert by[1]["raw_output"] == '{"label": "negative", "score": 7}'
    assert by[2]["status"] == "invalid_output" and by[2]["error"]["message"] == "not JSON"
    assert by[3]["error"] == {"type": "provider_error", "message": "request refused by the engine",  # common-ai's
                              "provider_code": None, "stage": "provider"}
    assert by[4]["error"]["stage"] == "plan" and "presence_penalty" in by[4]["error"]["message"]
    assert by[5]["error"]["stage"] == "prepare" and "reasoning_effort" in by[5]["error"]["message"]
    assert by[6]["status"] == "missing" and by[6]["custom_id"] == f"{p}-6"
    assert by[7]["status"] == "success"
    # landed once: a retry gets the same manifest back
    assert llm_batch.land(batch.config, batch.layout, batch.manifest, out, result=result, result_uri=result.url) == m

    # the landing task: the manifest is its return value; fail_on_partial_error fails it with common-ai's
    # LLMBatchPartialFailureError (retryable, as common-ai's: a retry lands the same results and raises again)
    from batch_llm_airflow.llm_batch import BatchRef, GPUBatchLandOperator, LLMBatchPartialFailureError

    ref = BatchRef(result_path=str(tmp_path / "res"), key16=p, fingerprint=batch.manifest.fingerprint,
                   reattached=False).model_dump()
    lenient = GPUBatchLandOperator(task_id="lenient", batch=ref, output_type=Opinion, pipeline_config={})
    assert lenient.execute({}) == m.model_dump(mode="json")
    strict = GPUBatchLandOperator(task_id="strict", batch=ref, output_type=Opinion, fail_on_partial_error=True,
                                  pipeline_config={})
    for _attempt in range(2):
        with pytest.raises(LLMBatchPartialFailureError, match="errored=3, invalid_output=2, missing=1"):
            strict.execute({})
    assert issubclass(LLMBatchPartialFailureError, RuntimeError)  # not AirflowFailException: retries apply


def test_requests_from_a_file_are_streamed_and_bad_rows_land_as_errors(tmp_path):
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm.io.storage import Location

    src = tmp_path / "requests.jsonl"
    src.write_text('{"id": 7, "prompt": "a", "max_tokens": 16}\n{"prompt": "b", "max_tokens": "many"}\nnot json\n'
                   '{"prompt": "c", "system_prompt": "Be brief.", "params": {"temperature": 0.3}}\n')
    cfg = llm_batch.batch_config(name="f", model_id="/models/any", result_path=str(tmp_path / "res"), max_tokens=32,
                                 output=llm_batch.OutputType.of(str), overrides={"engine.kind": "transformers"})
    batch = llm_batch.prepare(cfg, Location(str(tmp_path / "res")).child(llm_batch.STATE_DIR), key="f" * 64,
                              requests=llm_batch.requests_from_file(Location(str(src))))
    assert (batch.manifest.request_count, batch.manifest.refused_count) == (4, 2)
    refused = [json.loads(x) for x in Path(batch.manifest.refused).read_text().splitlines()]
    assert [r["index"] for r in refused] == [1, 2] and "requests.jsonl line 2: max_tokens" in refused[0]["reason"]
    bodies = [json.loads(x)["body"] for x in Path(batch.manifest.requests).read_text().splitlines()]
    assert bodies[0]["max_tokens"] == 16 and bodies[1]["temperature"] == 0.3
    assert bodies[1]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_same_input_reattaches_and_changed_input_starts_fresh(tmp_path):
    first, _, _ = _prepared(tmp_path, ["a", "b"])
    again, _, _ = _prepared(tmp_path, ["a", "b"])
    changed, _, _ = _prepared(tmp_path, ["a", "c"])
    other_cfg, _, _ = _prepared(tmp_path, ["a", "b"], overrides={"sampling.temperature": 0.5})
    assert not first.reattached and again.reattached
    assert again.layout.run_dir == first.layout.run_dir and again.manifest == first.manifest
    assert len({b.layout.run_dir.url for b in (first, changed, other_cfg)}) == 3
    assert first.manifest.key16 == changed.manifest.key16  # one task instance, another input


def test_refused_when_the_batch_cannot_run():
    from airflow.sdk import DAG
    from batch_llm.frontends import common_ai as llm_batch
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator

    for bad in ("one prompt", {"prompt": "x"}, [], [{"promt": "x"}]):
        with pytest.raises(llm_batch.LLMBatchInputError):
            llm_batch.normalize_requests(bad)
    assert "'reasoning_effort': not a sampling parameter" in llm_batch.request_params_problem({"reasoning_effort": 1})
    assert llm_batch.request_params_problem({"temperature": 0.2, "user": "u", "model": "m"}) is None
    with pytest.raises(llm_batch.LLMBatchInputError, match="one model serves a batch"):
        llm_batch.request_problem(llm_batch.BatchRequest(prompt="x", model="openai:gpt-5"), "Qwen/Qwen2.5-7B")
    args = dict(task_id="t", requests=["x"], result_path="/tmp/r")
    with DAG("refusals", start_date=dt.datetime(2026, 1, 1), schedule=None):
        with pytest.raises(TypeError, match="llm_conn_id: there is no API connection"):
            GPULLMBatchOperator(**args, model_id="m", llm_conn_id="pydanticai_default")
        with pytest.raises(llm_batch.LLMBatchInputError, match="names a hosted model"):
            GPULLMBatchOperator(**args, model_id="openai:gpt-5-mini")
        with pytest.raises(llm_batch.LLMBatchInputError, match="has no JSON Schema"):
            GPULLMBatchOperator(**args, model_id="m", output_type=type("Plain", (), {}))  # not a pydantic type
        with pytest.raises(TypeError, match="requests or input_path"):
            GPULLMBatchOperator(task_id="t", result_path="/tmp/r", model_id="m")


def test_dependencies_and_task_ids_are_common_ais():
    """``start >> batch >> end`` spans the whole batch for the operator and the decorator; the manifest is the
    XCom of the task id given; the shards are mapped on the GPU pool and queue; ``@task.gpu_llm_batch`` comes
    from the provider's task-decorators."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG, task
    from batch_llm_airflow.get_provider_info import get_provider_info
    from batch_llm_airflow.llm_batch import GPULLMBatchOperator, gpu_llm_batch_task

    assert get_provider_info()["task-decorators"] == [
        {"name": "gpu_llm_batch", "class-name": "batch_llm_airflow.llm_batch.gpu_llm_batch_task"}]
    kw = dict(result_path="/tmp/r/{{ run_id }}", model_id="/models/m", config_overrides={"engine.kind": "transformers"})
    with DAG("deps", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        start, end = EmptyOperator(task_id="start"), EmptyOperator(task_id="end")
        op = GPULLMBatchOperator(task_id="classify", requests=["x"], output_type=Opinion, **kw)
        start >> op >> end

        @task.gpu_llm_batch(**kw)
        def build(rows: list[str]) -> list[str]:
            return rows

        start >> build(["y"]) >> end
    assert task.gpu_llm_batch is gpu_llm_batch_task
    for name in ("classify", "build"):
        assert dag.get_task(f"{name}.plan_shards").upstream_task_ids == {"start"}
        assert dag.get_task(name).downstream_task_ids == {"end"} and name in end.upstream_task_ids
        infer = dag.get_task(f"{name}.batch_inference")
        assert type(infer).__name__ == "MappedOperator" and (infer.pool, infer.queue) == ("gpu", "gpu")
    assert op.task_id == "classify" and op.output.operator is dag.get_task("classify")
