"""The pipeline against a real S3 server (SeaweedFS ``weed mini`` on loopback, fixture ``s3``): the whole DAG
through ``dag.test()`` with input and output in S3 under Airflow connection ``lake``; large artifacts as
multipart uploads; an S3 outage in the middle of inference (Airflow retries the task, the shard resumes from
its committed chunks); wrong credentials and a missing bucket failing with the connection and path named."""
from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from batch_llm.config import load_config
from batch_llm.io.storage import as_path, atomic_writer, iter_jsonl, list_files, write_bytes_atomic, write_jsonl
from helpers import race

ROOT_INPUT = os.path.join(os.path.dirname(__file__), "..", "..", "include", "sample_data", "demo_prompts.jsonl")


def _fs(s3):
    """A client of the test's own: no listing cache, not shared with the pipeline's s3fs instances."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3.storage_options())


def _read_jsonl(fs, url: str) -> list[dict]:
    return [json.loads(line) for line in fs.cat(url).decode().splitlines() if line.strip()]


def _valid_ids(lines: list[str]) -> list[str]:
    """The ids the demo input's valid rows carry, first occurrence, in input order (as test_pipeline_e2e)."""
    seen, out = set(), []
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r.get("id"), str) and r["id"] not in seen and (
                r.get("prompt") or (r.get("messages") and r["messages"][0]["role"] in ("user", "system"))):
            seen.add(r["id"])
            out.append(r["id"])
    return out


def _utc(day: str) -> dt.datetime:
    return dt.datetime.fromisoformat(day).replace(tzinfo=dt.timezone.utc)


def _state(dr) -> str:
    return str(getattr(dr.state, "value", dr.state))


# ------------------------------------------------------------------------------------------ a. the DAG on S3
DS = "2026-11-05"


@pytest.fixture(scope="module")
def s3_run(s3, airflow_db, demo_model_dir, demo_config_path):
    from batch_llm_airflow.dag_factory import pipeline_dag

    lines = open(ROOT_INPUT, encoding="utf-8").read().splitlines()
    s3.client().put_object(Bucket=s3.bucket, Key="in/demo_prompts.jsonl", Body="\n".join(lines).encode() + b"\n")
    cfg = load_config(demo_config_path).with_overrides({
        "input.path": f"s3://{s3.bucket}/in/", "input.conn_id": "lake",
        "output.path": f"s3://{s3.bucket}/out", "output.conn_id": "lake",
        "sharding.num_shards": 1})
    dag = pipeline_dag(cfg, source="demo.yaml (S3 test)")
    dr = dag.test(logical_date=_utc(DS))
    fs = _fs(s3)
    current = json.loads(fs.cat(f"{s3.bucket}/out/{cfg.name}/dt={DS}/_CURRENT.json"))
    summary = json.loads(fs.cat(current["version"] + "/summary.json"))
    return SimpleNamespace(cfg=cfg, dr=dr, fs=fs, lines=lines, current=current, summary=summary)


def test_s3_run_succeeded_every_valid_id_once_in_order(s3_run, s3):
    r = s3_run
    assert _state(r.dr) == "success", r.dr.state
    assert r.current["dataset"].startswith(f"s3://{s3.bucket}/out/"), r.current
    rows = _read_jsonl(r.fs, r.current["dataset"])
    expected = _valid_ids(r.lines)
    assert len(expected) >= 16
    assert [row["id"] for row in rows] == expected
    assert all(isinstance(row["output"], str) and row["output"].strip() for row in rows)
    assert r.current["rows"] == len(expected)


def test_s3_evalscope_report_and_manifests_in_s3(s3_run, s3):
    r = s3_run
    ev = r.summary["manifests"]["evaluate"]
    assert ev["report_json"].startswith(f"s3://{s3.bucket}/out/"), ev
    assert json.loads(r.fs.cat(ev["report_json"]))  # EvalScope's own report, stored next to the run
    plan = r.summary["manifests"]["plan"]
    plan_manifest = plan["records"].rsplit("/", 1)[0] + "/manifest.json"
    assert plan_manifest.startswith(f"s3://{s3.bucket}/out/{r.cfg.name}/runs/dt={DS}/")
    assert json.loads(r.fs.cat(plan_manifest))["shards"] == plan["shards"]
    shards = r.summary["manifests"]["infer"]
    assert len(shards) == 1
    infer_manifest = json.loads(r.fs.cat(shards[0]["outputs"].rsplit("/", 1)[0] + "/manifest.json"))
    assert infer_manifest["metrics"]["rows"] == plan["valid"]
    assert infer_manifest["engine"]["kind"] == "vllm"
    for stage in ("fetch", "quantize", "filter", "evaluate", "publish"):
        assert r.fs.exists(f"{plan_manifest.rsplit('/', 2)[0]}/{stage}/manifest.json"), stage


def test_large_artifact_is_multipart_small_is_single_put(s3):
    big, small = os.urandom(10 * 2**20 + 123), b'{"id": "x"}\n'
    opts = s3.storage_options()
    write_bytes_atomic(as_path(f"s3://{s3.bucket}/unit/big.bin", opts), big)
    write_bytes_atomic(as_path(f"s3://{s3.bucket}/unit/small.jsonl", opts), small)
    c = s3.client()
    # S3's ETag of a multipart object is "<md5 of the part md5s>-<number of parts>".
    assert c.head_object(Bucket=s3.bucket, Key="unit/big.bin")["ETag"].strip('"').endswith("-2")
    assert "-" not in c.head_object(Bucket=s3.bucket, Key="unit/small.jsonl")["ETag"]
    assert c.get_object(Bucket=s3.bucket, Key="unit/big.bin")["Body"].read() == big


def test_streamed_jsonl_is_multipart_and_a_failure_leaves_nothing(s3):
    opts = s3.storage_options()
    blob = "x" * 4000

    def rows(fail_at=None):
        for i in range(3000):  # ~12 MB: more than one 8 MiB part
            if i == fail_at:
                raise OSError("the source broke mid-stream")
            yield {"id": f"r{i}", "text": blob}

    assert write_jsonl(as_path(f"s3://{s3.bucket}/unit/stream.jsonl", opts), rows()) == 3000
    c = s3.client()
    assert c.head_object(Bucket=s3.bucket, Key="unit/stream.jsonl")["ETag"].strip('"').endswith("-2")
    back = list(iter_jsonl(as_path(f"s3://{s3.bucket}/unit/stream.jsonl", opts)))
    assert [r["id"] for r in back] == [f"r{i}" for i in range(3000)]
    with pytest.raises(OSError, match="mid-stream"):
        write_jsonl(as_path(f"s3://{s3.bucket}/unit/broken.jsonl", opts), rows(fail_at=2500))
    assert c.list_objects_v2(Bucket=s3.bucket, Prefix="unit/broken")["KeyCount"] == 0
    assert _no_uploads_left(c, s3.bucket, "unit/broken")


def _no_uploads_left(c, bucket: str, prefix: str) -> bool:
    return not c.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")


def test_a_failure_mid_write_leaves_no_object_and_no_upload(s3):
    """A writer that fails after parts went up: fsspec's deferred upload is aborted (no object, no parts left
    behind), and nothing completes it later: not the failing path, not the garbage collector."""
    import gc

    opts, c = s3.storage_options(), s3.client()
    path = as_path(f"s3://{s3.bucket}/unit/failed/big.bin", opts)
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_writer(path) as w:
            w.write(os.urandom(9 * 2**20))  # one part uploaded, the rest buffered
            assert not _no_uploads_left(c, s3.bucket, "unit/failed/")
            raise RuntimeError("the source broke mid-write")
    del w
    gc.collect()
    assert c.list_objects_v2(Bucket=s3.bucket, Prefix="unit/failed/")["KeyCount"] == 0
    assert _no_uploads_left(c, s3.bucket, "unit/failed/")
    with pytest.raises(RuntimeError, match="mid-write"):  # a small object: nothing was sent at all
        with atomic_writer(as_path(f"s3://{s3.bucket}/unit/failed/small.json", opts)) as w:
            w.write(b'{"half": ')
            raise RuntimeError("the source broke mid-write")
    assert c.list_objects_v2(Bucket=s3.bucket, Prefix="unit/failed/")["KeyCount"] == 0


def test_concurrent_writers_of_one_key_never_interleave(s3):
    """Writers of one key at once, each a multipart upload: readers see one writer's whole object, never a mix."""
    opts, c = s3.storage_options(), s3.client()
    size = 9 * 2**20
    contents = [bytes([65 + k]) * size for k in range(3)]
    key = "unit/concurrent/shared.bin"
    seen: list[bytes] = []

    def writer(k: int) -> None:
        with atomic_writer(as_path(f"s3://{s3.bucket}/{key}", opts)) as w:
            for i in range(0, size, 2**20):
                w.write(contents[k][i:i + 2**20])

    def reader(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                seen.append(c.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
            except c.exceptions.NoSuchKey:
                pass

    race(writer, len(contents), reader)
    final = c.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    assert final in contents
    assert all(s in contents for s in seen), {(len(s), s[:1], s[-1:]) for s in seen if s not in contents}
    assert _no_uploads_left(c, s3.bucket, "unit/concurrent/")


def test_list_files_skips_folder_marker(s3):
    c = s3.client()
    for key in ("unit/listing/", "unit/listing/a.jsonl", "unit/listing/b.jsonl", "unit/listing/sub/c.jsonl"):
        c.put_object(Bucket=s3.bucket, Key=key, Body=b"" if key.endswith("/") else b"{}\n")
    got = list_files(as_path(f"s3://{s3.bucket}/unit/listing", s3.storage_options()))
    assert [p.name for p in got] == ["a.jsonl", "b.jsonl", "sub"]
    assert [p.path for p in got][0] == f"{s3.bucket}/unit/listing/a.jsonl"
    assert list_files(as_path(f"s3://{s3.bucket}/unit/nothing-here", s3.storage_options())) == []


# ------------------------------------------------------------------------------------------ b. S3 outage
DS_OUTAGE = "2026-11-06"
OUTAGE_ROWS = 48


def _task_states(dag_id: str, task_id: str, logical_date: dt.datetime) -> list[str | None]:
    """States of a task's instances in the runs of one logical date (dag.test() clears older ones)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy.exc import OperationalError

    try:
        with create_session() as session:
            rows = (session.query(TaskInstance.state)
                    .join(DagRun, (DagRun.dag_id == TaskInstance.dag_id) & (DagRun.run_id == TaskInstance.run_id))
                    .filter(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id,
                            DagRun.logical_date == logical_date).all())
            return [str(getattr(s, "value", s)) if s else None for (s,) in rows]
    except OperationalError:  # SQLite busy while dag.test() commits: ask again
        return []


def test_s3_outage_mid_inference_retries_and_resumes(s3, airflow_db, demo_model_dir, demo_config_path):
    """S3 stops once the shard's first chunk is committed and stays down until the inference task has failed
    (after the storage client's own brief retries); Airflow retries the task, the worker resumes from the
    committed chunks, and every id is published exactly once."""
    from batch_llm_airflow.dag_factory import pipeline_dag

    ids = [f"o{i:03d}" for i in range(OUTAGE_ROWS)]
    body = "".join(json.dumps({"id": rid, "prompt": f"Write two sentences about the number {i}."}) + "\n"
                   for i, rid in enumerate(ids))
    s3.client().put_object(Bucket=s3.bucket, Key="outage-in/prompts.jsonl", Body=body.encode())
    cfg = load_config(demo_config_path).with_overrides({
        "input.path": f"s3://{s3.bucket}/outage-in/prompts.jsonl", "input.conn_id": "lake",
        "output.path": f"s3://{s3.bucket}/outage", "output.conn_id": "lake",
        "sharding.num_shards": 1, "engine.kind": "transformers", "engine.batch_size": 4,
        "engine.commit_every_rows": 4, "sampling.max_tokens": 32, "evaluate.enabled": False,
        "airflow.retries": 2, "airflow.retry_delay_seconds": 3})
    dag = pipeline_dag(cfg, source="demo.yaml (S3 outage test)")
    task_id = "pipeline.batch_inference"
    chunks_glob = f"{s3.bucket}/outage/{cfg.name}/runs/dt={DS_OUTAGE}/*/infer/shard-00000/chunks/*.jsonl"
    events: dict = {}
    done = threading.Event()
    t_start = time.monotonic()

    def mark(name: str) -> None:
        events[name] = round(time.monotonic() - t_start, 1)  # seconds since dag.test() started

    def saboteur():
        fs = _fs(s3)
        stopped = False
        try:
            while not done.is_set():
                if first := fs.glob(chunks_glob):
                    events["before_outage"] = sorted(first)
                    break
                time.sleep(0.2)
            else:
                return
            mark("first_chunk_seen")
            s3.stop()
            stopped = True
            mark("s3_stopped")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not done.is_set():
                if "up_for_retry" in _task_states(cfg.name, task_id, _utc(DS_OUTAGE)):
                    mark("task_up_for_retry")
                    break
                time.sleep(0.5)
        finally:
            s3.start()
            if stopped:
                mark("s3_back")

    thread = threading.Thread(target=saboteur, daemon=True)
    thread.start()
    try:
        dr = dag.test(logical_date=_utc(DS_OUTAGE))
    finally:
        done.set()
        thread.join(60)
    mark("dag_test_done")
    print(f"outage timeline: {events}")

    assert "before_outage" in events and "task_up_for_retry" in events, events
    assert _state(dr) == "success", dr.state
    tries = {ti.task_id: ti.try_number for ti in dr.get_task_instances()}
    assert tries[task_id] >= 2, tries  # the storage failure failed the attempt; Airflow retried it

    fs = _fs(s3)
    chunk_files = sorted(fs.glob(chunks_glob))
    assert set(events["before_outage"]) <= set(chunk_files)  # committed before the outage, kept, not redone
    assert len(chunk_files) > len(events["before_outage"])
    chunk_ids = Counter(r["id"] for f in chunk_files for r in _read_jsonl(fs, f))
    assert set(chunk_ids) == set(ids) and set(chunk_ids.values()) == {1}, chunk_ids.most_common(3)
    current = json.loads(fs.cat(f"{s3.bucket}/outage/{cfg.name}/dt={DS_OUTAGE}/_CURRENT.json"))
    published = [r["id"] for r in _read_jsonl(fs, current["dataset"])]
    assert published == ids  # every id once, in input order


# ------------------------------------------------------------------------------------------ c. clear errors
def _stage(cfg, task: str):
    from batch_llm_airflow.dag_factory import pipeline_dag

    return pipeline_dag(cfg, source="errors test").get_task(f"pipeline.{task}")


def _context(run_id: str = "manual__errors") -> dict:
    when = _utc("2026-11-07")
    return {"params": {}, "run_id": run_id,
            "dag_run": SimpleNamespace(logical_date=when, run_after=when, clear_number=0)}


@pytest.fixture
def error_cfg(s3, demo_config_path):
    s3.client().put_object(Bucket=s3.bucket, Key="errors-in/prompts.jsonl",
                           Body=b'{"id": "e1", "prompt": "Hello"}\n')

    def make(**over):
        base = {"input.path": f"s3://{s3.bucket}/errors-in/prompts.jsonl", "input.conn_id": "lake",
                "output.path": f"s3://{s3.bucket}/errors-out", "output.conn_id": "lake"}
        return load_config(demo_config_path).with_overrides({**base, **over})

    return make


@pytest.mark.parametrize("task", ["plan_shards", "publish"])
def test_wrong_credentials_name_connection_and_path(s3, monkeypatch, error_cfg, task):
    monkeypatch.setenv("AIRFLOW_CONN_BADCREDS", s3.connection_json(password="not-the-secret"))
    cfg = error_cfg(**{"output.conn_id": "badcreds"})
    with pytest.raises(RuntimeError) as err:
        _stage(cfg, task).execute(_context())
    msg = str(err.value)
    assert "storage connection 'badcreds'" in msg and f"path s3://{s3.bucket}/errors-out" in msg, msg
    assert "access denied" in msg, msg
    assert "'lake'" not in msg, msg  # the input's connection works: not blamed


@pytest.mark.parametrize("task", ["plan_shards", "publish"])
def test_missing_output_bucket_names_connection_and_path(s3, error_cfg, task):
    cfg = error_cfg(**{"output.path": "s3://no-such-bucket-batch-llm/out"})
    with pytest.raises(RuntimeError) as err:
        _stage(cfg, task).execute(_context())
    msg = str(err.value)
    assert "storage connection 'lake'" in msg and "path s3://no-such-bucket-batch-llm/out" in msg, msg
    assert "bucket 'no-such-bucket-batch-llm' does not exist" in msg, msg
    assert "no-such-bucket-batch-llm" not in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}


def test_missing_input_bucket_names_connection_and_path(s3, error_cfg):
    cfg = error_cfg(**{"input.path": "s3://no-such-input-bucket/prompts/"})
    with pytest.raises(RuntimeError) as err:
        _stage(cfg, "plan_shards").execute(_context())
    msg = str(err.value)
    assert "storage connection 'lake', path s3://no-such-input-bucket/prompts/" in msg, msg
    assert "does not exist" in msg, msg
