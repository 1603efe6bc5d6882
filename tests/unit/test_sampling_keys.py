"""Every sampling key is honoured or refused, never dropped.

Walks every field of OpenAI's chat and completions request bodies (the ``openai`` package's own types) and vLLM's
(its ChatCompletionRequest / CompletionRequest, read from its source without importing vLLM): each is honoured (it
reaches the row's parameters and, for an engine parameter, vLLM's SamplingParams), accepted as having no effect on
the output, or refused with the reason. Then the pipeline-wide keys (sampling.*), the trigger form, table columns,
swift's flags and the engines that cannot apply a key.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from batch_llm.config import ConfigError, SamplingConfig
from batch_llm.config.capabilities import EXTRA_SAMPLING_KEYS, serving
from batch_llm.engines.vllm_engine import sampling_kwargs
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.reasoning import TemplateThinking
from batch_llm.rows.params import (
    HONOURED,
    NO_EFFECT,
    REFUSED,
    RowParams,
    engine_refusal,
    resolve,
    response_schema,
    template_kwargs,
)
from batch_llm.stages import plan as plan_mod
from batch_llm.stages.infer.identity import sampling_identity
from batch_llm.stages.infer.request_builder import RequestBuilder
from helpers import demo_config

# What OpenAI's chat and completions endpoints take (openai 3.57's CompletionCreateParams), where the openai
# package is not installed: the test then walks this list.
OPENAI_CHAT = ("audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
               "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
               "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
               "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
               "top_logprobs", "top_p", "user", "verbosity", "web_search_options")
OPENAI_COMPLETIONS = ("best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
                      "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix",
                      "temperature", "top_p", "user")


def _openai_fields(completions: bool) -> set[str]:
    try:
        if completions:
            from openai.types import completion_create_params as m
        else:
            from openai.types.chat import completion_create_params as m
    except ImportError:
        return set(OPENAI_COMPLETIONS if completions else OPENAI_CHAT)
    return set(m.CompletionCreateParamsNonStreaming.__annotations__) | set(
        m.CompletionCreateParamsStreaming.__annotations__)


def _class_fields(relpath: str, cls: str) -> set[str]:
    """The public annotated fields of a class of vLLM's source (read, not imported: importing vLLM takes ~30 s)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    tree = ast.parse((Path(spec.submodule_search_locations[0]) / relpath).read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return {n for n in names if not n.startswith("_")}


VLLM_CHAT = ("entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest")
VLLM_COMPLETIONS = ("entrypoints/openai/completion/protocol.py", "CompletionRequest")
CHAT = [{"role": "user", "content": "hi"}]

# One value of each honoured field, and what it becomes: the row parameter it sets, and the value vLLM's
# SamplingParams gets (None: not an engine parameter; the prompt, the chat template's variables, the grammar).
HONOURED_EXAMPLES = {
    "max_tokens": (7, "max_tokens", 7), "max_completion_tokens": (9, "max_tokens", 9),
    "temperature": (0.5, "temperature", 0.5), "top_p": (0.5, "top_p", 0.5), "stop": ("x", "stop", ["x"]),
    "seed": (3, "seed", 3), "presence_penalty": (0.5, "presence_penalty", 0.5),
    "frequency_penalty": (0.25, "frequency_penalty", 0.25), "n": (2, "n", 2), "top_k": (5, "top_k", 5),
    "min_p": (0.1, "min_p", 0.1), "repetition_penalty": (1.3, "repetition_penalty", 1.3),
    "stop_token_ids": ([7, 8], "stop_token_ids", [7, 8]),
    "include_stop_str_in_output": (True, "include_stop_str_in_output", True),
    "chat_template_kwargs": ({"enable_thinking": False}, "chat_template_kwargs", None),
    "response_format": ({"type": "json_object"}, "response_format", None),
    "reasoning_effort": ("low", "reasoning_effort", None),
    "thinking_token_budget": (64, "max_thinking_tokens", 64),
}
# Row parameters vLLM's SamplingParams names otherwise
VLLM_NAMES = {"max_thinking_tokens": "thinking_token_budget"}


@pytest.mark.parametrize("completions", [False, True], ids=["chat", "completions"])
def test_every_openai_and_vllm_body_field_is_honoured_or_refused(completions):
    vllm_fields = _class_fields(*(VLLM_COMPLETIONS if completions else VLLM_CHAT))
    fields = _openai_fields(completions) | vllm_fields
    assert len(vllm_fields) > 40  # the walk found vLLM's request class, not an empty one
    known = HONOURED | set(NO_EFFECT) | set(REFUSED) | {"add_special_tokens"}
    assert sorted(fields - known) == [], "a request field with no verdict: add it to row_params' tables"
    base = {"prompt": "hi"} if completions else {"messages": CHAT}
    sentinel = {"not": "neutral"}  # no neutral value of any field
    for name in sorted(fields):
        if name in ("messages", "prompt"):
            continue
        if name in NO_EFFECT:  # accepted at any value: the row's parameters stay what they were
            assert RowParams.from_openai_body({**base, name: sentinel}, completions=completions) is None, name
        elif name in HONOURED:
            _assert_honoured(name, base, completions)
        else:
            with pytest.raises(ValueError) as e:
                RowParams.from_openai_body({**base, name: sentinel}, completions=completions)
            reason = REFUSED[name][1] if name in REFUSED else "special tokens"
            assert str(e.value).startswith(f"{name}=") and reason in str(e.value), (name, str(e.value))
            neutral = REFUSED[name][0][-1] if name in REFUSED else completions
            assert RowParams.from_openai_body({**base, name: neutral}, completions=completions) is None, name
    with pytest.raises(ValueError, match=r"frobnicate: not a field of an OpenAI or vLLM .* refused, not ignored"):
        RowParams.from_openai_body({**base, "frobnicate": 1}, completions=completions)


def _assert_honoured(name: str, base: dict, completions: bool) -> None:
    if name in ("logprobs", "top_logprobs"):
        body = {**base, "logprobs": 3} if completions else {**base, "logprobs": True, "top_logprobs": 3}
        p = RowParams.from_openai_body(body, completions=completions)
        assert p.logprobs == 3 and sampling_kwargs(resolve(p, SamplingConfig()))["logprobs"] == 3
        return
    value, param, engine_value = HONOURED_EXAMPLES[name]
    p = RowParams.from_openai_body({**base, name: value}, completions=completions)
    assert p is not None and p.set_names() == {param}, name
    s = resolve(p, SamplingConfig())
    if engine_value is not None:
        assert sampling_kwargs(s)[VLLM_NAMES.get(param, param)] == engine_value, name
    elif name == "chat_template_kwargs":
        assert template_kwargs(p, SamplingConfig(chat_template_kwargs={"other": 1})) == {"other": 1, **value}
    elif name == "reasoning_effort":  # the template variable of that name, where the template reads one
        assert template_kwargs(p, SamplingConfig(), TemplateThinking(reasoning_effort=True)) == {name: value}
    else:  # response_format: the row decodes under it, and its output is checked against it
        assert s.response_format is not None and response_schema(s.response_format) == {"type": "object"}


def test_vllm_receives_every_resolved_sampling_field():
    sampling_params = _class_fields("sampling_params.py", "SamplingParams")
    kwargs = sampling_kwargs(resolve(None, SamplingConfig()))
    assert set(kwargs) <= sampling_params  # each one a SamplingParams field of the installed vLLM
    # every field of the resolved sampling reaches vLLM (the row's response_format as its structured outputs)
    resolved = {VLLM_NAMES.get(f.name, f.name) for f in dataclasses.fields(resolve(None, SamplingConfig()))}
    assert resolved - set(kwargs) == {"response_format"}


def test_a_json_schema_response_format_is_the_rows_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    p = RowParams.from_openai_body({"messages": CHAT, "response_format": rf})
    assert response_schema(p.response_format) == schema and RowParams.from_json(p.to_json()) == p
    assert p.to_json() == {"response_format": {"type": "json_schema", "schema": schema}}
    assert RowParams.from_openai_body({"messages": CHAT, "response_format": {"type": "text"}}) is None
    for bad, words in (({"type": "json_schema"}, "json_schema.schema"), ({"type": "xml"}, "type text, json_object"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": 5}}}, "not a valid JSON Schema")):
        with pytest.raises(ValueError, match=words):
            RowParams.from_openai_body({"messages": CHAT, "response_format": bad})


def test_row_values_are_checked():
    cases = [({"top_k": -2}, "top_k must be in [-1, 2147483647], got -2"), ({"min_p": 1.5}, "min_p must be in [0.0, 1.0]"),
             ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
             ({"stop_token_ids": [1, -1]}, "stop_token_ids must be a list of token ids"),
             ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be true or false"),
             ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be an object"),
             ({"chat_template_kwargs": {"tokenize": True}}, "tokenize: arguments of the tokenizer's")]
    for body, words in cases:
        with pytest.raises(ValueError) as e:
            RowParams.from_openai_body({"messages": CHAT, **body})
        assert words in str(e.value), str(e.value)
    assert RowParams.from_openai_body({"messages": CHAT, "top_k": -1}).top_k == 0  # vLLM's "off", one value


# ------------------------------------------------------------------------------------------ engines
def test_a_row_key_an_engine_cannot_apply_is_a_row_error_naming_who_can():
    assert engine_refusal(RowParams(include_stop_str_in_output=True), "lmdeploy") == (
        "engine lmdeploy cannot apply per-row include_stop_str_in_output (vllm, transformers and sglang can)")
    assert engine_refusal(RowParams(response_format='{"type":"json_object"}'), "transformers") == (
        "engine transformers cannot apply per-row response_format (vllm and sglang can)")
    for kind in ("vllm", "lmdeploy", "transformers", "sglang"):
        assert engine_refusal(RowParams(top_k=3, min_p=0.1, repetition_penalty=1.1, stop_token_ids=(2,),
                                        chat_template_kwargs='{"a":1}'), kind) is None
    assert serving(lambda c: EXTRA_SAMPLING_KEYS <= c.sampling_keys) == ["vllm", "transformers", "sglang"]


def test_pipeline_keys_an_engine_cannot_apply_are_refused_naming_who_can(tmp_path):
    cfg = demo_config(tmp_path, sampling__top_k=40, sampling__min_p=0.05, sampling__repetition_penalty=1.2,
                      sampling__stop_token_ids=[2], sampling__include_stop_str_in_output=True,
                      sampling__chat_template_kwargs={"enable_thinking": False})
    assert cfg.sampling.top_k == 40 and cfg.sampling.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=r"sampling.include_stop_str_in_output: engine lmdeploy does not apply it "
                                          r"\(vllm, transformers and sglang can\); remove .* or set engine.kind: vllm or "
                                          r"transformers or sglang"):
        demo_config(tmp_path, engine__kind="lmdeploy", sampling__include_stop_str_in_output=True)
    demo_config(tmp_path, engine__kind="lmdeploy", sampling__top_k=5)  # LMDeploy applies top_k
    with pytest.raises(ConfigError, match="sampling.top_k: generation settings; engine.task: embed"):
        demo_config(tmp_path, engine__task="embed", sampling__top_k=5)
    with pytest.raises(ConfigError, match="tokenize: arguments of the tokenizer's apply_chat_template"):
        demo_config(tmp_path, sampling__chat_template_kwargs={"tokenize": False})
    assert demo_config(tmp_path, sampling__top_k=-1).sampling.top_k == 0


def test_new_keys_enter_the_cache_namespace_only_where_set(tmp_path):
    base = demo_config(tmp_path).sampling
    assert not {"top_k", "chat_template_kwargs", "stop_token_ids"} & set(sampling_identity(base))
    for key, value in (("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("stop_token_ids", [3]),
                       ("include_stop_str_in_output", True), ("chat_template_kwargs", {"a": 1})):
        assert sampling_identity(base.model_copy(update={key: value}))[key] == value


# ------------------------------------------------------------------------------------------ rendering
class _RecordingTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, **kwargs):
        self.kwargs = kwargs
        return "rendered"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [1, 2, 3]}


def test_the_chat_is_rendered_with_the_pipelines_and_the_rows_template_variables(tmp_path):
    builder = RequestBuilder.__new__(RequestBuilder)  # only what render reads
    builder.cfg = demo_config(tmp_path, sampling__chat_template_kwargs={"enable_thinking": False, "lang": "en"})
    builder.tokenizer = _RecordingTokenizer()
    builder.render({"messages": CHAT, "params": {"chat_template_kwargs": {"lang": "fr"}}})
    assert builder.tokenizer.kwargs == {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False,
                                    "lang": "fr"}


# ------------------------------------------------------------------------------------------ inputs
def _plan(tmp_path, cfg, src):
    m = plan_mod.write_plan(cfg, input_loc=Location(str(src)), plan_dir=Location(str(tmp_path / "plan")))
    rows = {r["id"]: r for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    return rows, {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}


def test_table_columns_carry_the_new_keys(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text('id,prompt,top_k,min_p,repetition_penalty,stop_token_ids,include_stop_str_in_output,'
                 'chat_template_kwargs\n'
                 'a,hi,5,0.1,1.2,"[2, 3]",true,"{""enable_thinking"": false}"\n'
                 'b,hi,,,,,,\n'
                 'c,hi,,,,"[2,",,\n')
    cols = ["top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
            "chat_template_kwargs"]
    rows, errors = _plan(tmp_path, demo_config(tmp_path, input__path=str(p), input__sampling_columns=cols), p)
    assert rows["a"]["params"] == {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [2, 3],
                                   "include_stop_str_in_output": True,
                                   "chat_template_kwargs": {"enable_thinking": False}}
    assert "params" not in rows["b"]
    assert errors["c"] == "stop_token_ids must be JSON (a list), got '[2,'"


def test_openai_batch_lines_carry_the_new_keys_and_refuse_for_engines_without_them(tmp_path):
    def line(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": CHAT, **body}}

    p = tmp_path / "batch.jsonl"
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    lines = [line("k", top_k=1, repetition_penalty=1.5, stop_token_ids=[2], chat_template_kwargs={"x": 1}),
             line("j", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
             line("s", include_stop_str_in_output=True, stop=["."]), line("u", logits_processors=["x"])]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows, errors = _plan(tmp_path, demo_config(tmp_path, input__path=str(p)), p)
    assert rows["k"]["params"] == {"top_k": 1, "repetition_penalty": 1.5, "stop_token_ids": [2],
                                   "chat_template_kwargs": {"x": 1}}
    assert rows["j"]["params"] == {"response_format": {"type": "json_schema", "schema": schema}}
    assert "logits_processors: not a field" in errors["u"]
    rows, errors = _plan(tmp_path / "lm", demo_config(tmp_path / "lm", input__path=str(p), engine__kind="lmdeploy"), p)
    assert set(rows) == {"k"}
    assert errors["j"] == "engine lmdeploy cannot apply per-row response_format (vllm and sglang can)"
    assert errors["s"].startswith("engine lmdeploy cannot apply per-row include_stop_str_in_output")


def test_the_trigger_form_sets_the_new_keys(tmp_path):
    from batch_llm_airflow.params import overrides_from_params, params_for

    cfg = demo_config(tmp_path)
    form = params_for(cfg)
    assert {k: form[k].value for k in ("top_k", "min_p", "repetition_penalty", "stop_token_ids",
                                       "include_stop_str_in_output", "chat_template_kwargs")} == {
        "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "stop_token_ids": [], "include_stop_str_in_output": False,
        "chat_template_kwargs": {}}
    over = overrides_from_params({"top_k": 3, "stop_token_ids": [5], "chat_template_kwargs": {"enable_thinking": True}},
                                 cfg)
    s = cfg.with_overrides(over).sampling
    assert (s.top_k, s.stop_token_ids, s.chat_template_kwargs) == (3, [5], {"enable_thinking": True})
