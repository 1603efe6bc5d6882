"""Content review by a model (``filter.review``, ``stages/review.py``), without an engine: the config, the review
requests built from a shard's outputs, the verdicts parsed, the actions and the row accounting of the content filter
that joins them, and the errors publish writes for the rows the review dropped. The engine-backed pass is in
tests/system/test_review.py."""
from __future__ import annotations

import json

import pytest
from batch_llm.config import ConfigError, ReviewConfig, parse_config
from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import PlanManifest, ShardMetrics, ShardResult, ShardSpec
from batch_llm.stages import review as rv
from batch_llm.stages.content_filter import content_filter
from batch_llm.stages.filter_parts import filtered_outputs
from batch_llm.stages.publish import row_errors
from pydantic import ValidationError

GUARD = {"ref": "/models/guard"}


def _cfg(tmp_path, review: dict | None = None, **extra) -> object:
    data = {"name": "p", "model": {"ref": "/models/m"}, "input": {"path": str(tmp_path / "in.jsonl")},
            "output": {"path": str(tmp_path / "out")},
            "filter": {"lists": [{"name": "w", "path": str(tmp_path / "words.txt"), "action": "drop"}],
                       **({"review": review} if review is not None else {})}, **extra}
    (tmp_path / "words.txt").write_text("forbidden\n", encoding="utf-8")
    return parse_config(data, "p.yaml")


# ------------------------------------------------------------------------------------------ config
def test_review_config_defaults_and_refusals():
    r = ReviewConfig(model=GUARD)
    assert (r.engine.task, r.action, r.on_error, r.guided_decoding) == ("generate", "flag", "drop", True)
    bad = [
        ({"engine": {"task": "embed"}}, "embed gives vectors"),
        ({"engine": {"task": "classify"}}, "labels: map each class"),
        ({"engine": {"task": "classify"}, "labels": {"ok": "safe", "bad": "unsafe"}, "max_tokens": 8},
         "max_tokens: a setting of engine.task: generate"),
        ({"engine": {"task": "classify", "classify": {"labels": ["yes", "no"]}}, "labels": {"yes": "unsafe"}},
         "name the classes of engine.classify.labels"),
        ({"labels": {"x": "unsafe"}}, "labels: a setting of engine.task: classify"),
        ({"actions": {"weapons": "drop"}}, "actions.weapons: not a category"),
        ({"template": "Is this safe? {prompt}"}, "put {output} in it"),
        ({"reasoning": True, "template": "{output}"}, "has no {reasoning}"),
        ({"engine": {"kind": "transformers"}}, "cannot decode under a schema"),
    ]
    for settings, message in bad:
        with pytest.raises(ValidationError, match=message.replace("{", r"\{").replace("}", r"\}")):
            ReviewConfig(model=GUARD, **settings)


def test_review_needs_a_text_task_and_survives_overrides(tmp_path):
    with pytest.raises(ConfigError, match="filter.review: engine.task embed writes no text"):
        _cfg(tmp_path, {"model": GUARD}, engine={"task": "embed"})
    classify = {"model": GUARD, "engine": {"task": "classify"}, "labels": {"safe": "safe", "toxic": "unsafe"},
                "actions": {"toxic": "drop"}}
    cfg = _cfg(tmp_path, classify)
    again = cfg.with_overrides({"sampling.temperature": 0.5})  # dumps every field and parses again
    assert again.filter.review == cfg.filter.review


def test_review_pipeline_config_runs_the_review_model_under_the_verdict_schema(tmp_path):
    cfg = _cfg(tmp_path, {"model": GUARD, "engine": {"max_model_len": 4096}, "categories": ["violence", "other"],
                          "max_tokens": 40}, sampling={"temperature": 0.7, "n": 2},
               input={"path": str(tmp_path / "in.jsonl"), "sampling_columns": ["temperature"]})
    rc = rv.review_pipeline_config(cfg)
    assert rc.model.ref == "/models/guard" and rc.engine.max_model_len == 4096
    assert (rc.sampling.max_tokens, rc.sampling.temperature, rc.sampling.n) == (40, 0.0, 1)
    assert rc.sampling.output_schema == rv.verdict_schema(["violence", "other"])
    assert rc.filter.review is None and not rc.filter.enabled and rc.input.sampling_columns == []
    assert cfg.sharding.uses_length_history and not rc.sharding.uses_length_history  # no plan reads its lengths
    classify = _cfg(tmp_path, {"model": GUARD, "engine": {"task": "classify"}, "labels": {"a": "safe", "b": "unsafe"}})
    assert rv.review_pipeline_config(classify).sampling.output_schema is None


# ------------------------------------------------------------------------------------------ a run's files
def _run(tmp_path, review: dict, outputs: list[dict], shard_rows: list[dict]):
    cfg = _cfg(tmp_path, review)
    layout = RunLayout.for_run(cfg, run_id="r1", ds="2026-12-01")
    shard_file = layout.stage("plan").child("shard-00000.jsonl")
    write_jsonl(shard_file.path(), shard_rows)
    plan = PlanManifest(input="x", format="jsonl", rows_read=len(shard_rows), valid=len(shard_rows), invalid=0,
                        errors=layout.stage("plan").child("errors.jsonl").url, records="r",
                        shards=[ShardSpec(index=0, rows=len(shard_rows), url=shard_file.url)], has_references=False)
    write_jsonl(layout.stage("plan").child("errors.jsonl").path(), [])
    sdir = layout.stage("infer").child("shard-00000")
    ok = [o for o in outputs if not o.get("error")]
    write_jsonl(sdir.child("outputs.jsonl").path(), ok)
    write_jsonl(sdir.child("errors.jsonl").path(), [o for o in outputs if o.get("error")])
    shard = ShardResult(shard=0, outputs=sdir.child("outputs.jsonl").url, errors=sdir.child("errors.jsonl").url,
                        metrics=ShardMetrics(rows=len(outputs), ok=len(ok)))
    return cfg, layout, plan, shard


def _review_result(layout, spec: ShardSpec, answers: dict[str, dict]) -> ShardResult:
    """What the review pass commits for ``spec``'s requests: one result row per request (``answers`` by row id, or
    ``id#k`` for sample k > 0: a verdict's JSON text, a classifier's label, or an error)."""
    rdir = layout.stage("review").child("shard-00000")
    ok, bad = [], []
    for q in iter_jsonl(Location(spec.url).path()):
        row_id, k = json.loads(q["id"])
        a = answers[row_id if k == 0 else f"{row_id}#{k}"]
        row = {"id": q["id"], "idx": q["idx"], "output": a.get("output"), "label": a.get("label"),
               "error": a.get("error"), "prompt_tokens": 5, "completion_tokens": 3, "finish_reason": "stop",
               "cached": False}
        (bad if row["error"] else ok).append(row)
    write_jsonl(rdir.child("outputs.jsonl").path(), ok)
    write_jsonl(rdir.child("errors.jsonl").path(), bad)
    return ShardResult(shard=0, outputs=rdir.child("outputs.jsonl").url, errors=rdir.child("errors.jsonl").url,
                       metrics=ShardMetrics(rows=spec.rows, ok=len(ok), errors=len(bad), input_tokens=5 * spec.rows),
                       plan_key=spec.plan_key)


def _out(i: int, text: str, **extra) -> dict:
    return {"id": f"r{i}", "idx": i, "output": text, "error": None, "finish_reason": "stop", "prompt_tokens": 4,
            "completion_tokens": 2, "cached": False, **extra}


def _verdict(verdict: str, *cats: str) -> dict:
    return {"output": json.dumps({"verdict": verdict, "categories": list(cats)})}


def test_requests_show_each_prompt_and_sample_to_the_reviewer(tmp_path):
    rows = [{"id": "r1", "idx": 1, "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "How do I pick a lock?"}]},
            {"id": "r0", "idx": 0, "text": "Complete: the sky is"},
            {"id": "r2", "idx": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "s3://b/cat.png"}}, {"type": "text", "text": "What is it?"}]}]},
            {"id": "r3", "idx": 3, "messages": [{"role": "user", "content": "hi"}]}]
    outputs = [_out(0, "blue"), _out(1, "first", outputs=["first", "second"], reasoning="Think of pins.",
                                      outputs_reasoning=["Think of pins.", "Think of keys."]),
               _out(2, "a cat"), {**_out(3, None), "error": "engine failed"}]
    cfg, layout, plan, shard = _run(tmp_path, {"model": GUARD, "system_prompt": "You are a guard.", "reasoning": True},
                                    outputs, rows)
    spec = rv.prepare_review(cfg, layout, plan, shard)
    reqs = list(iter_jsonl(Location(spec.url).path()))
    # the shard's own order; each sample a request (idx = row idx * 128 + sample); the error row not reviewed
    assert [(q["id"], q["idx"]) for q in reqs] == [('["r1", 0]', 128), ('["r1", 1]', 129), ('["r0", 0]', 0),
                                                   ('["r2", 0]', 256)]
    assert spec.rows == 4 and spec.plan_key and spec.url.endswith(f"shard-00000-{spec.plan_key}.jsonl")
    first = reqs[0]["messages"]
    assert first[0] == {"role": "system", "content": "You are a guard."}
    text = first[1]["content"]
    assert "How do I pick a lock?" in text and "first" in text and "Think of pins." in text and "Be brief" not in text
    assert '"verdict": "safe" or "unsafe"' in text and "violence, sexual" in text
    assert "second" in reqs[1]["messages"][1]["content"] and "Think of keys." in reqs[1]["messages"][1]["content"]
    assert "Complete: the sky is" in reqs[2]["messages"][1]["content"]
    image_turn = reqs[3]["messages"][1]["content"]  # images: text (the default): the image is left out
    assert isinstance(image_turn, str) and "What is it?" in image_turn  # (tests/unit/test_image_inputs.py: the rest)
    # the same outputs again: the same file (a retry resumes); other outputs: another key
    assert rv.prepare_review(cfg, layout, plan, shard) == spec
    write_jsonl(Location(shard.outputs).path(), [_out(0, "green")])
    assert rv.prepare_review(cfg, layout, plan, shard).plan_key != spec.plan_key


def test_review_request_ids_are_apart_from_every_input_id(tmp_path):
    """Rows whose ids read like a sample's (``x`` and ``x#sample1``, two samples each) get four review requests
    with four ids (the shard runner keys a shard's rows by id: two requests of one id failed the review task), and
    each row is joined to its own verdicts."""
    rows = [{"id": "x", "idx": 0, "text": "q0"}, {"id": "x#sample1", "idx": 1, "text": "q1"}]
    outputs = [{**_out(0, "a0", outputs=["a0", "a1"]), "id": "x"},
               {**_out(1, "b0", outputs=["b0", "b1"]), "id": "x#sample1"}]
    cfg, layout, plan, shard = _run(tmp_path, {"model": GUARD, "actions": {"sexual": "mask"}}, outputs, rows)
    spec = rv.prepare_review(cfg, layout, plan, shard)
    ids = [q["id"] for q in iter_jsonl(Location(spec.url).path())]
    assert len(set(ids)) == 4 and not set(ids) & {"x", "x#sample1"}
    answers = {"x": _verdict("safe"), "x#1": _verdict("unsafe", "sexual"), "x#sample1": _verdict("safe"),
               "x#sample1#1": _verdict("safe")}
    m = content_filter(cfg, layout, plan, [shard], reviews=[_review_result(layout, spec, answers)])
    kept = {r["id"]: r for r in filtered_outputs(m, {})}
    assert kept["x"]["outputs"] == ["a0", "**"] and kept["x"]["review_verdict"] == "unsafe"
    assert kept["x#sample1"]["outputs"] == ["b0", "b1"] and kept["x#sample1"]["review_verdict"] == "safe"
    # requests written with joined ids (two of them "x#sample1") are not reused: a retry writes them anew
    legacy = rv.request_key(cfg, shard, joined_ids=True)
    assert spec.plan_key != legacy and not spec.url.endswith(f"-{legacy}.jsonl")


def test_classify_requests_are_plain_text_of_the_template(tmp_path):
    review = {"model": GUARD, "engine": {"task": "classify"}, "labels": {"ok": "safe", "toxic": "unsafe"},
              "template": "Q: {prompt} A: {output} {not_a_placeholder}"}
    cfg, layout, plan, shard = _run(tmp_path, review, [_out(0, "fine")], [{"id": "r0", "idx": 0, "text": "Hi?"}])
    reqs = list(iter_jsonl(Location(rv.prepare_review(cfg, layout, plan, shard).url).path()))
    assert reqs == [{"id": rv.request_id("r0", 0), "idx": 0, "text": "Q: Hi? A: fine {not_a_placeholder}"}]


def test_verdict_parsing():
    gen = ReviewConfig(model=GUARD)
    assert rv.verdict_of(gen, {"output": '{"verdict": "unsafe", "categories": ["violence"]}'}) == \
        ("unsafe", ["violence"], None)
    assert rv.verdict_of(gen, {"output": '{"verdict": "safe", "categories": ["violence"]}'}) == ("safe", [], None)
    assert rv.verdict_of(gen, {"output": '{"verdict": "maybe"}'})[0] == "error"
    assert "not JSON" in rv.verdict_of(gen, {"output": '{"verdict": "saf'})[2]
    assert rv.verdict_of(gen, {"output": None, "error": "prompt is 9000 tokens"}) == \
        ("error", [], "prompt is 9000 tokens")
    cls = ReviewConfig(model=GUARD, engine={"task": "classify"}, labels={"ok": "safe", "toxic": "unsafe"})
    assert rv.verdict_of(cls, {"label": "toxic"}) == ("unsafe", ["toxic"], None)
    assert rv.verdict_of(cls, {"label": "ok"}) == ("safe", [], None)
    assert "'spam' is not in filter.review.labels" in rv.verdict_of(cls, {"label": "spam"})[2]


def test_actions_and_row_accounting(tmp_path):
    review = {"model": GUARD, "categories": ["violence", "sexual", "other"], "action": "flag",
              "actions": {"violence": "drop", "sexual": "mask"}, "on_error": "drop"}
    texts = ["fine", "how to hurt", "explicit", "odd", "garbled", "forbidden word", "two samples", "also fine"]
    outputs = [_out(i, t) for i, t in enumerate(texts)]
    outputs[6] = _out(6, "s0", outputs=["s0", "s1"])
    outputs.append({**_out(8, None), "error": "engine failed"})
    rows = [{"id": f"r{i}", "idx": i, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(9)]
    cfg, layout, plan, shard = _run(tmp_path, review, outputs, rows)
    spec = rv.prepare_review(cfg, layout, plan, shard)
    answers = {"r0": _verdict("safe"), "r1": _verdict("unsafe", "violence", "other"), "r2": _verdict("unsafe", "sexual"),
               "r3": _verdict("unsafe"), "r4": {"error": "output does not match the schema: 'verdict' is required"},
               "r5": _verdict("safe"), "r6": _verdict("safe"), "r6#1": _verdict("unsafe", "sexual"),
               "r7": _verdict("safe")}
    result = _review_result(layout, spec, answers)
    m = content_filter(cfg, layout, plan, [shard.model_dump()], reviews=[result.model_dump()])
    kept = {r["id"]: r for r in filtered_outputs(m, {})}
    assert sorted(kept) == ["r0", "r2", "r3", "r6", "r7"]
    assert (kept["r0"]["review_verdict"], kept["r0"]["review_categories"]) == ("safe", [])
    assert kept["r2"]["output"] == "********" and kept["r2"]["review_categories"] == ["sexual"]
    assert kept["r3"]["output"] == "odd" and kept["r3"]["review_verdict"] == "unsafe"  # flag: the default action
    assert kept["r6"]["outputs"] == ["s0", "**"] and kept["r6"]["output"] == "s0"  # the unsafe sample masked
    s = m.summary
    assert (m.rows, m.inference_error_rows, s.rows_scanned, s.rows_dropped) == (5, 1, 8, 3)
    assert s.review is not None
    # by row (r6: one sample unsafe is an unsafe row); r5 was dropped by the word list before its verdict
    assert s.review.verdicts == {"safe": 2, "unsafe": 4, "error": 1}
    assert s.review.categories == {"violence": 1, "other": 1, "sexual": 2}
    assert (s.review.rows_dropped, s.review.rows_masked, s.review.rows_flagged) == (2, 2, 1)
    assert (s.review.requests, s.review.input_tokens) == (9, 45)
    errors = {e["id"]: e for e in row_errors(plan, m, {})}
    assert errors["r1"] == {"id": "r1", "idx": 1, "reason": "dropped by review: violence, other", "stage": "review",
                            "row_id": "r1"}
    assert errors["r4"]["reason"].startswith("review failed: output does not match") and errors["r4"]["stage"] == "review"
    assert errors["r5"]["stage"] == "content_filter" and "forbidden" in errors["r5"]["reason"]
    assert errors["r8"]["stage"] == "infer"
    assert len(errors) == 4 and m.rows + len(errors) == 9  # every row once: published or an error


def test_on_error_flag_keeps_the_row(tmp_path):
    cfg, layout, plan, shard = _run(tmp_path, {"model": GUARD, "on_error": "flag"}, [_out(0, "x")],
                                    [{"id": "r0", "idx": 0, "text": "q"}])
    spec = rv.prepare_review(cfg, layout, plan, shard)
    result = _review_result(layout, spec, {"r0": {"error": "prompt is 5000 tokens; the context is 4096"}})
    m = content_filter(cfg, layout, plan, [shard], reviews=[result])
    (row,) = filtered_outputs(m, {})
    assert row["review_verdict"] == "error" and row["review_error"].startswith("prompt is 5000 tokens")
    assert m.summary.review.verdicts == {"error": 1} and m.summary.rows_dropped == 0


def test_reviews_finished_under_joined_ids_still_join(tmp_path):
    """A review committed before request ids were (row id, sample) pairs, under that key, is still joined: its
    verdicts join by idx."""
    cfg, layout, plan, shard = _run(tmp_path, {"model": GUARD}, [_out(0, "x")], [{"id": "r0", "idx": 0, "text": "q"}])
    spec = rv.prepare_review(cfg, layout, plan, shard)
    result = _review_result(layout, spec, {"r0": _verdict("safe")})
    old = result.model_copy(update={"plan_key": rv.request_key(cfg, shard, joined_ids=True)})
    assert content_filter(cfg, layout, plan, [shard], reviews=[old]).summary.review.verdicts == {"safe": 1}


def test_the_filter_refuses_missing_or_stale_reviews(tmp_path):
    cfg, layout, plan, shard = _run(tmp_path, {"model": GUARD}, [_out(0, "x")], [{"id": "r0", "idx": 0, "text": "q"}])
    with pytest.raises(ValueError, match="no review results were handed"):
        content_filter(cfg, layout, plan, [shard])
    spec = rv.prepare_review(cfg, layout, plan, shard)
    result = _review_result(layout, spec, {"r0": _verdict("safe")})
    write_jsonl(Location(shard.outputs).path(), [_out(0, "generated again")])  # the shard ran again after its review
    with pytest.raises(ValueError, match=r"reviewed from other outputs or another review prompt \[0\]"):
        content_filter(cfg, layout, plan, [shard], reviews=[result])
    fresh = _review_result(layout, rv.prepare_review(cfg, layout, plan, shard), {"r0": _verdict("safe")})
    assert content_filter(cfg, layout, plan, [shard], reviews=[fresh]).rows == 1
    changed = cfg.with_overrides({"filter.review.template": "Judge: {output}"})  # a review prompt of another day
    with pytest.raises(ValueError, match=r"not reviewed none, reviewed from other outputs.* \[0\]"):
        content_filter(changed, layout, plan, [shard], reviews=[fresh])
    with pytest.raises(ValueError, match=r"not reviewed \[0\]"):
        content_filter(cfg, layout, plan, [shard], reviews=[])


def test_published_rows_carry_the_verdict_typed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from batch_llm.io.formats import write_rows
    from batch_llm.rows.records import output_record

    result = {**_out(0, "x"), "review_verdict": "safe", "review_categories": []}
    rec = output_record({"id": "r0", "prompt": "q"}, result, "parquet")
    assert (rec["review_verdict"], rec["review_categories"]) == ("safe", [])
    write_rows(Location(str(tmp_path / "d.parquet")).path(), [rec], "parquet")
    schema = pq.read_schema(tmp_path / "d.parquet")
    assert schema.field("review_categories").type == pa.list_(pa.string())
    assert schema.field("review_verdict").type == pa.string()


def test_the_task_group_reviews_each_shard_task_on_the_gpu_pool():
    import datetime as dt
    from pathlib import Path

    from airflow.sdk import DAG
    from batch_llm.config import load_config
    from batch_llm_airflow.operators import BatchInferenceOperator, ReviewOperator
    from batch_llm_airflow.task_group import batch_llm_task_group

    demo = load_config(Path(__file__).resolve().parents[2] / "dags" / "pipelines" / "demo.yaml")
    cfg = demo.with_overrides({"filter.review": {"model": GUARD, "engine": {"tensor_parallel_size": 2}}})
    with DAG("review_shape", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        batch_llm_task_group(cfg)
    review, fetch = dag.get_task("batch_llm.review"), dag.get_task("batch_llm.fetch_review_model")
    infer, filtered = dag.get_task("batch_llm.batch_inference"), dag.get_task("batch_llm.content_filter")
    assert review.operator_class is ReviewOperator and issubclass(ReviewOperator, BatchInferenceOperator)
    assert ReviewOperator.runs_on_gpu  # the cluster policy's GPU pod marker
    assert (review.pool, review.queue, review.pool_slots) == ("gpu", "gpu", 2)
    assert review.task_id in infer.downstream_task_ids and review.task_id in fetch.downstream_task_ids
    per_shard = dag.get_task("batch_llm.filter_shard")  # each shard's filter joins its own review
    assert per_shard.task_id in review.downstream_task_ids and filtered.task_id in per_shard.downstream_task_ids
    with DAG("no_review", start_date=dt.datetime(2026, 1, 1), schedule=None) as plain:
        batch_llm_task_group(demo)
    assert not {"batch_llm.review", "batch_llm.fetch_review_model"} & set(plain.task_dict)


def test_the_report_shows_the_verdicts(tmp_path):
    import re

    from batch_llm.analysis.report import write_run_report
    from batch_llm.manifests import FilterSummary, ReviewSummary
    from synthetic_runs import make_run

    summary, version, pipe = make_run(tmp_path, 2, earlier=())
    page = Location(write_run_report(summary, version, pipe)).path().read_text(encoding="utf-8")
    assert "No content review by a model" in page
    summary.manifests.filter.summary = FilterSummary(rows_scanned=12, rows_dropped=2, review=ReviewSummary(
        model="guard@master#ab12", rows_reviewed=12, verdicts={"safe": 9, "unsafe": 2, "error": 1},
        categories={"violence": 2, "privacy": 1}, rows_dropped=2, rows_flagged=1, requests=12, cached_requests=4))
    page = Location(write_run_report(summary, version, pipe)).path().read_text(encoding="utf-8")
    section = page[page.index('id="review"'):]
    section = re.sub(r"<[^>]+>", " ", section[:section.index("</section>")])
    for text in ("safe 9 75.0%", "unsafe 2 16.7%", "error 1 8.3%", "violence 2", "privacy 1",
                 "12 rows reviewed by guard@master#ab12", "2 dropped", "4 from the result cache"):
        assert text in " ".join(section.split()), text
