"""n > 1 samples and top-k log-probabilities on the real CPU vLLM engine, through ``batch-llm run``.

One engine start for the module: a Parquet table whose rows ask, in their own columns, for 3 seeded samples,
for greedy top-3 logprobs, for both, or for nothing; then an OpenAI Batch file with the same requests in
request bodies, in the same output folder. The second run is served from the result cache that the first one
wrote (same prompts, same parameters: same keys), so its ``choices`` and ``logprobs`` are the engine's, carried
through the cache table, and no second engine starts.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.io.storage import Location, iter_jsonl
from helpers import run_demo_cli

DS = "2026-11-21"
# (id, prompt, n, logprobs, temperature, seed, max_tokens)
ROWS = [("samples", "Name a fruit.", 3, None, 0.8, 7, 8),
        ("greedy_lp", "What is the capital of France?", None, 3, 0.0, None, 8),
        ("both", "Say hello.", 2, 2, 0.7, 3, 6),
        ("plain", "What is 2+2?", None, None, None, None, None)]
COLUMNS = ("id", "prompt", "n", "logprobs", "temperature", "seed", "max_tokens")
SETS = ["sharding.num_shards=1", "evaluate.enabled=false", "filter.enabled=false", "sampling.max_tokens=8",
        "input.sampling_columns=[n, logprobs, temperature, seed, max_tokens]"]


def _body(row: tuple) -> dict:
    rid, prompt, n, logprobs, temperature, seed, max_tokens = row
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}]}
    for k, v in (("n", n), ("temperature", temperature), ("seed", seed), ("max_tokens", max_tokens)):
        if v is not None:
            body[k] = v
    if logprobs is not None:
        body.update(logprobs=True, top_logprobs=logprobs)
    return {"custom_id": rid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _run(src, out, run_id):
    return run_demo_cli(src, out, ds=DS, run_id=run_id, sets=SETS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_model_dir):
    tmp = tmp_path_factory.mktemp("samples")
    src = tmp / "in.parquet"
    pq.write_table(pa.Table.from_pylist([dict(zip(COLUMNS, r)) for r in ROWS]), src)
    out = tmp / "out"
    table_run = _run(src, out, "table")
    batch = tmp / "batch.jsonl"
    batch.write_text("".join(json.dumps(_body(r)) + "\n" for r in ROWS))
    batch_run = _run(batch, out, "batch")
    return table_run, batch_run


def _table(runs):
    (current, summary, _), _ = runs
    t = pq.read_table(Location(current["dataset"]).path())
    return t, {r["id"]: r for r in t.to_pylist()}, summary


def test_n_samples_as_a_typed_list_column(runs):
    t, rows, summary = _table(runs)
    assert t.num_rows == len(ROWS)
    assert t.schema.field("outputs").type == pa.list_(pa.string())
    s = rows["samples"]
    assert len(s["outputs"]) == 3 and s["output"] == s["outputs"][0]
    assert len(set(s["outputs"])) > 1, s["outputs"]  # seeded samples at temperature 0.8 differ (seed + i each)
    assert len(s["finish_reasons"]) == 3 and set(s["finish_reasons"]) <= {"stop", "length"}
    assert s["completion_tokens"] > 8  # three samples of up to 8 tokens each, counted together
    assert rows["plain"]["outputs"] is None and rows["plain"]["logprobs"] is None and rows["plain"]["output"]
    assert rows["greedy_lp"]["outputs"] is None  # n = 1: no list, output as before
    assert summary["usage"]["completion_tokens"] == sum(r["completion_tokens"] for r in rows.values())


def test_top_k_logprobs_per_generated_token(runs):
    t, rows, _ = _table(runs)
    top = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
    assert t.schema.field("logprobs").type == pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64()),
                                                                  ("top", pa.list_(top))]))
    g = rows["greedy_lp"]
    assert len(g["logprobs"]) == g["completion_tokens"] > 0
    for tok in g["logprobs"]:
        assert len(tok["top"]) == 3 and all(c["logprob"] <= 0 for c in tok["top"])
        assert [c["logprob"] for c in tok["top"]] == sorted((c["logprob"] for c in tok["top"]), reverse=True)
        # greedy: the chosen token is the most likely one
        assert tok["logprob"] == pytest.approx(max(c["logprob"] for c in tok["top"]), abs=1e-6)
        assert tok["token"] == tok["top"][0]["token"]
    # the tokens spell the output; a row that ended on the end-of-turn token counts it (as vLLM does) and
    # lists it, though the text leaves it out
    eos = "<|im_end|>" if g["finish_reason"] == "stop" else ""
    assert "".join(tok["token"] for tok in g["logprobs"]) == g["output"] + eos
    b = rows["both"]  # n = 2 with top-2: the first sample's in logprobs, each sample's in outputs_logprobs
    assert len(b["outputs"]) == len(b["outputs_logprobs"]) == 2 and b["outputs_logprobs"][0] == b["logprobs"]
    assert sum(len(x) for x in b["outputs_logprobs"]) == b["completion_tokens"]
    assert all(len(tok["top"]) == 2 for x in b["outputs_logprobs"] for tok in x)


def test_openai_batch_lines_carry_n_choices_from_the_cache(runs):
    (table_current, _, _), (current, summary, log) = runs
    lines = {x["custom_id"]: x for x in iter_jsonl(Location(current["dataset"]).path())}
    _, rows, _ = _table(runs)
    assert set(lines) == {r[0] for r in ROWS}
    shard = summary["manifests"]["infer"][0]
    assert shard["metrics"]["cached_rows"] == len(ROWS) and shard["metrics"]["engine_start_seconds"] == 0.0
    for rid, n, lp in (("samples", 3, None), ("greedy_lp", 1, 3), ("both", 2, 2), ("plain", 1, None)):
        body = lines[rid]["response"]["body"]
        choices = body["choices"]
        assert [c["index"] for c in choices] == list(range(n)), rid
        want = rows[rid]["outputs"] or [rows[rid]["output"]]
        assert [c["message"]["content"] for c in choices] == want, rid
        assert body["usage"]["completion_tokens"] == rows[rid]["completion_tokens"]
        if lp is None:
            assert all(c["logprobs"] is None for c in choices), rid
            continue
        for c in choices:
            content = c["logprobs"]["content"]
            assert content and all(len(e["top_logprobs"]) == lp for e in content), rid
            assert all(e["bytes"] == list(e["token"].encode()) for e in content)
        assert [e["logprob"] for e in choices[0]["logprobs"]["content"]] == \
            [tok["logprob"] for tok in rows[rid]["logprobs"]]
