"""Structured outputs: a JSON Schema (file or pydantic model) every output is checked against; vLLM decodes
under it; valid outputs become typed columns, invalid ones ``invalid_output`` rows that do not fail the task.

The engine tests run ``dags/pipelines/review_extraction.yaml`` (the Chinese review sample, aspect / sentiment /
evidence) through ``batch-llm run``: guided on the CPU vLLM engine, and unguided (checked only) on the
transformers engine, each in a process of its own.
"""
from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.config import ConfigError, load_config, parse_config
from batch_llm.io.formats import write_rows
from batch_llm.io.storage import Location, as_path, iter_jsonl, read_json
from batch_llm.output_schema import OutputSchema, load_schema
from batch_llm.rows.records import output_record
from helpers import ROOT, run_in_group

YAML = ROOT / "dags" / "pipelines" / "review_extraction.yaml"
SENTIMENTS = {"正面", "负面", "中性"}


@pytest.fixture(scope="module")
def schema() -> OutputSchema:
    return OutputSchema(load_config(YAML).sampling.output_schema)


def test_check_names_what_is_wrong(schema):
    ok = '{"aspect": "电池", "sentiment": "正面", "evidence": "续航很长"}'
    assert schema.check(ok) == ({"aspect": "电池", "sentiment": "正面", "evidence": "续航很长"}, None)
    assert schema.check('{"aspect": "电池", "sentiment": "好", "evidence": "x"}')[1] == \
        "invalid_output: sentiment: '好' is not one of ['正面', '负面', '中性']"
    assert schema.check('{"aspect": "电池"}')[1].startswith("invalid_output: (the whole value): 'sentiment' is a required")
    assert schema.check('{"aspect": "电')[1].startswith("invalid_output: not JSON (Unterminated string")
    assert schema.check("Sure! Here is the JSON")[1].startswith("invalid_output: not JSON")


def test_schema_from_a_pydantic_model_and_bad_schemas_refused(tmp_path, monkeypatch):
    (tmp_path / "review_types.py").write_text(
        "from typing import Literal\nfrom pydantic import BaseModel\n\n\n"
        "class Opinion(BaseModel):\n    aspect: str\n    sentiment: Literal['正面', '负面', '中性']\n"
        "    stars: int\n    tags: list[str] = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = OutputSchema(load_schema("review_types:Opinion"))
    types = {f.name: f.type for f in s.arrow_fields()}
    assert types == {"aspect": pa.string(), "sentiment": pa.string(), "stars": pa.int64(), "tags": pa.list_(pa.string())}
    with pytest.raises(ValueError, match="cannot import the output model 'review_types:Nope'"):
        load_schema("review_types:Nope")
    with pytest.raises(ValueError, match="cannot read the output schema file"):
        load_schema(str(tmp_path / "missing.json"))
    base = load_config(YAML).model_dump()
    with pytest.raises(ConfigError, match="not a valid JSON Schema"):
        parse_config({**base, "sampling": {**base["sampling"], "output_schema": {"type": "strung"}}})


def test_length_bounds_come_out_of_the_grammar_only():
    """``guided_length_bounds: check``: every string's minLength / maxLength leaves the grammar, at any depth;
    property names, enums and required lists that merely read like keywords stay."""
    from batch_llm.output_schema import without_string_length_bounds

    schema = {"type": "object", "required": ["maxLength", "tags"],
              "properties": {"maxLength": {"type": "string", "maxLength": 4, "description": "a property's name"},
                             "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1}},
                             "kind": {"enum": ["minLength", "maxLength"]},
                             "note": {"anyOf": [{"$ref": "#/$defs/short"}, {"type": "null"}]}},
              "$defs": {"short": {"type": "string", "maxLength": 8, "pattern": "^[a-z]+$"}}}
    assert without_string_length_bounds(schema) == {
        "type": "object", "required": ["maxLength", "tags"],
        "properties": {"maxLength": {"type": "string", "description": "a property's name"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"type": "string"}},
                       "kind": {"enum": ["minLength", "maxLength"]},
                       "note": {"anyOf": [{"$ref": "#/$defs/short"}, {"type": "null"}]}},
        "$defs": {"short": {"type": "string", "pattern": "^[a-z]+$"}}}
    assert schema["properties"]["maxLength"]["maxLength"] == 4  # the config's schema itself is left whole


def test_guided_decoding_needs_vllm_but_checking_does_not():
    base = load_config(YAML).model_dump()
    with pytest.raises(ConfigError, match="engine transformers cannot decode under a schema"):
        parse_config({**base, "engine": {"kind": "transformers"}})
    cfg = parse_config({**base, "engine": {"kind": "transformers"},
                        "sampling": {**base["sampling"], "guided_decoding": False}})
    assert cfg.sampling.output_schema["required"] == ["aspect", "sentiment", "evidence"]
    with pytest.raises(ConfigError, match="engine transformers cannot decode under a schema"):  # its 2nd pass
        parse_config({**base, "engine": {"kind": "transformers"},
                      "sampling": {**base["sampling"], "guided_decoding": "fallback"}})
    assert parse_config({**base, "sampling": {**base["sampling"], "guided_decoding": "fallback"}}) \
        .sampling.guided_decoding == "fallback"
    with pytest.raises(ConfigError, match="sampling.guided_decoding"):
        parse_config({**base, "sampling": {**base["sampling"], "guided_decoding": "sometimes"}})


def test_typed_parquet_columns_and_jsonl_objects(tmp_path, schema):
    rec = {"id": "a", "prompt": "p", "aspect": "an input column of the same name"}
    res = {"id": "a", "output": '{"aspect": "电池", "sentiment": "正面", "evidence": "续航很长"}',
           "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 9}
    row = output_record(rec, res, "parquet", schema=schema)
    assert row["aspect"] == "an input column of the same name" and row["output_aspect"] == "电池"
    path = as_path(str(tmp_path / "out.parquet"))
    types = [f.with_name("output_aspect" if f.name == "aspect" else f.name) for f in schema.arrow_fields()]
    write_rows(path, [row], "parquet", types=types)
    table = pq.read_table(path)
    assert table.schema.field("sentiment").type == pa.string() and table.to_pylist()[0]["sentiment"] == "正面"
    assert output_record(rec, res, "jsonl", schema=schema)["output"] == {"aspect": "电池", "sentiment": "正面",
                                                                           "evidence": "续航很长"}


# ------------------------------------------------------------------------------------------ engine runs
def _run(tmp, *sets, rows_limit=None):
    src = tmp / "reviews.parquet"
    rows = [json.loads(x) for x in (ROOT / "include" / "sample_data" / "reviews_zh.jsonl").read_text().splitlines()]
    rows = rows[:rows_limit]
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp / "out"
    args = [sys.executable, "-m", "batch_llm", "run", str(YAML), "--input", str(src), "--output", str(out),
            "--ds", "2026-11-10", "--plain", "--verbose", "--set", "cache.enabled=false"]  # vLLM's lines on stdout
    for s in sets:
        args += ["--set", s]
    run = run_in_group(args, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    current = read_json(Location(str(out)).child("review_extraction", "dt=2026-11-10", "_CURRENT.json").path())
    summary = read_json(Location(current["version"]).child("summary.json").path())
    errors = list(iter_jsonl(Location(current["version"]).child("errors.jsonl").path()))
    return pq.read_table(Location(current["dataset"]).path()), summary, errors, rows, run.stdout


def test_guided_on_vllm_every_output_valid_and_typed(tmp_path, demo_model_dir, schema):
    table, summary, errors, rows, log = _run(tmp_path)
    assert errors == [] and table.num_rows == len(rows) == 12
    for name in ("aspect", "sentiment", "evidence"):
        assert table.schema.field(name).type == pa.string()
    for r in table.to_pylist():
        assert schema.check(r["output"])[1] is None, r
        assert r["sentiment"] in SENTIMENTS and r["aspect"] and r["evidence"]
        assert r["aspect"] == json.loads(r["output"])["aspect"]
    assert "'structured_outputs_backend': 'auto'" in log or "'structured_outputs_backend': 'xgrammar'" in log


def test_length_bounds_checked_after_decoding_on_vllm(tmp_path, demo_model_dir, schema):
    """``guided_length_bounds: check``: vLLM decodes under the schema without its string bounds; what is published
    is valid against the whole schema, a value past a bound is an ``invalid_output`` row, and every row is one or
    the other. The cost of the mode shows on the 135M model: a string the grammar no longer closes at its bound
    runs on to ``max_tokens`` (the same 12 rows under ``grammar`` give no error at all: the test above)."""
    table, summary, errors, rows, log = _run(tmp_path, "sampling.guided_length_bounds=check")
    assert table.num_rows + len(errors) == len(rows) == 12
    for r in table.to_pylist():
        assert schema.check(r["output"])[1] is None, r
        assert r["sentiment"] in SENTIMENTS
    assert errors, "with the bounds out of the grammar the 135M model overruns one on some row"
    for e in errors:  # a bound broken: too long, or a string never closed before max_tokens
        assert e["stage"] == "infer" and (e["reason"].startswith("invalid_output: not JSON (Unterminated string")
                                          or e["reason"].endswith("is too long")), e


def test_guided_with_the_guidance_backend_on_vllm(tmp_path, demo_model_dir, schema):
    """llguidance (vLLM's `guidance` backend, and its fallback under `auto`) on the demo model: every output valid.
    Before the demo build set a plain byte-level decoder, every row stopped after `"sentiment":"` (the H200 run)."""
    table, summary, errors, rows, log = _run(
        tmp_path, 'engine.extra={"structured_outputs_config": {"backend": "guidance"}}', rows_limit=6)
    assert "'structured_outputs_backend': 'guidance'" in log
    assert errors == [] and table.num_rows == len(rows) == 6
    for r in table.to_pylist():
        assert schema.check(r["output"])[1] is None, r
        assert r["sentiment"] in SENTIMENTS


def test_demo_tokenizer_reads_as_bytes_for_llguidance(demo_model_dir, schema):
    """llguidance reads each token's bytes from the tokenizer: "Ġ" must be a space, and the Chinese enum of the
    review schema must be spellable token by token (the GGUF conversion's decoder chain broke both)."""
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    lt = llguidance.hf.from_tokenizer(tok)
    assert lt.decode_bytes(tok.convert_tokens_to_ids(["ĠĠ"])) == b"  "
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema.schema, defaults={"whitespace_flexible": False})
    for sentiment in sorted(SENTIMENTS):
        m = llguidance.LLMatcher(lt, grammar)
        text = f'{{"aspect":"电池","sentiment":"{sentiment}","evidence":"续航很长"}}'
        for t in tok.encode(text, add_special_tokens=False):
            mask = allocate_token_bitmask(1, lt.vocab_size)
            fill_next_token_bitmask(m, mask, 0)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, (sentiment, tok.decode([t]), m.get_error()[:80])
            assert m.consume_token(t), m.get_error()[:200]
        assert m.is_accepting(), sentiment


def test_byte_level_decoder_replaces_only_a_byte_level_chain(tmp_path):
    from batch_llm.demo_model import BYTE_LEVEL_DECODER, byte_level_decoder

    chain = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"},
                                              {"type": "ByteLevel", "add_prefix_space": True}]}
    spm = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip"}]}
    for decoder, changed in ((chain, True), (spm, False), (BYTE_LEVEL_DECODER, False)):
        f = tmp_path / "tokenizer.json"
        f.write_text(json.dumps({"model": {"vocab": {"中": 0}}, "decoder": decoder}, ensure_ascii=False))
        assert byte_level_decoder(f) is changed
        after = json.loads(f.read_text(encoding="utf-8"))
        assert after == {"model": {"vocab": {"中": 0}}, "decoder": BYTE_LEVEL_DECODER if changed else decoder}
        assert byte_level_decoder(f) is False  # idempotent


def test_unguided_outputs_are_checked_and_invalid_ones_reported_as_rows(tmp_path, demo_model_dir, schema):
    """Checked only (the transformers engine cannot guide), sampled, one more try for an invalid answer: the
    task succeeds (invalid outputs are not engine errors), each invalid row is reported with its reason."""
    table, summary, errors, rows, log = _run(tmp_path, "engine.kind=transformers", "sampling.guided_decoding=false",
                                             "sampling.max_tokens=48", "sampling.temperature=0.7",
                                             "sampling.output_retries=1", rows_limit=6)
    invalid = [e for e in errors if e["reason"].startswith("invalid_output: ")]
    assert invalid, "a 135M model without guidance should miss the schema at least once"
    assert len(invalid) + table.num_rows == len(rows)  # every row is published or reported, none lost
    for r in table.to_pylist():  # what was published is valid
        assert schema.check(r["output"])[1] is None
    assert {e["stage"] for e in errors} == {"infer"}
    (manifest,) = tmp_path.glob("out/review_extraction/runs/*/*/infer/shard-*/manifest.json")
    m = json.loads(manifest.read_text())["metrics"]
    assert m["invalid_outputs"] == len(invalid) and m["errors"] == len(invalid)
    assert m["outputs_asked_again"] >= len(invalid)  # every row that ended invalid was asked twice
    assert f"asking again for {m['outputs_asked_again']} invalid outputs (attempt 2)" in log


# Completion prompts (OpenAI Batch /v1/completions lines) that the 135M demo model continues with a bare number
# (a valid output under {"type": "integer"}) or with prose (a miss): greedy, so each run sees the same first pass.
NUMBER_PROMPTS = ["1, 2, 3, 4,", "2 + 3 =", "10, 20, 30, 40,", "Once upon a time", "The weather today is",
                  "5, 6, 7, 8,"]


def _numbers_run(tmp, guided_decoding: bool | str):
    tmp.mkdir()
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": "demo", "prompt": p}}) + "\n"
                           for i, p in enumerate(NUMBER_PROMPTS)))
    yaml = tmp / "numbers.yaml"
    yaml.write_text(json.dumps({
        "name": "numbers", "model": {"ref": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "input": {"path": str(src), "format": "openai_batch"}, "output": {"path": str(tmp / "out")},
        "engine": {"kind": "vllm", "max_model_len": 512, "enforce_eager": True},
        "sampling": {"max_tokens": 12, "temperature": 0.0, "stop": ["\n", ".", ","],
                     "output_schema": {"type": "integer", "minimum": 0}, "guided_decoding": guided_decoding},
        "filter": {"enabled": False}, "evaluate": {"enabled": False}, "cache": {"enabled": False}}))
    run = run_in_group([sys.executable, "-m", "batch_llm", "run", str(yaml), "--ds", "2026-11-10", "--plain"],
                       timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    current = read_json(Location(str(tmp / "out")).child("numbers", "dt=2026-11-10", "_CURRENT.json").path())
    lines = list(iter_jsonl(Location(current["dataset"]).path()))
    texts = {x["custom_id"]: x["response"]["body"]["choices"][0]["text"] for x in lines}
    errors = {e["custom_id"] for e in iter_jsonl(Location(current["version"]).child("errors.jsonl").path())}
    (manifest,) = tmp.glob("out/numbers/runs/*/*/infer/shard-*/manifest.json")
    report = Location(current["version"]).child("report.html").path().read_text(encoding="utf-8")
    return texts, errors, json.loads(manifest.read_text())["metrics"], run.stdout + report


def test_fallback_decodes_freely_and_only_the_misses_again_under_the_schema(tmp_path, demo_model_dir):
    """``guided_decoding: fallback``: the first pass is free (the plain rate); an output that matches the schema
    is published as it came, and only the misses are decoded again under the schema, once. Against the same rows
    checked only: the same valid outputs, and every miss there is valid here."""
    free, missed, m_free, _ = _numbers_run(tmp_path / "free", False)
    assert 0 < len(free) < len(NUMBER_PROMPTS) and len(free) + len(missed) == len(NUMBER_PROMPTS), (free, missed)
    assert m_free["outputs_asked_again"] == 0
    texts, errors, m, log = _numbers_run(tmp_path / "fallback", "fallback")
    assert errors == set() and set(texts) == {f"q{i}" for i in range(len(NUMBER_PROMPTS))}
    assert {k: texts[k] for k in free} == free  # a free output that matched is kept as it came
    for k, text in texts.items():
        assert isinstance(json.loads(text), int) and json.loads(text) >= 0, (k, text)
    assert m["outputs_asked_again"] == len(missed)  # only the misses, once
    assert f"asking again for {len(missed)} invalid outputs (attempt 2, under the schema)" in log
    assert "output schema (decoded freely, the misses again under it)" in log  # the run's report says how
