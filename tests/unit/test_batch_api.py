"""The OpenAI Batch API's library (batch_llm.batch_api): the store's files and limits, the input file's checks,
which pipeline serves a batch, a stopped batch's shard, and the status read from a run. The API itself, through
the official ``openai`` client against real Airflow services, is tests/system/test_openai_batch_api.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_llm.batch_api.errors import ApiError
from batch_llm.batch_api.runs import create_batch, request_cancel, serving_pipelines
from batch_llm.batch_api.status import RunView, TaskView, batch_object
from batch_llm.batch_api.stop import close_stopped_shard, stop_reason
from batch_llm.batch_api.store import BatchStore
from batch_llm.batch_api.validate import check_input
from batch_llm.config import ConfigError, parse_config
from batch_llm.config.openai_batch import OpenAIBatchConfig
from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import ShardSpec

MODEL = "demo-model"


def line(cid, model=MODEL, url="/v1/chat/completions", **body) -> bytes:
    return (json.dumps({"custom_id": cid, "method": "POST", "url": url,
                        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}) + "\n").encode()


@pytest.fixture
def store(tmp_path) -> BatchStore:
    return BatchStore(Location(str(tmp_path / "store")))


def upload(store: BatchStore, data: bytes, owner: str = "alice", **kw) -> dict:
    return store.write_file([data[i:i + 7] for i in range(0, len(data), 7)], owner=owner, filename="in.jsonl",
                            purpose="batch", **kw)


def test_files_stream_in_list_by_owner_page_and_delete(store):
    a = upload(store, line("a") + line("b"))
    b = upload(store, line("c"))
    upload(store, line("d"), owner="bob")
    with store.open_content(a["id"]) as f:
        assert f.read() == line("a") + line("b")
    assert a["bytes"] == len(line("a") + line("b")) and a["object"] == "file" and a["purpose"] == "batch"
    mine = lambda m: m["owner"] == "alice"  # noqa: E731
    page, more = store.files(mine, limit=1)
    assert [m["id"] for m in page] == [b["id"]] and more          # newest first
    page, more = store.files(mine, limit=1, after=b["id"])
    assert [m["id"] for m in page] == [a["id"]] and not more
    assert store.delete_file(a["id"]) == {"id": a["id"], "object": "file", "deleted": True}
    with pytest.raises(ApiError) as e:
        store.file(a["id"])
    assert e.value.status == 404
    for bad in ("file-../../etc", "nope", "batch_" + "0" * 24):
        with pytest.raises(ApiError) as e:
            store.file(bad)
        assert e.value.status == 404 and e.value.body()["error"]["message"].startswith("No file found")


def test_an_upload_over_the_limit_is_refused_while_streaming_and_leaves_nothing(store, tmp_path):
    with pytest.raises(ApiError) as e:
        upload(store, line("a") * 10, max_bytes=50)
    assert e.value.status == 413 and e.value.code == "file_too_large"
    assert not list((tmp_path / "store" / "files").glob("*/content"))
    assert store.files(lambda m: True) == ([], False)


def check(data: bytes, tmp_path, **section) -> dict:
    p = tmp_path / "in.jsonl"
    p.write_bytes(data)
    v = check_input(lambda: open(p, "rb"), expected_bytes=len(data), model=MODEL,
                    section=OpenAIBatchConfig(models=[MODEL], **section), max_line_bytes=1 << 20)
    return {e["code"]: e for e in v.errors} | {"lines": v.lines}


def test_input_checks_fail_the_batch_as_openai_does(tmp_path):
    assert check(line("a") + b"{not json\n" + line("b", url="/v1/completions"), tmp_path) == {"lines": 3}  # line errors
    mismatch = check(line("a") + line("b", model="other"), tmp_path)
    assert mismatch["mismatched_model"]["line"] == 2 and mismatch["mismatched_model"]["param"] == "body.model"
    assert "too_many_requests" in check(line("a") * 3, tmp_path, max_requests_per_file=2)
    assert "file_too_large" in check(line("a") * 3, tmp_path, max_file_bytes=10)
    assert "invalid_json_line" in check(b"id,prompt\n1,hello\n", tmp_path)
    assert "empty_file" in check(b"\n\n", tmp_path)
    v = check_input(lambda: (_ for _ in ()).throw(FileNotFoundError("x")), expected_bytes=1, model=MODEL,
                    section=OpenAIBatchConfig(models=[MODEL]), max_line_bytes=100)
    assert [e["code"] for e in v.errors] == ["file_not_found"]
    p = tmp_path / "short.jsonl"
    p.write_bytes(line("a"))
    v = check_input(lambda: open(p, "rb"), expected_bytes=len(line("a")) + 5, model=MODEL,
                    section=OpenAIBatchConfig(models=[MODEL]), max_line_bytes=1 << 20)
    assert [e["code"] for e in v.errors] == ["file_changed"]


def write_pipeline(folder: Path, name: str, section: dict | None, task: str = "generate") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"name": name, "model": {"ref": "x"}, "input": {"path": "in.jsonl"}, "output": {"path": "./out"},
            "engine": {"task": task}, **({"openai_batch": section} if section else {})}
    (folder / f"{name}.yaml").write_text(json.dumps(data))


def test_the_pipeline_serving_a_model_is_found_and_conflicts_serve_neither(tmp_path):
    folder = tmp_path / "pipelines"
    write_pipeline(folder, "a", {"models": [MODEL, "shared"]})
    write_pipeline(folder, "b", {"models": ["shared"], "endpoints": ["/v1/completions"]})
    write_pipeline(folder, "c", None)
    write_pipeline(folder, "d", {"models": ["vec"], "endpoints": ["/v1/chat/completions"]}, task="embed")
    found, problems = serving_pipelines(folder)
    assert [(p.dag_id, p.section.models) for p in found] == [("a", [MODEL])]
    assert any("'shared' is served by a and b" in p for p in problems)
    assert any("d.yaml" in p and "engine.task embed" in p for p in problems)
    assert found[0].output_path == str((folder / "out").resolve())


def test_creating_a_batch_routes_by_the_files_model_and_refuses_as_openai(store, tmp_path):
    folder = tmp_path / "pipelines"
    write_pipeline(folder, "demo", {"models": [MODEL], "completion_windows": ["24h", "30s"]})
    pipelines, _ = serving_pipelines(folder)
    f = upload(store, line("a") + line("b"))
    body = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "metadata": {"k": "v"}}
    record, serving = create_batch(store, pipelines, owner="alice", body=body)
    assert serving.dag_id == "demo" and record["model"] == MODEL and record["metadata"] == {"k": "v"}
    assert store.batch(record["id"]) == record

    def refused(status: int, param: str, owner: str = "alice", **change) -> None:
        with pytest.raises(ApiError) as e:
            create_batch(store, pipelines, owner=owner, body={**body, **change})
        assert (e.value.status, e.value.param) == (status, param), e.value.message

    refused(404, "input_file_id", owner="bob")                       # another user's file
    refused(404, "input_file_id", input_file_id="file-" + "0" * 24)
    refused(400, "endpoint", endpoint="/v1/embeddings")
    refused(400, "completion_window", completion_window="1h")
    refused(400, "metadata", metadata={"k" * 65: "v"})
    refused(400, "output_expires_after", output_expires_after={"anchor": "created_at", "seconds": 3600})
    other = upload(store, line("a", model="gpt-4o"))
    refused(400, "model", input_file_id=other["id"])
    refused(400, "input_file_id", input_file_id=upload(store, b"id,prompt\n1,hi\n")["id"])   # not JSONL


def test_a_stopped_shard_keeps_its_committed_rows_and_answers_the_rest(tmp_path, store):
    layout = RunLayout(output_root=Location(str(tmp_path / "out")), pipeline="demo", partition="p", run_id="r",
                       input=Location(""))
    shard_file = tmp_path / "shard.jsonl"
    write_jsonl(Location(str(shard_file)).path(), [{"id": f"r{i}", "idx": i} for i in range(4)])
    chunks = layout.shard_dir(0).child("chunks")
    write_jsonl(chunks.child("chunk-00000-a.jsonl").path(), [
        {"id": "r1", "idx": 1, "output": "x", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2,
         "cached": False, "error": None}])
    m = close_stopped_shard(layout, ShardSpec(index=0, rows=4, url=str(shard_file)), "batch_expired")
    assert (m.metrics.ok, m.metrics.errors) == (1, 3)
    errs = list(iter_jsonl(Location(m.errors).path()))
    assert [e["id"] for e in errs] == ["r0", "r2", "r3"] and {e["error_code"] for e in errs} == {"batch_expired"}
    # a second close (the task retried) keeps the committed shard
    assert close_stopped_shard(layout, ShardSpec(index=0, rows=4, url=str(shard_file)), "batch_cancelled") == m


def test_status_follows_the_run_and_the_notes(store, tmp_path):
    folder = tmp_path / "pipelines"
    write_pipeline(folder, "demo", {"models": [MODEL], "completion_windows": ["24h", "30s"]})
    pipelines, _ = serving_pipelines(folder)
    f = upload(store, line("a"))
    record, _ = create_batch(store, pipelines, owner="alice", body={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "30s"})
    bid = record["id"]

    def status(run: RunView | None, now: float | None = None) -> dict:
        return batch_object(record, run, store, None, now=now)

    b = status(RunView("queued"))
    assert b["status"] == "validating" and b["expires_at"] == record["created_at"] + 30
    assert b["object"] == "batch" and b["output_file_id"] is None and b["request_counts"]["total"] == 0
    store.write_note(bid, "validation", {"lines": 1, "errors": [], "checked_at": 5, "bytes_read": 1,
                                         "error_count": 0})
    assert status(RunView("running"))["status"] == "in_progress"
    assert status(RunView("running"))["in_progress_at"] == 5
    fin = status(RunView("running", tasks={"content_filter": [TaskView("running", 9)]}))
    assert (fin["status"], fin["finalizing_at"]) == ("finalizing", 9)
    done = status(RunView("success", end=12))
    assert (done["status"], done["completed_at"]) == ("completed", 12)
    assert status(RunView("failed", end=12))["errors"]["data"][0]["code"] == "run_failed"
    assert stop_reason(store, bid, now=record["created_at"] + 1) is None
    request_cancel(store, bid)
    assert status(RunView("running"))["status"] == "cancelling"
    assert stop_reason(store, bid).code == "batch_cancelled"
    c = status(RunView("success", end=20))
    assert (c["status"], c["cancelled_at"]) == ("cancelled", 20) and c["cancelling_at"] is not None
    store.write_note(bid, "validation", {"lines": 1, "errors": [{"code": "mismatched_model", "message": "m",
                                                                 "param": "body.model", "line": 1}],
                                         "checked_at": 6, "bytes_read": 1, "error_count": 1})
    bad = status(RunView("running"))
    assert bad["status"] == "failed" and bad["errors"]["data"][0]["code"] == "mismatched_model"


def test_the_config_section_is_validated_with_the_pipeline():
    base = {"name": "p", "model": {"ref": "x"}, "input": {"path": "in.jsonl"}, "output": {"path": "/tmp/o"}}
    cfg = parse_config({**base, "openai_batch": {"models": ["m"]}}, "t")
    assert cfg.openai_batch.endpoints == ["/v1/chat/completions"] and cfg.openai_batch.max_requests_per_file == 50_000
    for bad in ({"models": []}, {"models": ["m"], "endpoints": ["/v1/embeddings"]},
                {"models": ["m"], "completion_windows": ["1 day"]}, {"models": ["m"], "max_file_bytes": 0}):
        with pytest.raises(ConfigError):
            parse_config({**base, "openai_batch": bad}, "t")
