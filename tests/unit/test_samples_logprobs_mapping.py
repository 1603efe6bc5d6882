"""n > 1 samples and top-k log-probabilities without an engine: the config and per-row parameters that ask
for them (and the engines that refuse them), vLLM's outputs turned into typed results, the shard's result
rows, cache keys, the content filter over every sample, and the published shapes (Parquet list and struct
columns, JSONL lists, OpenAI Batch ``choices`` with ``logprobs``). tests/system/test_samples_logprobs.py runs
them on the real CPU vLLM engine."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.cache.results import namespace, prompt_key
from batch_llm.config import ConfigError, FilterConfig, WordListConfig
from batch_llm.engines.base import GenResult, Sample, TokenLogprob, TopLogprob
from batch_llm.engines.vllm_engine import gen_result, token_logprobs
from batch_llm.io.formats import write_rows
from batch_llm.io.storage import Location, as_path, iter_jsonl, write_jsonl
from batch_llm.rows.params import RowParams, engine_refusal, resolve
from batch_llm.rows.records import output_record
from batch_llm.stages import plan as plan_mod
from batch_llm.stages.content_filter import ContentFilter
from batch_llm.stages.infer.identity import sampling_identity
from batch_llm.stages.infer.results import SAMPLE_FIELDS, result_row, sample_fields
from batch_llm.stages.shard_merge import finish_shard
from helpers import demo_config

CHAT = "/v1/chat/completions"


# ------------------------------------------------------------------------------------------ config, row params
def test_pipeline_level_n_and_logprobs_and_their_bounds(tmp_path):
    cfg = demo_config(tmp_path, sampling__n=3, sampling__logprobs=5)
    s = resolve(None, cfg.sampling)
    assert (s.n, s.logprobs) == (3, 5)
    assert (resolve(None, demo_config(tmp_path).sampling).n, resolve(None, demo_config(tmp_path).sampling).logprobs) \
        == (1, None)
    for key, value, words in (("n", 0, "sampling.n: Input should be greater than or equal to 1"),
                              ("logprobs", 21, "sampling.logprobs: Input should be less than or equal to 20")):
        with pytest.raises(ConfigError, match=words):
            demo_config(tmp_path, **{f"sampling__{key}": value})


def test_engines_without_samples_refuse_them_at_config_load(tmp_path):
    with pytest.raises(ConfigError, match=r"sampling.n and sampling.logprobs: engine transformers returns one sample "
                                          r"without log-probabilities \(vllm and sglang can\)"):
        demo_config(tmp_path, engine__kind="transformers", sampling__n=2, sampling__logprobs=0)
    with pytest.raises(ConfigError, match="sampling.logprobs: engine transformers"):
        demo_config(tmp_path, engine__kind="transformers", sampling__logprobs=0)
    assert demo_config(tmp_path, engine__kind="transformers", sampling__n=1).sampling.n == 1


@pytest.mark.parametrize("body,expected", [
    ({"n": 3}, {"n": 3}),
    ({"logprobs": True}, {"logprobs": 0}),                       # the chosen token's logprob only
    ({"logprobs": True, "top_logprobs": 4}, {"logprobs": 4}),
    ({"logprobs": False, "top_logprobs": 0}, None),
    ({"n": 1, "logprobs": False}, {"n": 1}),
])
def test_chat_bodies_ask_for_samples_and_logprobs(body, expected):
    p = RowParams.from_openai_body({"messages": [], **body})
    assert (p.to_json() if p else None) == expected


@pytest.mark.parametrize("body,words", [
    ({"top_logprobs": 3}, "top_logprobs=3 needs logprobs: true"),
    ({"logprobs": 3}, "logprobs must be true or false in a chat body"),
    ({"logprobs": True, "top_logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
    ({"n": 0}, "n must be in"), ({"n": "2"}, "n must be a positive integer"),
    ({"best_of": 2}, "best_of=2 is not supported"), ({"echo": True}, "echo=True is not supported"),
])
def test_what_bodies_cannot_ask_is_named(body, words):
    with pytest.raises(ValueError, match=words):
        RowParams.from_openai_body({"messages": [], **body})


def test_completions_bodies_give_k_as_logprobs():
    assert RowParams.from_openai_body({"prompt": "x", "logprobs": 2}, completions=True).to_json() == {"logprobs": 2}
    assert RowParams.from_openai_body({"prompt": "x", "logprobs": 0}, completions=True).to_json() == {"logprobs": 0}
    with pytest.raises(ValueError, match="top_logprobs is a chat field"):
        RowParams.from_openai_body({"prompt": "x", "top_logprobs": 2}, completions=True)


def test_row_values_win_and_other_engines_refuse_them_per_row(tmp_path):
    cfg = demo_config(tmp_path, sampling__n=2)
    assert resolve(RowParams(n=4, logprobs=1), cfg.sampling).n == 4
    assert resolve(RowParams(max_tokens=3), cfg.sampling).n == 2
    assert engine_refusal(RowParams(n=2, logprobs=3), "vllm") is None
    assert engine_refusal(RowParams(n=2, logprobs=3), "transformers") == \
        "engine transformers cannot apply per-row logprobs, n (vllm and sglang can)"
    assert engine_refusal(RowParams(logprobs=0), "lmdeploy") == (
        "engine lmdeploy cannot apply per-row logprobs (vllm and sglang can)")


def test_table_columns_n_and_logprobs_reach_the_shard_rows(tmp_path):
    p = tmp_path / "in.csv"
    p.write_text("id,prompt,n,logprobs\na,hi,3,2\nb,hi,,\nc,hi,0,\nd,hi,,25\n")
    cfg = demo_config(tmp_path, input__path=str(p), input__sampling_columns=["n", "logprobs"])
    m = plan_mod.write_plan(cfg, input_loc=Location(str(p)), plan_dir=Location(str(tmp_path / "plan")))
    rows = {r["id"]: r for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    errors = {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}
    assert rows["a"]["params"] == {"n": 3, "logprobs": 2} and "params" not in rows["b"]
    assert errors == {"c": "n must be in [1, 128], got 0", "d": "logprobs must be in [0, 20], got 25"}
    cfg_t = demo_config(tmp_path / "t", input__path=str(p), input__sampling_columns=["n", "logprobs"],
                        engine__kind="transformers")
    m = plan_mod.write_plan(cfg_t, input_loc=Location(str(p)), plan_dir=Location(str(tmp_path / "plan_t")))
    errors = {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}
    assert errors["a"] == "engine transformers cannot apply per-row logprobs, n (vllm and sglang can)"


# ------------------------------------------------------------------------------------------ cache keys
def test_cache_keys_differ_by_n_and_logprobs_and_old_namespaces_stay(tmp_path):
    basis = ["chat", [{"role": "user", "content": "hi"}]]
    keys = {prompt_key(basis), prompt_key(basis, RowParams(n=3).to_json()),
            prompt_key(basis, RowParams(logprobs=3).to_json()), prompt_key(basis, RowParams(n=3, logprobs=3).to_json())}
    assert len(keys) == 4  # a cached n=1 answer never serves an n=3 request
    base = demo_config(tmp_path).sampling
    # what namespaces hashed before these fields
    old = base.model_dump(exclude={"max_tokens_cap", "n", "logprobs", "guided_length_bounds", "top_k", "min_p",
                                   "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
                                   "chat_template_kwargs", "thinking", "max_thinking_tokens"})
    assert sampling_identity(base) == old

    def ns(s):
        return namespace({"model": "m", "chat_template": "t", "sampling": sampling_identity(s), "engine": {"kind": "vllm"}})

    assert len({ns(base), ns(demo_config(tmp_path, sampling__n=3).sampling),
                ns(demo_config(tmp_path, sampling__logprobs=0).sampling),
                ns(demo_config(tmp_path, sampling__guided_length_bounds="check").sampling)}) == 4


# ------------------------------------------------------------------------------------------ vLLM outputs
def _lp(logprob, rank, token):
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def test_vllm_logprobs_become_typed_tokens_with_the_top_k():
    # position 1: the chosen token (7) ranks 5th, below the top 2; vLLM adds it to the position's dict
    positions = [{5: _lp(-0.1, 1, "Hi"), 6: _lp(-2.5, 2, "Hello")},
                 {8: _lp(-0.3, 1, "!"), 9: _lp(-1.9, 2, "."), 7: _lp(-4.0, 5, " there")}]
    toks = token_logprobs([5, 7], positions, 2)
    assert toks[0] == TokenLogprob("Hi", -0.1, (TopLogprob("Hi", -0.1), TopLogprob("Hello", -2.5)))
    assert toks[1].token == " there" and toks[1].logprob == -4.0
    assert [t.token for t in toks[1].top] == ["!", "."]
    assert token_logprobs([5], [{5: _lp(-0.2, 1, None)}], 0)[0] == TokenLogprob("token_id:5", -0.2, ())


def test_vllm_request_output_with_n_samples():
    def comp(text, ids, reason, logprobs=None, stop=None):
        return SimpleNamespace(text=text, token_ids=ids, finish_reason=reason, logprobs=logprobs, stop_reason=stop)

    out = SimpleNamespace(request_id="k", prompt_token_ids=[1, 2, 3], num_cached_tokens=0,
                          outputs=[comp("a b", [4, 5], "stop", stop="###"), comp("c", [6], "length"),
                                   comp("d e f", [7, 8, 9], "stop", stop=2)])
    res = gen_result(out)
    assert (res.text, res.finish_reason, res.completion_tokens) == ("a b", "stop", 6)  # every sample's tokens
    assert [s.text for s in res.samples] == ["a b", "c", "d e f"] and res.samples[1].finish_reason == "length"
    assert res.stop_reason == "###" and [s.stop_reason for s in res.samples] == ["###", None, 2]
    single = SimpleNamespace(**{**vars(out), "outputs": out.outputs[:1]})
    assert gen_result(single).samples is None  # nothing asked beyond one text: no samples carried
    with_lp = SimpleNamespace(**{**vars(out), "outputs": [comp("a", [4], "stop", [{4: _lp(-0.5, 1, "a")}])]})
    assert gen_result(with_lp, 0).samples[0].logprobs == (TokenLogprob("a", -0.5, ()),)


# ------------------------------------------------------------------------------------------ result rows
def _token(text, lp, top):
    return TokenLogprob(text, lp, tuple(TopLogprob(t, v) for t, v in top))


HI = (_token("Hi", -0.1, [("Hi", -0.1), ("Hey", -2.0)]), _token("!", -0.4, [("!", -0.4), (".", -1.5)]))
HEY = (_token("Hey", -2.0, [("Hi", -0.1), ("Hey", -2.0)]), _token(" there", -0.9, [(" there", -0.9), ("!", -1.0)]),
       _token("x", -3.0, [("y", -1.0), ("x", -3.0)]))
RES = GenResult("k", text="Hi!", finish_reason="stop", prompt_tokens=4, completion_tokens=5,
                samples=(Sample("Hi!", "stop", 2, HI), Sample("Hey there", "length", 3, HEY)))


def _row(res=RES):
    return {**result_row(("r1", 0), {"output": res.text, "finish_reason": res.finish_reason,
                                      "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                                      **sample_fields(res)}, cached=False, key="K"), "id": "r1"}


def test_result_rows_carry_every_sample_and_the_first_ones_logprobs():
    row = _row()
    assert row["output"] == row["outputs"][0] == "Hi!" and row["outputs"] == ["Hi!", "Hey there"]
    assert row["finish_reasons"] == ["stop", "length"] and row["completion_tokens"] == 5
    assert json.loads(json.dumps(row["logprobs"][1])) == {
        "token": "!", "logprob": -0.4, "top": [{"token": "!", "logprob": -0.4}, {"token": ".", "logprob": -1.5}]}
    assert [len(x) for x in row["outputs_logprobs"]] == [2, 3]
    plain = _row(GenResult("k", text="x", finish_reason="stop", completion_tokens=1))
    assert not set(SAMPLE_FIELDS) & set(plain)  # a row that asked nothing more has none of the columns
    # a cache hit gives back what the entry stored
    hit = result_row(("r2", 1), {**{k: row[k] for k in row if k not in ("id", "idx")}, "key": "K"}, cached=True,
                      key="K")
    assert {k: hit[k] for k in SAMPLE_FIELDS} == {k: row[k] for k in SAMPLE_FIELDS}


def test_committed_chunks_keep_the_sample_fields_through_the_merge(tmp_path):
    """A resumed shard merges the chunks committed before it stopped: the new fields must come through."""
    shard_dir = Location(str(tmp_path / "shard"))
    chunks = shard_dir.child("chunks")
    row = _row()
    write_jsonl(chunks.child("chunk-00000-a.jsonl").path(), [row])
    shard_rows = tmp_path / "rows.jsonl"
    shard_rows.write_text(json.dumps({"id": "r1", "idx": 0}) + "\n")
    m = finish_shard(0, shard_dir, chunks, Location(str(shard_rows)).path(), 1)
    (merged,) = iter_jsonl(Location(m.outputs).path())
    assert {k: merged[k] for k in SAMPLE_FIELDS} == json.loads(json.dumps({k: row[k] for k in SAMPLE_FIELDS}))
    assert m.metrics.output_tokens == 5  # every sample's tokens


# ------------------------------------------------------------------------------------------ content filter
def test_filter_scans_every_sample(tmp_path):
    words = tmp_path / "w.txt"
    words.write_text("there\n")
    mask = ContentFilter(FilterConfig(lists=[WordListConfig(name="w", path=str(words), action="mask")]))
    out, hits = mask.apply({"output": "a", "outputs": ["a", "Hey there"]})
    assert out["outputs"] == ["a", "Hey *****"] and out["output"] == "a"
    assert hits == [{"list": "w", "word": "there", "action": "mask", "start": 4, "end": 9, "sample": 1}]
    out, _ = mask.apply({"output": "there", "outputs": ["there", "x"]})
    assert out["output"] == out["outputs"][0] == "*****"  # output stays the first sample, masked with it
    drop = ContentFilter(FilterConfig(lists=[WordListConfig(name="w", path=str(words), action="drop")]))
    assert drop.apply({"output": "a", "outputs": ["a", "b", "over there"]})[0] is None  # any sample drops the row
    assert drop.apply({"output": "over there"})[1][0].get("sample") is None  # one sample: hits as before


# ------------------------------------------------------------------------------------------ published shapes
def test_parquet_list_and_struct_columns(tmp_path):
    rec = {"id": "r1", "prompt": "hi", "n": 2, "logprobs": 2}
    # the row without the columns first: every column any row of a batch has is written
    rows = [output_record({"id": "r2", "prompt": "hi", "n": None, "logprobs": None},
                          {"id": "r2", "output": "x", "finish_reason": "stop", "completion_tokens": 1}, "parquet"),
            output_record(rec, json.loads(json.dumps(_row())), "parquet")]
    path = as_path(str(tmp_path / "out.parquet"))
    write_rows(path, rows, "parquet")
    t = pq.read_table(path)
    top = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
    token = pa.struct([("token", pa.string()), ("logprob", pa.float64()), ("top", pa.list_(top))])
    assert t.schema.field("outputs").type == pa.list_(pa.string())
    assert t.schema.field("logprobs").type == pa.list_(token)  # the input's n/logprobs cells are replaced
    assert t.schema.field("outputs_logprobs").type == pa.list_(pa.list_(token))
    got = t.to_pylist()
    assert got[1]["outputs"] == ["Hi!", "Hey there"] and got[0]["outputs"] is None and got[0]["logprobs"] is None
    assert got[1]["logprobs"][0]["top"][1] == {"token": "Hey", "logprob": -2.0}
    assert len(got[1]["outputs_logprobs"][1]) == 3 and got[0]["outputs_logprobs"] is None
    assert output_record(rec, _row(), "jsonl")["outputs"] == ["Hi!", "Hey there"]


def test_openai_batch_lines_have_n_choices_and_openai_logprobs():
    row = json.loads(json.dumps(_row()))
    line = output_record({"custom_id": "c1", "url": CHAT}, row, "openai_batch", model="m")
    body = line["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hi!", "Hey there"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    content = body["choices"][1]["logprobs"]["content"]
    assert len(content) == 3 and content[1] == {
        "token": " there", "logprob": -0.9, "bytes": list(b" there"),
        "top_logprobs": [{"token": " there", "logprob": -0.9, "bytes": list(b" there")},
                         {"token": "!", "logprob": -1.0, "bytes": [33]}]}
    assert body["usage"]["completion_tokens"] == 5
    cmpl = output_record({"custom_id": "c2", "url": "/v1/completions"}, {**row, "outputs": None,
                         "outputs_logprobs": None}, "openai_batch")["response"]["body"]["choices"]
    assert len(cmpl) == 1 and cmpl[0]["logprobs"] == {"tokens": ["Hi", "!"], "token_logprobs": [-0.1, -0.4],
                                                      "top_logprobs": [{"Hi": -0.1, "Hey": -2.0}, {"!": -0.4, ".": -1.5}],
                                                      "text_offset": [0, 2]}
    plain = output_record({"custom_id": "c3", "url": CHAT}, {"id": "c3", "idx": 2, "output": "x", "finish_reason": "stop"},
                          "openai_batch")["response"]["body"]["choices"]
    assert plain == [{"index": 0, "finish_reason": "stop", "stop_reason": None, "logprobs": None,
                      "message": {"role": "assistant", "content": "x"}}]
