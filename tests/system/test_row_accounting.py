"""Every input line is accounted for in the published version, in every input format.

One logical input of 12 lines, written as JSONL, CSV, Parquet and an OpenAI Batch file, runs through the stages
in-process (fetch, quantize, plan, infer, content filter, evaluate, publish) on the demo model with the
transformers engine (it starts in seconds). The lines: valid prompts, a row without a prompt, a line the
format cannot read as a row, a duplicate id (plan errors), a prompt longer than ``engine.max_model_len`` (an
inference error: the planner does not tokenize) and prompts whose greedy answers name a word of a ``drop``
list (content-filter drops). Each line must come out exactly once: a row of ``data.<fmt>`` or a line of
``errors.jsonl`` with its stage and reason, and ``summary.json``'s ``rows`` must add up.
"""
from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest
from batch_llm import api
from batch_llm.io.storage import Location, iter_jsonl, read_json
from batch_llm.layout import RunLayout
from helpers import demo_config

FORMATS = ("jsonl", "csv", "parquet", "openai_batch")
STAGES = {"plan", "infer", "content_filter"}
OPENAI_CODES = {"invalid_request": "plan", "generation_failed": "infer", "content_filter": "content_filter"}

# The drop list: words the demo model's greedy answers (max_tokens 16) to these prompts contain ("Banana is a
# fruit ...", "The capital of France is Paris.", "The moon is a celestial body ..."); the other valid prompts'
# answers ("Hello! ...", "... is 4.", "The most obvious color ...") contain none of them.
DROP_WORDS = ("banana", "paris", "moon")
DROP_CANDIDATES = {"capital", "banana", "moon"}
MAX_MODEL_LEN = 256
LONG_PROMPT = "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens

# (id, prompt) of the logical input, in order; None: no prompt; BAD: a line the format cannot read as a row.
BAD = object()
ROWS: list[tuple[str | None, object]] = [
    ("capital", "What is the capital of France?"),
    ("hello", "Say hello."),
    ("sum", "What is 2 plus 2?"),
    ("banana", "Repeat the word banana."),
    ("colour", "Name a color."),
    ("no-prompt", None),                            # plan: no prompt
    ("hello", "Say goodbye."),                      # plan: duplicate id
    ("too-long", LONG_PROMPT),                      # infer: longer than max_model_len
    ("cat", "Describe a cat."),
    (None, BAD),                                    # plan: not a row (no id can be read)
    ("moon", "Tell me a fact about the moon."),
    ("water", "What is water made of?"),
]
EXPECTED_IDS = Counter(rid for rid, _ in ROWS)      # the duplicate twice, the unreadable line as None


def _write_input(d: Path, fmt: str) -> Path:
    if fmt == "jsonl":
        path = d / "prompts.jsonl"
        lines = ["{\"id\": \"broken\", \"prompt\": " if p is BAD else  # not valid JSON
                 json.dumps({"id": rid} if p is None else {"id": rid, "prompt": p}) for rid, p in ROWS]
        path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    elif fmt == "csv":
        path = d / "prompts.csv"
        with open(path, "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "prompt"])
            for rid, p in ROWS:
                # an empty cell is no prompt; a row with a field more than the header is not a row
                w.writerow(["broken", "a prompt", "a stray field"] if p is BAD else [rid, p or ""])
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = d / "prompts.parquet"
        # a null prompt is no prompt; a null id is a row that cannot be named
        ids = [None if p is BAD else rid for rid, p in ROWS]
        prompts = ["a prompt without an id" if p is BAD else p for _, p in ROWS]
        pq.write_table(pa.table({"id": pa.array(ids, pa.string()), "prompt": pa.array(prompts, pa.string())}), path)
    else:
        path = d / "batch.jsonl"
        lines = []
        for rid, p in ROWS:
            if p is BAD:
                lines.append("{\"custom_id\": \"broken\", \"body\": ")  # not valid JSON
                continue
            body = {"model": "smol"} if p is None else {"model": "smol",
                                                       "messages": [{"role": "user", "content": p}]}
            lines.append(json.dumps({"custom_id": rid, "method": "POST", "url": "/v1/chat/completions",
                                     "body": body}))
        path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return path


def _data_ids(dataset: Path, fmt: str) -> list[str]:
    if fmt == "csv":
        with open(dataset, encoding="utf-8", newline="") as f:
            return [r["id"] for r in csv.DictReader(f)]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(dataset).column("id").to_pylist()
    rows = list(iter_jsonl(dataset))
    if fmt == "openai_batch":
        for r in rows:  # output lines of an OpenAI Batch output file: a 200 response with the completion
            assert r["error"] is None and r["response"]["status_code"] == 200, r
            assert r["response"]["body"]["choices"][0]["message"]["content"], r
        return [r["custom_id"] for r in rows]
    for r in rows:
        assert r["output"], r
    return [r["id"] for r in rows]


def _error_entries(errors: Path, fmt: str) -> list[tuple[str | None, str, str]]:
    """(id, stage, reason) of each line of the published errors file, checking the line's shape."""
    out = []
    line_ids: set[str] = set()
    for e in iter_jsonl(errors):
        if fmt == "openai_batch":  # a line of an OpenAI Batch error file, its id unique as OpenAI's
            assert set(e) == {"id", "custom_id", "response", "error"}, e
            assert e["error"] is None and e["response"]["status_code"] == 400, e
            assert e["id"].startswith("batch_req_") and e["id"] not in line_ids, e
            line_ids.add(e["id"])
            err = e["response"]["body"]["error"]
            assert err["type"] == "invalid_request_error" and err["code"] in OPENAI_CODES, e
            out.append((e["custom_id"], OPENAI_CODES[err["code"]], err["message"]))
        else:
            assert e.get("stage") in STAGES, e
            out.append((e.get("id"), e["stage"], e.get("reason")))
    for rid, stage, reason in out:
        assert isinstance(reason, str) and reason.strip(), (rid, stage, reason)
    return out


@pytest.fixture(scope="module", params=FORMATS)
def published(request, tmp_path_factory, demo_model_dir):
    """The input in one format, run through every stage; the published version's files."""
    fmt = request.param
    d = tmp_path_factory.mktemp(f"accounting-{fmt}")
    words = d / "drop.txt"
    words.write_text("".join(w + "\n" for w in DROP_WORDS), encoding="utf-8")
    path = _write_input(d, fmt)
    cfg = demo_config(d, input__path=str(path), input__format=fmt, sharding__num_shards=2,
                      engine__kind="transformers", engine__max_model_len=MAX_MODEL_LEN, engine__max_error_rate=0.5,
                      engine__commit_every_rows=4, sampling__max_tokens=16, evaluate__enabled=False,
                      filter__lists=[{"name": "drops", "path": str(words), "action": "drop"}])
    layout = RunLayout.for_run(cfg, run_id=f"accounting-{fmt}", ds="2026-11-30")
    model = api.quantize(cfg, layout, api.fetch(cfg, layout))
    plan = api.plan_shards(cfg, layout)
    shards = [api.infer_shard(cfg, layout, model, s, say=lambda _: None) for s in plan.shards]
    filtered = api.content_filter(cfg, layout, plan, shards)
    scores = api.evaluate(cfg, layout, plan, filtered)
    m = api.publish(cfg, layout, plan, filtered, scores)
    version = Location(m.version).path()
    return {"fmt": fmt, "dataset": Location(m.dataset).path(), "errors": version / "errors.jsonl",
            "summary": read_json(version / "summary.json")}


def test_every_input_line_is_one_output_or_one_error_line(published):
    fmt = published["fmt"]
    data = _data_ids(published["dataset"], fmt)
    errors = _error_entries(published["errors"], fmt)
    seen = Counter(data) + Counter(rid for rid, _, _ in errors)
    assert seen == EXPECTED_IDS, (f"{fmt}: lines missing {dict(EXPECTED_IDS - seen)}, "
                                  f"lines too many {dict(seen - EXPECTED_IDS)}")
    by_stage = {s: sorted((rid for rid, stage, _ in errors if stage == s), key=str) for s in STAGES}
    assert by_stage["plan"] == sorted(["no-prompt", "hello", None], key=str), errors
    assert by_stage["infer"] == ["too-long"], errors
    assert "hello" in data  # the first of the two lines with that id
    reasons = {(rid, stage): reason for rid, stage, reason in errors}
    assert "duplicate id 'hello'" in reasons["hello", "plan"]
    assert "max_model_len" in reasons["too-long", "infer"] and str(MAX_MODEL_LEN) in reasons["too-long", "infer"]
    # The content filter dropped some answers, not all; a dropped row is an error line, never a published row.
    dropped = by_stage["content_filter"]
    assert dropped, f"{fmt}: no answer was dropped; the demo model's answers changed? published {data}"
    assert set(dropped) <= DROP_CANDIDATES, dropped
    assert not set(dropped) & set(data)
    assert {"hello", "sum", "colour"} <= set(data), data
    for rid in dropped:
        assert "dropped by the content filter" in reasons[rid, "content_filter"], reasons[rid, "content_filter"]
        assert "(drops)" in reasons[rid, "content_filter"]  # names the list


def test_summary_counts_add_up(published):
    fmt, summary = published["fmt"], published["summary"]
    assert summary.get("rows") is not None, f"{fmt}: summary.json has no row accounting"
    from batch_llm.manifests import RowAccounting

    rows = RowAccounting.model_validate(summary["rows"])
    n_data = len(_data_ids(published["dataset"], fmt))
    n_errors = sum(1 for _ in iter_jsonl(published["errors"]))
    assert rows.read == len(ROWS)
    assert rows.published == n_data == summary["rows_published"]
    assert rows.error_lines == n_errors
    assert (rows.plan_errors, rows.infer_errors) == (3, 1), rows
    assert rows.dropped >= 1, rows
    assert rows.read == rows.published + rows.plan_errors + rows.infer_errors + rows.dropped, rows
    assert rows.error_lines == rows.plan_errors + rows.infer_errors + rows.dropped, rows
    assert rows.balanced
