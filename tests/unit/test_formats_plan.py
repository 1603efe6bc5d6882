"""Readers, validation, shard planning and writers for JSONL, Parquet, CSV and OpenAI Batch input."""
from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batch_llm.config import ShardingConfig
from batch_llm.io.formats import write_rows
from batch_llm.io.storage import Location, as_path, iter_jsonl
from batch_llm.rows.records import output_record
from batch_llm.stages import plan as plan_mod
from helpers import demo_config

ROWS = [{"id": f"r{i}", "text": "x" * (10 - i), "lang": "French", "reference": f"ref {i}"} for i in range(7)]


def _plan(tmp_path, path, **over):
    cfg = demo_config(tmp_path, input__path=str(path), **over)
    return plan_mod.write_plan(cfg, input_loc=Location(str(path)), plan_dir=Location(str(tmp_path / "plan")))


def test_csv_with_template_over_columns(tmp_path):
    p = tmp_path / "in.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "text", "lang", "reference"])
        w.writeheader()
        w.writerows(ROWS)
    m = _plan(tmp_path, p, input__template="Translate to {lang}: {text}", sharding__num_shards=2)
    assert m.format == "csv" and m.valid == 7 and m.has_references
    rows = [r for s in m.shards for r in iter_jsonl(Location(s.url).path())]
    assert rows[0]["messages"] == [{"role": "user", "content": "Translate to French: " + rows[0]["messages"][0]["content"][21:]}]
    assert {r["id"] for r in rows} == {r["id"] for r in ROWS}


def test_template_missing_column_is_a_row_error(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"id": "a", "text": "hi"}) + "\n" + json.dumps({"id": "b", "lang": "de", "text": "x"}) + "\n")
    m = _plan(tmp_path, p, input__template="To {lang}: {text}")
    errors = list(iter_jsonl(Location(m.errors).path()))
    assert m.valid == 1 and errors[0]["id"] == "a" and "column 'lang'" in errors[0]["reason"]


def test_parquet_sorted_by_length_inside_shards(tmp_path):
    p = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": r["id"], "prompt": r["text"]} for r in ROWS]), p)
    m = _plan(tmp_path, p, sharding__rows_per_shard=4)
    assert m.format == "parquet" and [s.rows for s in m.shards] == [4, 3]
    first = [r["id"] for r in iter_jsonl(Location(m.shards[0].url).path())]
    assert first == ["r3", "r2", "r1", "r0"]  # contiguous input range, shortest prompt first


def test_largest_output_budget_first_then_prompt_length(tmp_path, monkeypatch):
    """Rows with their own max_tokens: the longest generations lead the shard (they would otherwise trail its
    end on a near-empty batch); rows of one budget (the pipeline's, 256 here) stay shortest prompt first. The
    same order whether the shard is sorted in memory or in spilled runs merged."""
    budgets = {"r0": None, "r1": 512, "r2": 16, "r3": 512, "r4": None, "r5": 16, "r6": 1024}
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": r["id"], "prompt": r["text"],
                                     **({"max_tokens": budgets[r["id"]]} if budgets[r["id"]] else {})}) + "\n"
                         for r in ROWS))
    want = ["r6", "r3", "r1", "r4", "r0", "r5", "r2"]  # 1024; 512 (r3 shorter); 256 (r4 shorter); 16 (r5 shorter)
    for run_rows in (plan_mod.SORT_RUN_ROWS, 2):
        monkeypatch.setattr(plan_mod, "SORT_RUN_ROWS", run_rows)
        m = _plan(tmp_path, p, sharding__num_shards=1)
        rows = list(iter_jsonl(Location(m.shards[0].url).path()))
        assert [r["id"] for r in rows] == want, run_rows
        assert [r["idx"] for r in rows] == [int(i[1:]) for i in want]  # input positions kept for the merge
    m = _plan(tmp_path, p, sharding__num_shards=1, sharding__sort_by_length=False)
    assert [r["id"] for r in iter_jsonl(Location(m.shards[0].url).path())] == [r["id"] for r in ROWS]


DOC = "Document {d}: " + "a long passage the model reads before the question. " * 12  # ~640 bytes


def _doc_rows(docs: int, questions: int, budget=None) -> list[dict]:
    """``docs`` documents asked ``questions`` questions each, question-major (document 0..N for question 1, then
    question 2): rows that share a document lie ``docs`` rows apart in the input."""
    return [{"id": f"d{d}q{q}", "prompt": DOC.format(d=d) + f"Question {q}: " + "why? " * (q + 1),
             **({"max_tokens": budget(d, q)} if budget else {})}
            for q in range(questions) for d in range(docs)]


def test_rows_that_share_a_prefix_are_submitted_together_shortest_first_inside(tmp_path, monkeypatch):
    """group_prefixes (on for vLLM by default): each document's questions are contiguous in the shard, in prompt
    length order inside; in spilled runs merged the same; off, the shard is in prompt length order alone (which
    interleaves the documents, their questions being as long as each other's)."""
    rows = _doc_rows(docs=6, questions=4)
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for run_rows in (plan_mod.SORT_RUN_ROWS, 3):
        monkeypatch.setattr(plan_mod, "SORT_RUN_ROWS", run_rows)
        m = _plan(tmp_path, p, sharding__num_shards=1)
        ids = [r["id"] for r in iter_jsonl(Location(m.shards[0].url).path())]
        assert sorted(ids) == sorted(r["id"] for r in rows)
        docs = [i.split("q")[0] for i in ids]
        assert [docs[k] for k in range(0, 24, 4)] == [docs[k + 3] for k in range(0, 24, 4)], (run_rows, ids)
        assert len({docs[k] for k in range(0, 24, 4)}) == 6  # six runs of four: no document split
        assert all(ids[k:k + 4] == [f"{docs[k]}q{q}" for q in range(4)] for k in range(0, 24, 4))  # shortest first
        assert m.order == "budget, prefix, length"
    m2 = _plan(tmp_path, p, sharding__num_shards=1, sharding__group_prefixes=False)
    ids = [r["id"] for r in iter_jsonl(Location(m2.shards[0].url).path())]
    assert ids[:6] == [f"d{d}q0" for d in range(6)]  # length order: the six documents' first questions first
    assert m2.order == "budget, length"
    keys = [plan_mod.plan_input_key(demo_config(tmp_path, input__path=str(p), **over), Location(str(p)))
            for over in ({}, {"sharding__group_prefixes": False}, {"engine__kind": "transformers"})]
    assert keys[0] != keys[1] == keys[2]  # another order, another plan; one order, one plan however it is set
    assert _plan(tmp_path, p, sharding__num_shards=1, sharding__sort_by_length=False).order == "input"


def test_the_budget_comes_before_the_prefix_group(tmp_path):
    """Rows of a larger output budget still lead (the tail): a document's questions group inside one budget."""
    rows = _doc_rows(docs=3, questions=4, budget=lambda d, q: 512 if q % 2 else 64)
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = [r["id"] for r in iter_jsonl(Location(_plan(tmp_path, p, sharding__num_shards=1).shards[0].url).path())]
    assert {i[-2:] for i in ids[:6]} == {"q1", "q3"} and {i[-2:] for i in ids[6:]} == {"q0", "q2"}
    for half in (ids[:6], ids[6:]):
        assert [i[:2] for i in half[::2]] == [i[:2] for i in half[1::2]]  # pairs of one document


@pytest.mark.parametrize(("over", "want"), [
    ({}, True),                                               # vLLM: automatic prefix caching, on by default
    ({"engine__enable_prefix_caching": False}, False),        # switched off: nothing to find in a cache
    ({"engine__extra": {"enable_prefix_caching": False}}, False),  # off through vLLM's own argument
    ({"engine__kind": "transformers"}, False),                # static batches: length order alone (padding)
    ({"engine__kind": "transformers", "sharding__group_prefixes": True}, True),  # the user's word wins
    ({"engine__kind": "lmdeploy"}, False),                    # LMDeploy's prefix caching is off by default
    ({"engine__kind": "lmdeploy", "engine__enable_prefix_caching": True}, True),
    ({"engine__kind": "sglang"}, True),                       # its radix cache
    ({"sharding__sort_by_length": False}, False),             # input order: nothing sorted, nothing hashed
])
def test_group_prefixes_follows_the_engines_prefix_cache(tmp_path, over, want):
    assert plan_mod.groups_prefixes(demo_config(tmp_path, **over)) is want


def test_group_prefixes_in_input_order_is_refused_saying_why(tmp_path):
    with pytest.raises(ValueError, match=r"group_prefixes: true orders rows .* sort_by_length: false keeps them in "
                                         r"input order"):
        demo_config(tmp_path, sharding__sort_by_length=False, sharding__group_prefixes=True)
    assert not plan_mod.groups_prefixes(demo_config(tmp_path, sharding__sort_by_length=False,
                                                    sharding__group_prefixes=False))


def test_prompt_bytes_tell_a_shared_image_and_token_prefix():
    from batch_llm.rows.prefix import prompt_bytes as of_fields
    from batch_llm.rows.prompt import PromptRow

    def prompt_bytes(r):
        return of_fields(r.text, r.messages, r.prompt_token_ids)

    img = {"type": "image", "sha256": "ab" * 32}
    a = PromptRow(id="a", idx=0, messages=[{"role": "user", "content": [img, {"type": "text", "text": "colour?"}]}])
    b = PromptRow(id="b", idx=1, messages=[{"role": "user", "content": [img, {"type": "text", "text": "size?"}]}])
    c = PromptRow(id="c", idx=2, messages=[{"role": "user", "content": [{**img, "sha256": "cd" * 32},
                                                                         {"type": "text", "text": "colour?"}]}])
    pa_, pb, pc = (prompt_bytes(r) for r in (a, b, c))
    assert pa_[:64] == pb[:64] != pc[:64]
    t1 = PromptRow(id="t", idx=0, messages=[], prompt_token_ids=list(range(100, 140)))
    t2 = PromptRow(id="u", idx=1, messages=[], prompt_token_ids=[*range(100, 120), 7, 8])
    assert prompt_bytes(t1)[:160] == prompt_bytes(t2)[:160] != prompt_bytes(t1)[:168]
    long_text = PromptRow(id="l", idx=0, messages=[], text="é" * 100_000)  # read no further than the deepest level
    long_ids = PromptRow(id="i", idx=0, messages=[], prompt_token_ids=list(range(100_000)))
    long_chat = PromptRow(id="c", idx=0, messages=[{"role": "user", "content": "x" * 20_000}] * 10)
    for r in (long_text, long_ids, long_chat):
        assert 32768 <= len(prompt_bytes(r)) < 70_000


def test_openai_batch_in_and_out(tmp_path):
    p = tmp_path / "batch.jsonl"
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "user", "content": f"Say {i}"}]}} for i in range(3)]
    p.write_text("".join(json.dumps(line) + "\n" for line in lines))
    m = _plan(tmp_path, p)
    assert m.format == "openai_batch" and m.valid == 3
    rec = next(iter_jsonl(Location(m.records).path()))
    out = output_record(rec["record"], {"id": "req-0", "idx": 0, "output": "0", "finish_reason": "stop",
                                        "prompt_tokens": 5, "completion_tokens": 1}, "openai_batch")
    assert out["custom_id"] == "req-0" and out["error"] is None
    assert out["response"]["body"]["choices"][0]["message"]["content"] == "0"
    assert out["response"]["body"]["usage"]["total_tokens"] == 6
    assert out["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = output_record(rec["record"], {"id": "req-0", "idx": 0, "output": "0", "finish_reason": "stop", "prompt_tokens": 40,
                                           "cached_prompt_tokens": 32, "completion_tokens": 1}, "openai_batch")
    assert cached["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def _batch_line(cid: str) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n"


def test_a_folder_of_mixed_formats_is_refused_naming_the_files(tmp_path):
    """A run reads one format and publishes in it: a folder mixing formats is refused before a row is read,
    naming a file of each format (not parsed and published in the first file's format)."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (folder / "b.csv").write_text("id,prompt\nb,hi\n")
    pq.write_table(pa.table({"id": ["c"], "prompt": ["hi"]}), folder / "c.parquet")
    with pytest.raises(ValueError, match=r"in: the input holds files of 3 formats \(csv: b\.csv; jsonl: a\.jsonl; "
                       r"parquet: c\.parquet\); a run reads one format"):
        _plan(tmp_path, folder)
    with pytest.raises(ValueError, match="3 formats"):  # input.format names the format, not the files'
        _plan(tmp_path, folder, input__format="jsonl")
    (folder / "b.csv").unlink()
    (folder / "c.parquet").unlink()
    (folder / "d.json").write_text('{"id": "d", "prompt": "hi"}\n')  # .json is JSONL too: one format
    assert _plan(tmp_path, folder).valid == 2


@pytest.mark.parametrize("first", ["prompts", "batch"])
def test_jsonl_prompt_rows_beside_openai_batch_files_are_refused(tmp_path, first):
    folder = tmp_path / "in"
    folder.mkdir()
    prompts, batch = ("a.jsonl", "b.jsonl") if first == "prompts" else ("b.jsonl", "a.jsonl")
    (folder / prompts).write_text('{"id": "p", "prompt": "hi"}\n')
    (folder / batch).write_text(_batch_line("q"))
    with pytest.raises(ValueError, match=rf"2 formats \(jsonl: {prompts}; openai_batch: {batch}\)"):
        _plan(tmp_path, folder)
    (folder / prompts).write_text(_batch_line("p"))
    m = _plan(tmp_path, folder)
    assert m.format == "openai_batch" and m.valid == 2


@pytest.mark.parametrize("fmt,suffix", [("jsonl", ".jsonl"), ("csv", ".csv"), ("parquet", ".parquet")])
def test_writers_keep_columns(tmp_path, fmt, suffix):
    path = as_path(str(tmp_path / f"out{suffix}"))
    rows = [output_record({"id": "a", "text": "t", "n": 1}, {"id": "a", "output": "o", "finish_reason": "stop",
                                                             "prompt_tokens": 3, "completion_tokens": 1}, fmt)]
    assert write_rows(path, rows, fmt) == 1
    if fmt == "parquet":
        back = pq.read_table(path).to_pylist()
    elif fmt == "csv":
        back = list(csv.DictReader(open(path)))
    else:
        back = list(iter_jsonl(path))
    assert {"id", "text", "n", "output", "finish_reason"} <= set(back[0])
    assert back[0]["output"] == "o"


def test_shard_sizes():
    assert plan_mod.shard_sizes(10, ShardingConfig(num_shards=3)) == [4, 3, 3]
    assert plan_mod.shard_sizes(2, ShardingConfig(num_shards=5)) == [1, 1]
    # default rule: 70 s start, 15k tok/s, 10 % share → 36,915 rows of 256 output tokens
    assert plan_mod.default_rows_per_shard(ShardingConfig(), 256) == 36915
    assert plan_mod.shard_sizes(100_000, ShardingConfig(), 256) == [33334, 33333, 33333]
    cpu = ShardingConfig(expected_engine_start_seconds=30, expected_output_tokens_per_second=350)
    assert plan_mod.default_rows_per_shard(cpu, 64) == 1477
    assert plan_mod.shard_sizes(0, ShardingConfig(rows_per_shard=10)) == []


def test_run_token_usage_sums_the_shards():
    from batch_llm.manifests import ShardMetrics, ShardResult, TokenUsage

    shards = [ShardResult(shard=i, outputs="o", errors="e", metrics=ShardMetrics(rows=9, **m)) for i, m in enumerate(
        [{"input_tokens": 100, "cached_prompt_tokens": 64, "output_tokens": 20},
         {"input_tokens": 50, "output_tokens": 5}])]   # an engine that does not report cached tokens
    assert TokenUsage.of_shards(shards) == TokenUsage(prompt_tokens=150, cached_prompt_tokens=64, completion_tokens=25)


def test_every_shard_path_of_a_run_is_the_layouts(tmp_path):
    """A shard's paths in a run's folders come from ``RunLayout``: the plan's shard files, the folder a shard
    commits in under a stage, the review's requests and model; shards named by ``shard_name``."""
    from batch_llm.layout import RunLayout, shard_name

    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": r["id"], "prompt": r["text"]}) + "\n" for r in ROWS))
    cfg = demo_config(tmp_path, input__path=str(p), sharding__rows_per_shard=4)
    layout = RunLayout.for_run(cfg, run_id="manual__1", ds="2026-12-01")
    m = plan_mod.plan_shards(cfg, layout)
    assert [s.url for s in m.shards] == [layout.stage("plan").child(f"{shard_name(i)}.jsonl").url for i in (0, 1)]
    assert shard_name(3) == "shard-00003"
    assert layout.shard_dir(3).url == layout.stage("infer").child("shard-00003").url
    assert layout.shard_dir(3, "review").url == layout.stage("review").child("shard-00003").url
    assert layout.review_requests(3, "k1").url == layout.stage("review").child("requests", "shard-00003-k1.jsonl").url
    assert layout.review_model.url == layout.stage("review").child("model").url
