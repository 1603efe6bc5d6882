"""OpenAI Batch ``/v1/embeddings`` lines for an embedding pipeline (engine.task: embed): every body field honoured or
refused with the reason, the lines planned into embed rows (a line to another endpoint that line's error), the output
lines in OpenAI's embeddings shape (floats or base64), and the ``openai_batch`` section's endpoints checked against
the task."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from batch_llm.batch_api.runs import create_batch, run_overrides, serving_pipelines
from batch_llm.batch_api.store import BatchStore
from batch_llm.config import ConfigError, parse_config
from batch_llm.io.storage import Location, iter_jsonl
from batch_llm.rows.openai_batch import OutputLine, answer_line
from batch_llm.rows.params import EMBED_HONOURED, EMBED_NO_EFFECT, EMBED_REFUSED, RowParams
from batch_llm.rows.records import output_record
from helpers import demo_config, plan_lines
from test_batch_api import upload, write_pipeline
from test_sampling_keys import _class_fields

EMB = "/v1/embeddings"
CHAT = "/v1/chat/completions"
# What OpenAI's embeddings endpoint takes (openai 3.57's EmbeddingCreateParams), where the package is not installed
OPENAI_EMBEDDINGS = ("input", "model", "dimensions", "encoding_format", "user")
# vLLM's EmbeddingCompletionRequest is these mixins (read from its source, not imported)
VLLM_EMBEDDINGS = [("entrypoints/pooling/base/protocol.py", c) for c in (
    "PoolingBasicRequestMixin", "CompletionRequestMixin", "EncodingRequestMixin", "EmbedRequestMixin",
    "EmbeddingTokenizeParamsMixin")] + [("entrypoints/pooling/embed/protocol.py", "EmbeddingCompletionRequest")]


def _openai_fields() -> set[str]:
    try:
        from openai.types import EmbeddingCreateParams
    except ImportError:
        return set(OPENAI_EMBEDDINGS)
    return set(EmbeddingCreateParams.__annotations__)


def test_every_openai_and_vllm_embeddings_field_is_honoured_or_refused():
    vllm_fields = set().union(*(_class_fields(*c) for c in VLLM_EMBEDDINGS))
    fields = _openai_fields() | vllm_fields
    assert len(vllm_fields) > 12  # the walk found vLLM's request classes
    known = EMBED_HONOURED | set(EMBED_NO_EFFECT) | set(EMBED_REFUSED)
    assert sorted(fields - known) == [], "an embeddings field with no verdict: add it to rows/params.py's tables"
    sentinel = {"not": "neutral"}
    for name in sorted(fields - EMBED_HONOURED):
        body = {"input": "hi", name: sentinel}
        if name in EMBED_NO_EFFECT:
            assert RowParams.from_embeddings_body(body) is None, name
            continue
        with pytest.raises(ValueError) as e:
            RowParams.from_embeddings_body(body)
        assert str(e.value).startswith(f"{name}=") and EMBED_REFUSED[name][1] in str(e.value), (name, str(e.value))
        assert RowParams.from_embeddings_body({"input": "hi", name: EMBED_REFUSED[name][0][-1]}) is None, name
    assert RowParams.from_embeddings_body({"input": "hi", "dimensions": 64}) == RowParams(dimensions=64)
    for bad, words in [({"dimensions": 0}, "dimensions must be a positive integer"),
                       ({"dimensions": True}, "dimensions must be a positive integer"),
                       ({"encoding_format": "binary"}, "encoding_format must be float or base64"),
                       ({"frobnicate": 1}, "frobnicate: not a field of an OpenAI or vLLM embeddings request")]:
        with pytest.raises(ValueError, match=words):
            RowParams.from_embeddings_body({"input": "hi", **bad})


def _line(cid, body, url=EMB):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "vec", **body}}


def test_embeddings_lines_plan_into_embed_rows_and_the_rest_are_row_errors(tmp_path):
    m, rows, errors = plan_lines(tmp_path, [
        _line("s", {"input": "The cat is on the table.", "encoding_format": "base64", "user": "u1"}),
        _line("one", {"input": ["in a list"], "dimensions": 32}),
        _line("ids", {"input": [[1, 2, 3]]}),
        _line("many", {"input": ["a", "b"]}),
        _line("empty", {"input": "  "}),
        _line("none", {}),
        _line("fmt", {"input": "x", "encoding_format": "binary"}),
        _line("act", {"input": "x", "use_activation": False}),
        _line("chat", {"messages": [{"role": "user", "content": "hi"}]}, CHAT),
    ], engine__task="embed")
    assert m.format == "openai_batch" and set(rows) == {"s", "one", "ids"}
    assert rows["s"]["text"] == "The cat is on the table." and "params" not in rows["s"]
    assert rows["one"]["text"] == "in a list" and rows["one"]["params"] == {"dimensions": 32}
    assert rows["ids"]["prompt_token_ids"] == [1, 2, 3]
    assert "a list of 2 inputs" in errors["many"] and "a line of its own" in errors["many"]
    assert errors["empty"] == "empty input" and "needs 'input'" in errors["none"]
    assert "encoding_format must be float or base64" in errors["fmt"]
    assert "use_activation=False" in errors["act"] and "engine.embed.normalize" in errors["act"]
    assert "asks for generated text; this pipeline's engine.task embed answers /v1/embeddings" in errors["chat"]


def test_an_embeddings_line_to_a_generating_pipeline_is_its_error(tmp_path):
    _, rows, errors = plan_lines(tmp_path, [_line("e", {"input": "x"}),
                                       _line("c", {"messages": [{"role": "user", "content": "hi"}]}, CHAT)])
    assert set(rows) == {"c"}
    assert "url '/v1/embeddings' asks for a vector; this pipeline's engine.task generate answers" in errors["e"]


def test_a_batch_of_the_api_names_its_one_endpoint(tmp_path):
    """input.openai_urls (a batch's endpoint) within what the task answers; a line to another is its error."""
    _, rows, errors = plan_lines(tmp_path, [_line("e", {"input": "x"})], engine__task="embed",
                            input__openai_urls=[EMB])
    assert set(rows) == {"e"} and not errors
    with pytest.raises(ConfigError, match=r"input.openai_urls: /v1/chat/completions not answered by engine.task "
                                          r"embed \(it answers /v1/embeddings\)"):
        demo_config(tmp_path, engine__task="embed", input__openai_urls=[CHAT])
    with pytest.raises(ConfigError, match=r"input.openai_urls: /v1/embeddings not answered by engine.task generate"):
        demo_config(tmp_path, input__openai_urls=[EMB])


RESULT = {"id": "r1", "idx": 0, "output": None, "embedding": [0.6, -0.8, 0.1], "prompt_tokens": 5,
          "completion_tokens": 0}


@pytest.mark.parametrize("encoding", [None, "float", "base64"])
def test_output_line_is_openais_embeddings_response(encoding):
    from openai.types import CreateEmbeddingResponse

    body = {"model": "vec", "input": "x", **({"encoding_format": encoding} if encoding else {})}
    written = output_record({"custom_id": "a", "url": EMB, "body": body}, RESULT, "openai_batch", model="m",
                            run_id="run")
    line = answer_line(json.loads(json.dumps(written)))
    assert isinstance(line, OutputLine) and line.custom_id == "a" and line.response.status_code == 200
    resp = line.response.body
    parsed = CreateEmbeddingResponse.model_validate(resp) if encoding != "base64" else None
    assert resp["object"] == "list" and resp["model"] == "m"
    assert resp["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [d["index"] for d in resp["data"]] == [0] and resp["data"][0]["object"] == "embedding"
    vector = resp["data"][0]["embedding"]
    if encoding == "base64":  # little-endian float32 bytes, as OpenAI's client decodes them
        assert isinstance(vector, str)
        decoded = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        assert decoded.tolist() == np.asarray(RESULT["embedding"], dtype=np.float32).tolist()
    else:
        assert parsed is not None and parsed.data[0].embedding == RESULT["embedding"]
    error = output_record({"custom_id": "b", "url": EMB, "body": body}, {**RESULT, "error": "too long"},
                          "openai_batch", model="m", run_id="run")
    assert error["response"]["status_code"] == 400 and error["response"]["body"]["error"]["message"] == "too long"


def test_the_section_serves_embeddings_for_an_embedding_pipeline(tmp_path):
    base = {"name": "p", "model": {"ref": "x"}, "input": {"path": "in.jsonl"}, "output": {"path": "/tmp/o"}}
    embed = {**base, "engine": {"task": "embed"}}
    assert parse_config({**embed, "openai_batch": {"models": ["vec"]}}, "t").openai_batch.endpoints == [EMB]
    assert parse_config({**base, "openai_batch": {"models": ["m"]}}, "t").openai_batch.endpoints == [CHAT]
    with pytest.raises(ConfigError, match=r"/v1/chat/completions not answered by engine.task embed \(it answers "
                                          r"/v1/embeddings; /v1/chat/completions is answered by engine.task: generate"):
        parse_config({**embed, "openai_batch": {"models": ["vec"], "endpoints": [CHAT]}}, "t")
    with pytest.raises(ConfigError, match=r"/v1/embeddings not answered by engine.task generate .*answered by "
                                          r"engine.task: embed"):
        parse_config({**base, "openai_batch": {"models": ["m"], "endpoints": [EMB]}}, "t")
    with pytest.raises(ConfigError, match=r"engine.task classify \(it answers no OpenAI endpoint"):
        parse_config({**base, "engine": {"task": "classify"}, "openai_batch": {"models": ["c"]}}, "t")


def test_an_embeddings_batch_routes_to_the_embedding_pipeline(tmp_path):
    folder = tmp_path / "pipelines"
    write_pipeline(folder, "chat", {"models": ["gpt"]})
    write_pipeline(folder, "vectors", {"models": ["vec"]}, task="embed")  # its endpoint: the task's default
    write_pipeline(folder, "wrong", {"models": ["w"], "endpoints": [EMB, CHAT]}, task="embed")
    pipelines, problems = serving_pipelines(folder)
    assert {p.dag_id: p.section.endpoints for p in pipelines} == {"chat": [CHAT], "vectors": [EMB]}
    assert any("wrong.yaml" in p and "/v1/chat/completions not answered by engine.task embed" in p for p in problems)
    store = BatchStore(Location(str(tmp_path / "store")))
    f = upload(store, json.dumps(_line("a", {"input": "hi"})).encode() + b"\n")
    record, serving = create_batch(store, pipelines, owner="alice",
                                   body={"input_file_id": f["id"], "endpoint": EMB, "completion_window": "24h"})
    assert serving.dag_id == "vectors" and record["endpoint"] == EMB
    assert run_overrides(store, record)["input.openai_urls"] == [EMB]
    from batch_llm.batch_api.errors import ApiError

    g = upload(store, json.dumps({**_line("a", {"input": "hi"}), "body": {"model": "gpt", "input": "hi"}}).encode()
               + b"\n")
    with pytest.raises(ApiError) as e:  # the chat model's pipeline serves no embeddings: 400, as OpenAI's
        create_batch(store, pipelines, owner="alice",
                     body={"input_file_id": g["id"], "endpoint": EMB, "completion_window": "24h"})
    assert e.value.status == 400 and e.value.param == "endpoint"


def test_a_plan_in_parts_plans_embeddings_lines_as_one_task_does(tmp_path):
    from batch_llm import api
    from batch_llm.layout import RunLayout

    folder = tmp_path / "in"
    folder.mkdir()
    for name, lines in {"a.jsonl": [_line("a0", {"input": "one"}), _line("a1", {"input": [[5, 6]], "dimensions": 8}),
                                    _line("chat", {"messages": [{"role": "user", "content": "hi"}]}, CHAT)],
                        "b.jsonl": [_line("b0", {"input": "two", "encoding_format": "base64"}),
                                    _line("a0", {"input": "again"})]}.items():
        (folder / name).write_text("".join(json.dumps(x) + "\n" for x in lines))

    def plan(run_id, **over):
        cfg = demo_config(tmp_path, input__path=str(folder), engine__task="embed", output__parts=True,
                          sharding__rows_per_shard=2, **over)
        return api.plan_shards(cfg, RunLayout.for_run(cfg, run_id=run_id, ds="2026-12-07"))

    one, parted = plan("one"), plan("parted", sharding__plan_part_bytes=200)
    assert parted.parts == 2 and (one.valid, one.invalid, one.duplicates) == (3, 2, 1)
    rows = [sorted((r for s in m.shards for r in iter_jsonl(Location(s.url).path())), key=lambda r: r["idx"])
            for m in (one, parted)]
    assert rows[0] == rows[1] and [r.get("text") for r in rows[0]] == ["one", None, "two"]
    assert list(parted.iter_records({})) == list(one.iter_records({}))
    assert list(iter_jsonl(Location(parted.errors).path())) == list(iter_jsonl(Location(one.errors).path()))
