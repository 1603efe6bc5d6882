"""engine.task embed on the real CPU vLLM engine (pooling runner), through ``batch-llm run``.

One engine start for the module: 50 rows of a Parquet table (45 distinct prompts, 5 of them asked twice, with
prompt folding off so the engine embeds each row) through plan -> infer -> filter -> evaluate -> publish. The
published table holds one vector per row as a fixed-size list of float32, as wide as the model's hidden size
(from its config.json), L2-normalized; the filter and evaluate manifests say they skipped. A second run of the
same rows into the same output folder is served entirely from the result cache (no engine start).
"""
from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.io.storage import Location
from helpers import run_demo_cli

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
