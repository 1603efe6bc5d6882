"""Reasoning models without an engine: what a chat template says about thinking, the thinking switch through the
template variables (pipeline-wide and per row), the reasoning parser chosen from the model, the config's refusals,
and a shard whose engine parted thinking from answer: the rows, the schema applied to the answer only, the
accounting in the manifest, the cache, the published row, the content filter over both fields, the report and
the doctor. The split itself by vLLM's parser runs in tests/system/test_reasoning.py."""
from __future__ import annotations

import json

import pytest
from batch_llm import api
from batch_llm.config import ConfigError, FilterConfig, WordListConfig, parse_config
from batch_llm.engines.base import EngineInfo, GenResult
from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.reasoning import (
    TemplateThinking,
    ThinkingRefused,
    default_reasoning_parser,
    template_thinking,
    thinking_variables,
)
from batch_llm.rows.params import RowParams, engine_refusal, template_kwargs
from batch_llm.rows.records import output_record
from batch_llm.stages.content_filter import ContentFilter
from batch_llm.stages.infer.identity import reasoning_problems, sampling_identity
from helpers import demo_config

# The generation prompt of Qwen3's hybrid template (its history handling mentions <think> too, as the real one's)
QWEN3_HYBRID = """{%- for message in messages %}
{%- if message.role == 'assistant' and '</think>' in message.content %}
{{- '<|im_start|>assistant\\n<think>\\n' + message.content.split('</think>')[0] + '\\n</think>\\n\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# Qwen3's instruct-only models: the same history handling, no switch, nothing opened
QWEN3_INSTRUCT = QWEN3_HYBRID.split("{%- if add_generation_prompt %}")[0] + \
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
# DeepSeek-R1's distills: the generation prompt opens the block
R1_DISTILL = ("{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
# A switch, and on by default the generation prompt opens the block (as batch_llm.tiny_models' reasoning model's)
HYBRID_OPEN = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
               "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
# gpt-oss reads reasoning_effort
EFFORT = "{{ 'Reasoning: ' + (reasoning_effort or 'medium') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
CHATML = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endfor %}"


# ------------------------------------------------------------------------------------------ the template
@pytest.mark.parametrize("template,switch,opens,effort", [
    (QWEN3_HYBRID, "enable_thinking", False, False), (QWEN3_INSTRUCT, None, False, False),
    (R1_DISTILL, None, True, False), (EFFORT, None, False, True), (CHATML, None, False, False),
    (HYBRID_OPEN, "enable_thinking", True, False),  # a switch, and on by default it opens
    # a tag jinja2 alone cannot parse (transformers' {% generation %}): the variables are still found
    ("{% generation %}{% if thinking %}<think>{% endif %}{% endgeneration %}", "thinking", False, False),
])
def test_what_a_template_says_about_thinking(template, switch, opens, effort):
    assert template_thinking(template) == TemplateThinking(switch=switch, opens=opens, reasoning_effort=effort)


def test_thinking_on_and_off_set_the_switch_or_are_refused_naming_why():
    hybrid, always, plain = (template_thinking(t) for t in (QWEN3_HYBRID, R1_DISTILL, CHATML))
    assert thinking_variables("auto", hybrid) == thinking_variables("auto", plain) == {}
    assert thinking_variables("on", hybrid) == {"enable_thinking": True}
    assert thinking_variables("off", hybrid) == {"enable_thinking": False}
    assert thinking_variables("on", always) == {}  # it always thinks: nothing to switch
    with pytest.raises(ThinkingRefused, match=r"thinking: off: .*no thinking switch .*opens a <think> block, so it "
                                              r"always thinks"):
        thinking_variables("off", always)
    with pytest.raises(ThinkingRefused, match=r"thinking: off: .*no thinking switch .*it does not think"):
        thinking_variables("off", plain)
    with pytest.raises(ThinkingRefused, match=r"thinking: on: .*this model does not think"):
        thinking_variables("on", plain)


def test_the_pipelines_switch_lies_under_the_rows_own(tmp_path):
    hybrid = template_thinking(QWEN3_HYBRID)
    cfg = demo_config(tmp_path, sampling__thinking="off", sampling__chat_template_kwargs={"lang": "en"})
    assert template_kwargs(None, cfg.sampling, hybrid) == {"lang": "en", "enable_thinking": False}
    row = RowParams.from_columns({"thinking": "ON"}, ["thinking"])
    assert template_kwargs(row, cfg.sampling, hybrid) == {"lang": "en", "enable_thinking": True}
    body = RowParams.from_openai_body({"messages": [], "chat_template_kwargs": {"enable_thinking": True}})
    assert template_kwargs(body, cfg.sampling, hybrid)["enable_thinking"] is True
    effort = RowParams.from_openai_body({"messages": [], "reasoning_effort": "high"})
    assert template_kwargs(effort, cfg.sampling.model_copy(update={"thinking": "auto"}),
                           template_thinking(EFFORT)) == {"lang": "en", "reasoning_effort": "high"}
    with pytest.raises(ThinkingRefused, match="reasoning_effort='high': the model's chat template has no "
                                              "reasoning_effort variable .*thinking switch is enable_thinking"):
        template_kwargs(effort, cfg.sampling, hybrid)


@pytest.mark.parametrize("value,mode", [(True, "on"), (False, "off"), ("Off", "off"), ("auto", "auto")])
def test_a_thinking_column_takes_words_and_booleans(value, mode):
    assert RowParams.from_columns({"thinking": value}, ["thinking"]).thinking == mode


def test_bad_row_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="thinking must be auto, on or off"):
        RowParams.from_columns({"thinking": "maybe"}, ["thinking"])
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        RowParams.from_openai_body({"messages": [], "reasoning_effort": "extreme"})
    with pytest.raises(ValueError, match=r"max_thinking_tokens must be in \[0, 2147483647\]"):
        RowParams.from_openai_body({"messages": [], "thinking_token_budget": -1})


def test_a_rows_thinking_budget_is_vllms_and_its_switch_every_engines():
    budget = RowParams.from_openai_body({"messages": [], "thinking_token_budget": 32})
    assert budget.max_thinking_tokens == 32 and engine_refusal(budget, "vllm") is None
    assert "cannot apply per-row max_thinking_tokens (vllm can)" in engine_refusal(budget, "transformers")
    switch = RowParams.from_columns({"thinking": "off", "reasoning_effort": "low"}, ["thinking", "reasoning_effort"])
    assert engine_refusal(switch, "transformers") is None and engine_refusal(switch, "lmdeploy") is None


# ------------------------------------------------------------------------------------------ the parser
def _model(tmp_path, arch: str):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(tmp_path)


@pytest.mark.parametrize("arch,template,parser", [
    ("Qwen3ForCausalLM", QWEN3_HYBRID, "qwen3"), ("Qwen3MoeForCausalLM", HYBRID_OPEN, "qwen3"),
    ("Qwen3ForCausalLM", QWEN3_INSTRUCT, None),        # an instruct-only Qwen3 does not think
    ("Qwen2ForCausalLM", R1_DISTILL, "deepseek_r1"), ("LlamaForCausalLM", R1_DISTILL, "deepseek_r1"),
    ("LlamaForCausalLM", CHATML, None), ("LlamaForCausalLM", QWEN3_HYBRID, None),  # a family auto does not know
])
def test_the_reasoning_parser_is_chosen_from_the_model(tmp_path, arch, template, parser):
    assert default_reasoning_parser(_model(tmp_path, arch), template) == parser


# ------------------------------------------------------------------------------------------ the config
BASE = dict(name="x", model={"ref": "m"}, input={"path": "/tmp/x.jsonl"}, output={"path": "/tmp/o"})


@pytest.mark.parametrize("extra,message", [
    ({"engine": {"kind": "transformers", "reasoning_parser": "qwen3"}},
     "engine.reasoning_parser: engine transformers has no reasoning parser (vllm can); remove it"),
    ({"engine": {"kind": "lmdeploy"}, "sampling": {"max_thinking_tokens": 64}},
     "sampling.max_thinking_tokens: engine lmdeploy has no thinking budget (vllm can)"),
    ({"engine": {"reasoning_parser": None}, "sampling": {"max_thinking_tokens": 64}},
     "a thinking budget needs the reasoning parser that finds the thinking; engine.reasoning_parser is null"),
    ({"sampling": {"thinking": "off", "chat_template_kwargs": {"enable_thinking": False}}},
     "thinking: off and chat_template_kwargs.enable_thinking both switch thinking; set one of them"),
    ({"engine": {"task": "embed"}, "sampling": {"max_thinking_tokens": 8}}, "sampling.max_thinking_tokens"),
    ({"engine": {"reasoning_parser": "qwen3 --x"}}, "engine.reasoning_parser"),
    ({"filter": {"scan": []}}, "filter.scan"),
])
def test_reasoning_settings_an_engine_cannot_honour_are_refused(extra, message):
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, **extra}, "p.yaml")
    assert message in str(e.value) and str(e.value).startswith("p.yaml: ")


def test_defaults_and_what_every_engine_takes():
    cfg = parse_config({**BASE, "engine": {"kind": "transformers"}, "sampling": {"thinking": "off"},
                        "input": {"path": "/tmp/x.jsonl", "sampling_columns": ["thinking", "reasoning_effort"]}})
    assert cfg.engine.reasoning_parser == "auto" and cfg.filter.scan == ["output", "reasoning"]


def test_a_pipeline_thinking_setting_the_model_cannot_honour_stops_the_run_at_fetch(tmp_path, demo_model_dir):
    """The demo model (SmolLM2) has no thinking switch: off is refused when the model is fetched, before a GPU."""
    cfg = demo_config(tmp_path, sampling__thinking="off")
    assert reasoning_problems(cfg, str(demo_model_dir)) == [
        "sampling.thinking: off: the model's chat template has no thinking switch (no enable_thinking or thinking "
        "variable; it does not think)"]
    with pytest.raises(ConfigError, match="sampling.thinking: off"):
        api.fetch(cfg, RunLayout.for_run(cfg, run_id="r", ds="2026-12-04"))
    budget = demo_config(tmp_path, sampling__max_thinking_tokens=8)
    assert "sampling.max_thinking_tokens: engine.reasoning_parser: auto found no reasoning parser" in \
        reasoning_problems(budget, str(demo_model_dir))[0]
    # with a thinking template the same model folder is a reasoning model: nothing to refuse
    assert reasoning_problems(demo_config(tmp_path, sampling__thinking="off", model__chat_template=QWEN3_HYBRID,
                                          engine__reasoning_parser="qwen3"), str(demo_model_dir)) == []


def test_the_thinking_settings_are_in_the_output_identity_only_where_set(tmp_path):
    """Namespaces of runs that set none stay what they were; setting one changes it."""
    plain = sampling_identity(demo_config(tmp_path).sampling)
    assert "thinking" not in plain and "max_thinking_tokens" not in plain
    assert sampling_identity(demo_config(tmp_path, sampling__thinking="on").sampling)["thinking"] == "on"
    assert sampling_identity(demo_config(tmp_path, sampling__max_thinking_tokens=9).sampling)["max_thinking_tokens"] == 9


# ------------------------------------------------------------------------------------------ a shard
class _ThinkingEngine:
    """Stands in for vLLM with a reasoning parser: answers as the prompt asks, the thinking parted already."""

    def generate(self, reqs):
        for r in reqs:
            if "THINK-OK" in r.prompt_text:
                yield GenResult(key=r.key, text='{"a": 1}', finish_reason="stop", prompt_tokens=5,
                                completion_tokens=12, reasoning="let me see", reasoning_tokens=4,
                                thinking_ended=True, thinking_budget=16)
            elif "THINK-STUCK" in r.prompt_text:
                yield GenResult(key=r.key, text="", finish_reason="length", prompt_tokens=5, completion_tokens=8,
                                reasoning="hmm hmm hmm", reasoning_tokens=8, thinking_ended=False)
            else:
                yield GenResult(key=r.key, text='{"a": 2}', finish_reason="stop", prompt_tokens=5, completion_tokens=3)

    def close(self):
        pass


@pytest.fixture
def thinking_engine(monkeypatch, demo_model_dir):
    from batch_llm.stages.infer import runner

    monkeypatch.setattr(runner, "start_engine", lambda *a, **k: (_ThinkingEngine(), EngineInfo(kind="vllm", version="0")))


def _shard(tmp_path, run_id: str, **overrides):
    src = tmp_path / "in.jsonl"
    write_jsonl(Location(str(src)).path(), [{"id": "ok", "messages": [{"role": "user", "content": "THINK-OK"}]},
                      {"id": "stuck", "messages": [{"role": "user", "content": "THINK-STUCK"}]},
                      {"id": "plain", "messages": [{"role": "user", "content": "hello"}]},
                      {"id": "asks", "messages": [{"role": "user", "content": "hello"}], "thinking": "on"}])
    cfg = demo_config(tmp_path, input__path=str(src), input__sampling_columns=["max_tokens", "thinking"],
                      sharding__num_shards=1, engine__max_error_rate=0.5,
                      sampling__output_schema={"type": "object"}, **overrides)
    layout = RunLayout.for_run(cfg, run_id=run_id, ds="2026-12-04")
    plan = api.plan_shards(cfg, layout)
    m = api.infer_shard(cfg, layout, api.fetch(cfg, layout), plan.shards[0], say=lambda _: None)
    return m, {r["id"]: r for r in iter_jsonl(Location(m.outputs).path())}, \
        {r["id"]: r for r in iter_jsonl(Location(m.errors).path())}


def test_a_shard_keeps_thinking_apart_and_counts_it(tmp_path, thinking_engine):
    m, out, err = _shard(tmp_path, "a")
    ok = out["ok"]
    assert (ok["output"], ok["reasoning"], ok["reasoning_tokens"], ok["thinking_ended"], ok["max_thinking_tokens"]) \
        == ('{"a": 1}', "let me see", 4, True, 16)
    assert "reasoning" not in out["plain"]  # no parser split this one: no thinking fields
    # under a schema, a row whose thinking never ended has no answer to check: an invalid output saying why
    stuck = err["stuck"]
    assert stuck["error_kind"] == "invalid_output" and stuck["error"].startswith("thinking never ended: 8 thinking "
                                                                                "tokens ran to the end of the output")
    assert stuck["reasoning"] == "hmm hmm hmm" and stuck["thinking_ended"] is False
    # the demo model's template has no switch: the row's own thinking: on is its error, named
    assert err["asks"]["error"].startswith("thinking: on: the model's chat template has no thinking switch")
    assert (m.metrics.reasoning_tokens, m.metrics.thinking_unfinished, m.metrics.invalid_outputs) == (4, 1, 1)
    # the result cache keeps the thinking: a second run is served whole, fields and all
    m2, out2, _ = _shard(tmp_path, "b")
    assert m2.metrics.cached_rows == 2 and out2["ok"]["reasoning"] == "let me see"
    assert m2.metrics.reasoning_tokens == 4


def test_a_published_row_carries_the_thinking_and_openai_lines_reasoning_content():
    result = {"id": "r", "idx": 0, "output": "42", "finish_reason": "stop", "prompt_tokens": 5,
              "completion_tokens": 12, "reasoning": "six times seven", "reasoning_tokens": 9, "thinking_ended": True}
    row = output_record({"id": "r", "messages": []}, result, "jsonl")
    assert (row["output"], row["reasoning"], row["reasoning_tokens"]) == ("42", "six times seven", 9)
    line = output_record({"custom_id": "r", "url": "/v1/chat/completions"}, result, "openai_batch")
    body = line["response"]["body"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "42", "reasoning_content": "six times seven"}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 9}
    plain = output_record({"custom_id": "r", "url": "/v1/chat/completions"},
                          {k: v for k, v in result.items() if "reason" not in k and k != "thinking_ended"},
                          "openai_batch")["response"]["body"]
    assert "reasoning_content" not in plain["choices"][0]["message"] and "completion_tokens_details" not in plain["usage"]


# ------------------------------------------------------------------------------------------ the filter
def _filter(tmp_path, **kw) -> ContentFilter:
    words = tmp_path / "words.txt"
    words.write_text("secret\nbomb\n")
    lists = kw.pop("lists", [WordListConfig(name="w", path=str(words), action="mask")])
    return ContentFilter(FilterConfig(lists=lists, **kw))


def test_the_filter_scans_the_answer_and_the_thinking(tmp_path):
    row = {"id": "r", "output": "no secret here", "reasoning": "the secret is in the thinking"}
    out, hits = _filter(tmp_path).apply(row)
    assert out["output"] == "no ****** here" and out["reasoning"] == "the ****** is in the thinking"
    assert [h.get("field", "output") for h in hits] == ["output", "reasoning"]
    answer_only, hits = _filter(tmp_path, scan=["output"]).apply(row)
    assert answer_only["reasoning"] == row["reasoning"] and len(hits) == 1
    # a list of its own scans the thinking only, and drops the row on a hit there
    words = tmp_path / "words.txt"
    drop = _filter(tmp_path, lists=[WordListConfig(name="w", path=str(words), action="mask", scan=["output"]),
                                    WordListConfig(name="d", path=str(words), action="drop", scan=["reasoning"])])
    out, hits = drop.apply(row)
    assert out is None and {(h["list"], h.get("field", "output")) for h in hits} == {("w", "output"), ("d", "reasoning")}
    # every sample's thinking (n > 1)
    samples = {"id": "s", "output": "a", "outputs": ["a", "b"], "reasoning": "ok", "outputs_reasoning": ["ok", "bomb"]}
    out, hits = _filter(tmp_path).apply(samples)
    assert out["outputs_reasoning"] == ["ok", "****"] and hits[0]["sample"] == 1 and hits[0]["field"] == "reasoning"


# ------------------------------------------------------------------------------------------ report and doctor
def test_the_doctor_warns_when_thinking_ate_the_budget():
    from batch_llm.analysis.doctor import diagnose
    from synthetic_runs import plan_manifest, run_summary, shard_manifest

    def summary(unfinished: int, sampling: dict):
        metrics = {"rows": 100, "ok": 100, "output_tokens": 20_000, "reasoning_tokens": 15_000,
                   "thinking_unfinished": unfinished, "generate_seconds": 10.0, "seconds": 12.0}
        return run_summary(config={"sampling": {"max_tokens": 256, **sampling}, "engine": {"kind": "vllm"}},
                           plan=plan_manifest(rows_read=100, valid=100),
                           infer=[shard_manifest(0, metrics, engine={"kind": "vllm", "settings": {}})])

    def thinking(findings):
        return [f for f in findings if f.check == "thinking"]

    assert thinking(diagnose(summary(0, {}), read_files=False)) == []
    [f] = thinking(diagnose(summary(30, {}), read_files=False))
    assert f.severity == "warning" and f.change == "sampling.max_thinking_tokens: 128"
    assert "30 of 100 rows (30%) never ended their thinking within sampling.max_tokens = 256" in f.evidence
    assert "thinking took 75% of the answered rows' output tokens" in f.evidence
    [f] = thinking(diagnose(summary(5, {"max_thinking_tokens": 256}), read_files=False))
    assert f.change == "sampling.max_tokens: 512"  # the budget leaves no room for an answer within max_tokens


def test_the_report_shows_the_thinking_tokens(tmp_path):
    from batch_llm.analysis.report import render_report
    from synthetic_runs import make_run

    summary, _, pipe = make_run(tmp_path, 2)
    for s in summary.manifests.infer:
        s.metrics.reasoning_tokens, s.metrics.thinking_unfinished = s.metrics.output_tokens // 4, 1
        rows = [dict(r, reasoning_tokens=7) for r in iter_jsonl(Location(s.outputs).path())]
        write_jsonl(Location(s.outputs).path(), rows)
    page = render_report(summary, pipeline_root=pipe)
    assert "thinking tokens" in page and "(25% of output)" in page
    assert "rows whose thinking never ended" in page and "thinking ate the output budget" in page


# ------------------------------------------------------------------------------------------ the other front doors
def test_run_batch_and_swift_part_no_thinking_unless_their_parser_flag_asks(tmp_path):
    """vllm run-batch and swift infer keep the whole output unless given a reasoning parser; their flag sets it."""
    from batch_llm.frontends import run_batch as rb
    from batch_llm.frontends import swift as sa
    from batch_llm.frontends.cli import build_parser

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    words = ["run-batch", "-i", "in.jsonl", "-o", "o.jsonl", "--model", str(model)]
    cfg, _ = rb.build_config(build_parser().parse_args(words), tmp_path / "w", keep=False)
    assert cfg.engine.reasoning_parser is None
    cfg, _ = rb.build_config(build_parser().parse_args([*words, "--reasoning-parser", "qwen3"]), tmp_path / "w",
                             keep=False)
    assert cfg.engine.reasoning_parser == "qwen3"

    def swift(*more: str):
        plan = sa.plan_invocation(sa.parse_swift_args(["--model", "m", "--val_dataset", "rows.jsonl", "--result_path",
                                                       "out.jsonl", *more]))
        return sa.build_config(plan, tmp_path / "s").engine.reasoning_parser

    assert swift("--infer_backend", "vllm") is None
    assert swift("--infer_backend", "vllm", "--vllm_reasoning_parser", "deepseek_r1") == "deepseek_r1"
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    [line] = sa.result_lines(rows, {sa.row_id(0): {"output": "42", "reasoning": "six times seven"}}, {})
    assert line["response"] == "42" and line["messages"][-1] == {"role": "assistant", "content": "42",
                                                                  "reasoning_content": "six times seven"}


def test_the_trigger_form_sets_thinking_and_its_budget(tmp_path):
    from batch_llm_airflow.params import overrides_from_params, params_for

    cfg = demo_config(tmp_path)
    form = params_for(cfg)
    assert (form["thinking"].value, form["max_thinking_tokens"].value) == ("auto", None)
    assert form["thinking"].schema["enum"] == ["auto", "on", "off"]
    s = cfg.with_overrides(overrides_from_params({"thinking": "on", "max_thinking_tokens": 64}, cfg)).sampling
    assert (s.thinking, s.max_thinking_tokens) == ("on", 64)


def test_a_pipeline_wide_thinking_budget_starts_vllms_v1_model_runner():
    """vLLM's V2 model runner (its GPU default for Qwen3 in 0.2x) rejects every request with a thinking budget:
    on the H100 all 1,000 rows of a budgeted Qwen3-8B-shaped day failed with that reason. A budget with a
    reasoning parser asks for the V1 runner; the user's own setting wins; nothing else changes vLLM's choice."""
    from batch_llm.engines.vllm_engine import thinking_budget_runner

    assert thinking_budget_runner("qwen3", 256, {}) == "0"
    assert thinking_budget_runner("qwen3", 0, {}) == "0"  # a zero budget is a budget: answer at once
    assert thinking_budget_runner("qwen3", 256, {"VLLM_USE_V2_MODEL_RUNNER": "1"}) is None
    assert thinking_budget_runner("qwen3", None, {}) is None
    assert thinking_budget_runner(None, 256, {}) is None


def test_thinking_tokens_count_the_thinking_the_template_opened_in_the_prompt():
    """Qwen3's template opens <think> in the prompt, so the output holds only the thinking and </think>. vLLM
    0.26's parser counted 0 reasoning tokens for every such row (on an H100, 1,000 budgeted rows); the count is
    the tokens before the end marker, whichever vLLM runs."""
    from types import SimpleNamespace

    from batch_llm.engines.vllm_engine import thinking_tokens

    def vllm_026_count(ids):  # vLLM 0.26's: only between a start and an end token of the output
        depth = n = 0
        for t in ids:
            if t in (1, 2):
                depth += 1 if t == 1 else -1 if depth else 0
            elif depth:
                n += 1
        return n

    reasoner = SimpleNamespace(vocab={"<think>": 1, "</think>": 2}, reasoning_start_str="<think>",
                               reasoning_end_str="</think>", count_reasoning_tokens=vllm_026_count)
    opened_in_prompt = [7, 8, 9, 2, 5, 6]
    assert vllm_026_count(opened_in_prompt) == 0
    assert thinking_tokens(reasoner, opened_in_prompt) == 3
    assert thinking_tokens(reasoner, [1, 7, 8, 2, 5]) == 2  # the model opened it itself
    assert thinking_tokens(reasoner, [7, 8, 9]) == 3  # never ended: all of it is thinking
    multi_token_marker = SimpleNamespace(vocab={}, reasoning_start_str="<think>", reasoning_end_str="</think>",
                                         count_reasoning_tokens=lambda ids: 42)
    assert thinking_tokens(multi_token_marker, opened_in_prompt) == 42
