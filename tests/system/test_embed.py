"""engine.task embed on the real CPU vLLM engine (pooling runner), through ``batch-llm run``.

One engine start for the module: 50 rows of a Parquet table (45 distinct prompts, 5 of them asked twice, with
prompt folding off so the engine embeds each row) through plan -> infer -> filter -> evaluate -> publish. The
published table holds one vector per row as a fixed-size list of float32, as wide as the model's hidden size
(from its config.json), L2-normalized; the filter and evaluate manifests say they skipped. A second run of the
same rows into the same output folder is served entirely from the result cache (no engine start).

And OpenAI Batch ``/v1/embeddings`` lines through ``batch-llm run-batch --convert embed`` (one more engine start):
OpenAI's embeddings response on every answered line (the official client's types parse it), base64 and float the
same vector, a string and its token ids the same vector, and the lines the pipeline cannot answer (dimensions on
a model that is not matryoshka, several inputs, a chat line) their error lines in their place.
"""
from __future__ import annotations

import base64
import json
import math
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.host.probes import cpu_dtype
from batch_llm.io.storage import Location, iter_jsonl
from helpers import run_demo_cli, run_in_group

DS = "2026-12-01"
DISTINCT = [f"Sentence number {i}: the {w} is on the table." for i, w in
            enumerate(["cat", "book", "lamp", "apple", "cup"] * 9)]
TWICE = [0, 7, 13, 21, 44]  # indices of DISTINCT asked again under another id
ROWS = [{"id": f"r{i:02d}", "prompt": p} for i, p in enumerate(DISTINCT)] + \
       [{"id": f"again{i:02d}", "prompt": DISTINCT[i]} for i in TWICE]
SETS = ["sharding.num_shards=1", "engine.task=embed", "engine.dedupe_prompts=false", "engine.commit_every_rows=16"]


def _run(src, out, run_id):
    current, summary, _ = run_demo_cli(src, out, ds=DS, run_id=run_id, sets=SETS)
    return pq.read_table(Location(current["dataset"]).path()), summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_model_dir):
    tmp = tmp_path_factory.mktemp("embed")
    src = tmp / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), src)
    out = tmp / "out"
    first = _run(src, out, "embed")
    again = _run(src, out, "again")  # the same rows again: every vector from the cache the first run wrote
    return first, again, demo_model_dir


@pytest.fixture(scope="module")
def run(runs):
    (table, summary), _, model_dir = runs
    return table, summary, model_dir


def test_fifty_vectors_of_the_model_width_as_fixed_size_float32(run):
    table, summary, model_dir = run
    width = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    assert width == 576  # SmolLM2-135M, read from its config.json above
    assert table.num_rows == 50 and summary["rows_published"] == 50
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), width)
    rows = table.to_pylist()
    for r in rows:
        v = r["embedding"]
        assert len(v) == width and all(math.isfinite(x) for x in v), r["id"]
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, abs_tol=1e-3), r["id"]  # normalize: true
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] == 0 and r["output"] is None


def test_identical_prompts_identical_vectors_different_prompts_different(run):
    table, _, _ = run
    by_id = {r["id"]: r["embedding"] for r in table.to_pylist()}
    for i in TWICE:  # embedded separately (dedupe_prompts false), in other batches
        a, b = by_id[f"r{i:02d}"], by_id[f"again{i:02d}"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3, i
    distinct = [tuple(by_id[f"r{i:02d}"]) for i in range(len(DISTINCT))]
    assert len(set(distinct)) == len(DISTINCT)
    # not merely different bits: another sentence is another direction
    a, b = by_id["r00"], by_id["r01"]
    assert sum(x * y for x, y in zip(a, b)) < 0.9999


def test_filter_and_evaluate_skipped_and_prompt_tokens_counted(run):
    _, summary, _ = run
    manifests = summary["manifests"]
    assert manifests["filter"]["skipped"] == "task embed"
    assert manifests["filter"]["summary"]["enabled"] is False
    assert manifests["evaluate"]["skipped"] == "task embed"
    assert summary["usage"]["prompt_tokens"] > 0 and summary["usage"]["completion_tokens"] == 0


def test_a_second_run_is_served_from_the_cache_with_the_same_vectors(runs):
    (first, _), (again, summary), _ = runs
    shards = summary["manifests"]["infer"]
    assert sum(s["metrics"]["cached_rows"] for s in shards) == 50
    assert all(s["engine"]["version"] is None for s in shards)  # no engine started
    assert again.schema.field("embedding").type == first.schema.field("embedding").type
    assert {r["id"]: r["embedding"] for r in again.to_pylist()} == {r["id"]: r["embedding"] for r in first.to_pylist()}


def _embeddings_line(cid, body, url="/v1/embeddings"):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "vec", **body}}


TEXT = "The cat is on the table."


@pytest.fixture(scope="module")
def run_batch(tmp_path_factory, demo_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(demo_model_dir))(TEXT, add_special_tokens=True)["input_ids"]
    lines = [_embeddings_line("float", {"input": TEXT}),
             _embeddings_line("b64", {"input": [TEXT], "encoding_format": "base64", "user": "u1"}),
             _embeddings_line("ids", {"input": ids}),
             _embeddings_line("other", {"input": DISTINCT[1]}),
             _embeddings_line("dims", {"input": TEXT, "dimensions": 64}),
             _embeddings_line("many", {"input": [TEXT, DISTINCT[1]]}),
             _embeddings_line("chat", {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")]
    tmp = tmp_path_factory.mktemp("embed_run_batch")
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = run_in_group(
        [sys.executable, "-m", "batch_llm", "run-batch", "-i", str(src), "-o", str(out), "--model",
         str(demo_model_dir), "--convert", "embed", "--served-model-name", "vec", "--enforce-eager",
         "--max-model-len", "512", "--dtype", cpu_dtype("auto", str(demo_model_dir), on_gpu=False), "--plain"],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
        timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [x["custom_id"] for x in lines], list(iter_jsonl(out)), run.stdout, len(ids)


def test_run_batch_answers_embeddings_lines_as_openai_does(run_batch):
    from openai.types import CreateEmbeddingResponse

    order, got, stdout, n_tokens = run_batch
    assert [x["custom_id"] for x in got] == order  # one line per input line, in input order
    by_id = {x["custom_id"]: x for x in got}
    vectors = {}
    for cid in ("float", "b64", "ids", "other"):
        line = by_id[cid]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        if cid == "b64":  # OpenAI's base64: little-endian float32 bytes
            assert isinstance(body["data"][0]["embedding"], str)
            vectors[cid] = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
        else:
            parsed = CreateEmbeddingResponse.model_validate(body)
            assert parsed.object == "list" and parsed.model == "vec" and len(parsed.data) == 1
            assert parsed.data[0].index == 0 and parsed.data[0].object == "embedding"
            assert parsed.usage.prompt_tokens == parsed.usage.total_tokens > 0
            vectors[cid] = np.asarray(parsed.data[0].embedding, dtype=np.float32)
        assert vectors[cid].shape == (576,) and abs(float(np.linalg.norm(vectors[cid])) - 1.0) < 1e-3, cid
    # the string is tokenized with the tokenizer's special tokens, as vLLM's embeddings API does: its token ids
    # given as the input are the same prompt, the same vector
    assert by_id["float"]["response"]["body"]["usage"]["prompt_tokens"] == n_tokens
    assert float(np.abs(vectors["float"] - vectors["ids"]).max()) < 1e-3
    assert np.array_equal(vectors["float"], vectors["b64"])  # one vector, two encodings
    assert float(vectors["float"] @ vectors["other"]) < 0.9999  # another sentence, another direction


def test_run_batch_embeddings_lines_it_cannot_answer_are_their_error_lines(run_batch):
    _, got, stdout, _ = run_batch
    by_id = {x["custom_id"]: x for x in got}
    message = {cid: by_id[cid]["response"]["body"]["error"]["message"] for cid in ("dims", "many", "chat")}
    assert all(by_id[cid]["response"]["status_code"] == 400 for cid in message)
    assert "does not support Matryoshka" in message["dims"]  # vLLM's own reason: the demo model is not matryoshka
    assert "a list of 2 inputs" in message["many"]
    assert "engine.task embed answers /v1/embeddings" in message["chat"]
    assert "(7 lines, 3 refused or failed)" in stdout
