"""The OpenAI Batch API served by the Airflow plugin, driven by the official ``openai`` client: real Airflow services
(api-server, scheduler, dag-processor, LocalExecutor on SQLite; tests/airflow_services.py), one pipeline serving the
model name ``gpt-4o-mini`` on the demo model, each batch a DAG run the scheduler runs.

One set of services for the module (they take most of its time). The engine is transformers (it starts in seconds,
as in the other services tests); the OpenAI Batch lines through vLLM's engine are tests/system/test_openai_batch.py.

A shard is held still after its first committed chunk where a test needs one mid-shard (a cancel, an expiry, a
restart of the services): tests/fault_injection/sitecustomize.py's ``BATCH_LLM_HOLD_FILE``.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml
from airflow_services import AirflowServices, _wait_port, print_on_failure, write_test_pipeline
from helpers import FAULT_INJECTION

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "openai_batch_demo"
MODEL = "gpt-4o-mini"
# an embedding pipeline beside it (engine.task embed: vLLM's pooling runner on the same demo model)
EMBED_DAG, EMBED_MODEL = "openai_batch_embed", "text-embedding-3-small"
TERMINAL = ("completed", "failed", "expired", "cancelled")
ORDER = ("validating", "in_progress", "finalizing", "completed")
MAX_UPLOAD = 200_000
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello.",
             "Name a fruit.", "Count to three.", "Name an ocean.", "What color is the sky?"]


def request(cid: str, q: str, *, model: str = MODEL, url: str = "/v1/chat/completions", max_tokens: int = 6) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": q}]}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def services(tmp_path_factory, demo_model_dir, request):
    tmp = tmp_path_factory.mktemp("openai_batch_api")
    today = dt.datetime.now(dt.timezone.utc).date()
    pipelines, out, _ = write_test_pipeline(tmp, name=DAG_ID, days=[today], rows_per_day=1, num_shards=1,
                                            schedule=None, start_date=today - dt.timedelta(days=1), evaluate=False,
                                            batch_size=2, commit_every_rows=2)
    path = pipelines / f"{DAG_ID}.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["openai_batch"] = {"models": [MODEL], "endpoints": ["/v1/chat/completions", "/v1/completions"],
                           "completion_windows": ["24h", "40s"], "max_requests_per_file": 20}
    cfg["engine"]["max_error_rate"] = 1.0
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    embed = {**cfg, "name": EMBED_DAG, "openai_batch": {"models": [EMBED_MODEL]},  # endpoint: /v1/embeddings
             "engine": {"kind": "vllm", "task": "embed", "max_model_len": 512, "enforce_eager": True,
                        "max_error_rate": 1.0}}
    (pipelines / f"{EMBED_DAG}.yaml").write_text(yaml.safe_dump(embed, sort_keys=False))
    hold = tmp / "hold"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(FAULT_INJECTION), os.environ.get("PYTHONPATH")) if p),
           "BATCH_LLM_HOLD_FILE": str(hold), "BATCH_LLM_OPENAI_MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
           # The restart test: the restarted scheduler resets the tasks of the dead one once that one's heartbeat
           # is older than the health threshold, at its next orphan check (defaults 30 s and 300 s)
           "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
           "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5"}
    svc = AirflowServices(tmp, pipelines_dir=pipelines, extra_env=env, pools={"gpu": 2})
    svc.hold = hold
    failed_before = request.session.testsfailed
    try:
        svc.start()
        for dag_id in (DAG_ID, EMBED_DAG):
            svc.wait_dag_parsed(dag_id)
            svc.unpause(dag_id)
        yield svc
    finally:
        print_on_failure(request, svc, failed_before)
        svc.stop()


def client(svc: AirflowServices, max_retries: int = 5) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{svc.base_url}/openai/v1", api_key=svc.token(), max_retries=max_retries)


def upload(c, data: bytes, name: str = "requests.jsonl"):
    return c.files.create(file=(name, data), purpose="batch")


def wait(c, batch_id: str, until=TERMINAL, timeout: float = 240, svc: AirflowServices | None = None,
         dag_id: str = DAG_ID) -> tuple:
    """Polls the batch until ``until`` holds (a status in it, or a predicate); (batch, the statuses seen)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = c.batches.retrieve(batch_id)
        if not seen or seen[-1] != b.status:
            seen.append(b.status)
        if (b.status in until) if isinstance(until, tuple) else until(b):
            return b, seen
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} not there after {timeout:.0f}s: {seen}\n"
                         + (svc.describe_run(dag_id, batch_id) + svc.log_tails() if svc else ""))


def lines_of(c, file_id: str) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_the_life_of_a_batch_with_two_batches_at_once(services, tmp_path):
    """Upload, create, poll, download, with the example script's batch running beside it (two batches at once);
    per-line problems are those lines' errors and the rest of the batch goes on."""
    c = client(services)
    example = subprocess.Popen([sys.executable, str(ROOT / "examples" / "openai_batch.py")], cwd=tmp_path,
                               env={**os.environ, "OPENAI_BASE_URL": f"{services.base_url}/openai/v1",
                                    "OPENAI_API_KEY": services.token()},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    good = [request(f"q{i}", q) for i, q in enumerate(QUESTIONS[:4])]
    data = jsonl([*good, request("q0", "again"), request("c1", "Hi", url="/v1/completions"), request("b1", "x")]) \
        + b"{not json\n"
    f = upload(c, data)
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "requests.jsonl")
    assert c.files.retrieve(f.id).id == f.id and c.files.content(f.id).content == data
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "life"})
    assert batch.status == "validating" and batch.model == MODEL and batch.metadata == {"job": "life"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    b, seen = wait(c, batch.id, svc=services)
    assert b.status == "completed", (seen, b.errors)
    assert [s for s in seen if s in ORDER] == [s for s in ORDER if s in seen] and seen[-1] == "completed"
    assert b.request_counts.total == 8 and (b.request_counts.completed, b.request_counts.failed) == (5, 3)
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at and b.failed_at is None
    assert b.metadata == {"job": "life"} and b.usage.output_tokens > 0
    out = lines_of(c, b.output_file_id)
    assert [x["custom_id"] for x in out] == ["q0", "q1", "q2", "q3", "b1"]
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["model"] == MODEL for x in out)
    errors = {x["custom_id"]: x["response"]["body"]["error"] for x in lines_of(c, b.error_file_id)}
    assert "duplicate id" in errors["q0"]["message"] and "batch's endpoint" in errors["c1"]["message"]
    assert None in errors and len(errors) == 3                                      # the line that is not JSON
    assert c.files.retrieve(b.output_file_id).purpose == "batch_output"
    # lists: newest first, pages by after/limit (the example's batch may be newer or older than this one)
    ids = [x.id for x in c.batches.list(limit=100).data]
    assert b.id in ids and ids == sorted(ids, reverse=True)
    page = c.batches.list(limit=1)
    assert [x.id for x in page.data] == ids[:1] and page.has_more
    assert [x.id for x in c.batches.list(after=ids[0], limit=1).data] == ids[1:2]
    assert f.id in [x.id for x in c.files.list(purpose="batch").data]
    assert c.files.delete(f.id).deleted and f.id not in [x.id for x in c.files.list().data]
    stdout, _ = example.communicate(timeout=240)
    assert example.returncode == 0, stdout
    assert "request-1 ->" in stdout and "request-3 ->" in stdout, stdout


def test_an_embeddings_batch_runs_on_the_embedding_pipeline(services):
    """An embeddings batch, created with the official client, is a run of the embedding pipeline on vLLM's pooling
    runner: its output lines parse as the client's CreateEmbeddingResponse (floats, or base64 little-endian
    float32); a chat line in it is that line's error; the embedding model serves no chat batch (400)."""
    from openai.types import CreateEmbeddingResponse

    c = client(services)

    def line(cid: str, **body) -> dict:
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBED_MODEL, **body}}

    f = upload(c, jsonl([line("e1", input="The cat is on the table."),
                         line("e2", input="The cat is on the table.", encoding_format="base64"),
                         {**request("chat", "Hi", model=EMBED_MODEL)}]))
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["param"] == "endpoint" and "/v1/embeddings" in e.value.body["message"]
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.endpoint == "/v1/embeddings" and batch.model == EMBED_MODEL
    b, seen = wait(c, batch.id, svc=services, dag_id=EMBED_DAG, timeout=300)
    assert b.status == "completed", (seen, b.errors)
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (3, 2, 1)
    out = {x["custom_id"]: x["response"]["body"] for x in lines_of(c, b.output_file_id)}
    assert list(out) == ["e1", "e2"]
    floats = CreateEmbeddingResponse.model_validate(out["e1"])
    assert floats.model == EMBED_MODEL and floats.usage.prompt_tokens > 0 and len(floats.data[0].embedding) == 576
    packed = base64.b64decode(out["e2"]["data"][0]["embedding"])
    assert struct.unpack(f"<{len(packed) // 4}f", packed) == tuple(
        struct.unpack("<f", struct.pack("<f", x))[0] for x in floats.data[0].embedding)  # the same float32 vector
    (error,) = lines_of(c, b.error_file_id)
    assert error["custom_id"] == "chat" and "engine.task embed answers /v1/embeddings" in \
        error["response"]["body"]["error"]["message"]


def test_bad_input_is_refused_as_openai_refuses_it(services):
    c = client(services, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        c.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["message"].startswith("No file found") and e.value.body["param"] == "input_file_id"
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve("file-nope")
    with pytest.raises(openai.APIStatusError) as e:          # refused while streaming, nothing kept
        upload(c, b"x" * (MAX_UPLOAD + 1))
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    other = upload(c, jsonl([request("a", "hi", model="gpt-5")]))
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["code"] == "model_not_found" and "gpt-4o-mini" in e.value.body["message"]
    ok = upload(c, jsonl([request("a", "hi")]))
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=ok.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=ok.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{services.base_url}/openai/v1", api_key="not-a-token", max_retries=0).files.list()
    # failed by the run's check of the whole file: two models; more requests than the pipeline takes
    with pytest.raises(openai.BadRequestError) as e:       # not JSONL: no model to route it by
        c.batches.create(input_file_id=upload(c, b"id,prompt\n1,hello\n").id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert e.value.body["code"] == "invalid_json_line"
    failed = {}
    for name, data in {"models": jsonl([request("a", "hi"), request("b", "hi", model="gpt-4o")]),
                       "many": jsonl([request(f"r{i}", "hi") for i in range(21)])}.items():
        fid = upload(c, data).id
        failed[name] = c.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    for name, code in {"models": "mismatched_model", "many": "too_many_requests"}.items():
        b, _ = wait(c, failed[name].id, svc=services)
        assert b.status == "failed" and b.failed_at and b.output_file_id is None, (name, b)
        assert [e.code for e in b.errors.data] == [code], (name, b.errors)
    assert c.batches.retrieve(failed["many"].id).errors.data[0].param == "input_file_id"
    mismatch = c.batches.retrieve(failed["models"].id).errors.data[0]
    assert (mismatch.line, mismatch.param) == (2, "body.model")
    gone = upload(c, jsonl([request("a", "hi")]))
    # the input file deleted right after the batch is created: the run's check, seconds later, finds it gone
    b = c.batches.create(input_file_id=gone.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert c.files.delete(gone.id).deleted
    b, _ = wait(c, b.id, svc=services)
    assert b.status == "failed" and [e.code for e in b.errors.data] == ["file_not_found"], b


def held_batch(services, c, lines: list[dict], window: str = "24h"):
    """A batch whose shard is held after its first committed chunk (2 rows); returns it once that chunk shows."""
    services.hold.write_text("after_commit")
    b = c.batches.create(input_file_id=upload(c, jsonl(lines)).id, endpoint="/v1/chat/completions",
                         completion_window=window)
    b, seen = wait(c, b.id, until=lambda x: x.request_counts.completed >= 2 or x.status in TERMINAL, svc=services)
    assert b.status == "in_progress" and b.request_counts.completed == 2, (seen, b)
    return b


def test_a_cancel_mid_shard_publishes_the_answered_part(services):
    c = client(services)
    try:  # held until the run is done: the shard commits nothing after the first chunk but by the cancel's stop
        b = held_batch(services, c, [request(f"k{i}", q) for i, q in enumerate(QUESTIONS)])
        cancelling = c.batches.cancel(b.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done, seen = wait(c, b.id, svc=services)
    finally:
        services.hold.unlink(missing_ok=True)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at, (seen, done)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 2, 6)
    answered = [x["custom_id"] for x in lines_of(c, done.output_file_id)]   # the first chunk (longest first)
    assert len(answered) == 2 and set(answered) < {f"k{i}" for i in range(8)}, answered
    codes = {x["response"]["body"]["error"]["code"] for x in lines_of(c, done.error_file_id)}
    assert codes == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client(services, max_retries=0).batches.cancel(b.id)
    # resubmitted: the answered lines come from the result cache, the rest are generated
    again = c.batches.create(input_file_id=done.input_file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    b2, _ = wait(c, again.id, svc=services)
    assert b2.status == "completed" and b2.request_counts.completed == 8
    first = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
             for x in lines_of(c, done.output_file_id)}
    second = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
              for x in lines_of(c, b2.output_file_id)}
    assert {k: second[k] for k in first} == first


def test_an_expired_batch_publishes_what_it_answered(services):
    c = client(services)
    try:
        b = held_batch(services, c, [request(f"e{i}", q) for i, q in enumerate(QUESTIONS[:6])], window="40s")
        done, seen = wait(c, b.id, timeout=120, svc=services)
    finally:
        services.hold.unlink(missing_ok=True)
    assert done.status == "expired" and done.expired_at >= done.expires_at, (seen, done)
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 4)
    assert {x["response"]["body"]["error"]["code"] for x in lines_of(c, done.error_file_id)} == {"batch_expired"}


def test_a_restart_of_the_api_server_and_the_scheduler_loses_nothing(services):
    c = client(services)
    try:
        b = held_batch(services, c, [request(f"r{i}", q) for i, q in enumerate(QUESTIONS[:6])])
        services.procs.crash("api-server")
        services.procs.crash("scheduler")        # its task processes and the shard's worker die with it
        services.procs.spawn("api-server-restarted", [*services.airflow, "api-server", "-H", "127.0.0.1", "-p",
                                                      str(services.port), "-w", "1"])
        _wait_port(services.port, 120, what="api-server")
        after = wait(c, b.id, until=lambda x: True, svc=services)[0]
        assert after.status == "in_progress" and after.request_counts.completed == 2, after
    finally:
        services.hold.unlink(missing_ok=True)
    services.spawn_scheduler("scheduler-restarted")
    done, seen = wait(c, b.id, timeout=300, svc=services)
    assert done.status == "completed", (seen, done)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 6, 0)
    assert [x["custom_id"] for x in lines_of(c, done.output_file_id)] == [f"r{i}" for i in range(6)]
