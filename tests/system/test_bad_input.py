"""The bad-input corpus: each bad row gets a clear reason, every good row still completes (real vLLM)."""
from __future__ import annotations

import json
import shutil

import pytest
from batch_llm import api
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.layout import RunLayout
from batch_llm.stages.infer.runner import ShardFailed
from helpers import ROOT, demo_config

EXPECTED_PLAN_REASONS = {
    2: "not valid JSON",
    3: "missing id",
    4: "duplicate id 'good-1'",
    5: "empty prompt",
    6: "not valid UTF-8",
    8: "prompt must be a string",
    9: "id must be a string or an integer",
    10: "id must be a string or an integer",
    11: "role 'wizard' is not one of",
    12: "content must be a string",
    13: "messages must be a non-empty list",
    14: "expected a JSON object",
    15: "empty prompt: no user message has text",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    path = d / "bad_inputs.jsonl"
    shutil.copy(ROOT / "tests" / "data" / "bad_inputs.jsonl", path)
    with open(path, "a", encoding="utf-8") as f:  # a 1 MB prompt: valid JSON, far over the context
        f.write(json.dumps({"id": "huge-prompt", "prompt": "lorem ipsum " * 90_000}) + "\n")
    return d, path


@pytest.fixture(scope="module")
def planned(corpus, demo_model_dir):
    d, path = corpus
    cfg = demo_config(d, input__path=str(path), sharding__num_shards=1, engine__max_model_len=512,
                      engine__max_error_rate=0.0)
    layout = RunLayout.for_run(cfg, run_id="bad-input", ds="2026-11-03")
    model = api.fetch(cfg, layout)
    return cfg, layout, model, api.plan_shards(cfg, layout)


def test_planner_reports_each_bad_row(planned):
    _, _, _, plan = planned
    errors = {e["line"]: e for e in iter_jsonl(Location(plan.errors).path())}
    for line, reason in EXPECTED_PLAN_REASONS.items():
        assert line in errors, f"line {line} not reported"
        assert reason in errors[line]["reason"], (line, errors[line])
    assert plan.valid == 5  # good-1..4 and the huge prompt (too long only once tokenized)
    assert plan.invalid == len(EXPECTED_PLAN_REASONS)


def test_shard_turns_long_prompt_into_error_row_and_completes_the_rest(planned):
    cfg, layout, model, plan = planned
    # max_error_rate 0: the one error row fails the shard, with counts and the errors file in the message
    with pytest.raises(ShardFailed, match=r"1 of 5 rows failed .* reasons are in .*errors.jsonl"):
        api.infer_shard(cfg, layout, model, plan.shards[0])
    shard_dir = layout.stage("infer").child("shard-00000")
    errors = list(iter_jsonl(shard_dir.child("errors.jsonl").path()))
    assert [e["id"] for e in errors] == ["huge-prompt"]
    assert "prompt is" in errors[0]["error"] and "max_model_len" in errors[0]["error"]
    outputs = list(iter_jsonl(shard_dir.child("outputs.jsonl").path()))
    assert sorted(r["id"] for r in outputs) == ["good-1", "good-2", "good-3", "good-4"]
    assert all(r["output"].strip() for r in outputs)
    # A retry with a tolerant threshold takes the committed shard as is: no engine start, same rows.
    tolerant = cfg.with_overrides({"engine.max_error_rate": 0.5})
    m = api.infer_shard(tolerant, layout, model, plan.shards[0])
    assert m.metrics.ok == 4 and m.metrics.errors == 1
