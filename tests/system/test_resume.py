"""Exactly-once resume: the worker is killed (SIGKILL) at several points, a retry resumes, and the final
shard output equals an uninterrupted run's: every row once, same text (greedy decoding).

The crash matrix runs on the transformers engine (seconds to start, so the matrix stays affordable on CPU);
the resume bookkeeping does not depend on the engine, and one crash-resume runs on vLLM too.
"""
from __future__ import annotations

import time

import pytest
from batch_llm import api
from batch_llm.io.storage import Location, iter_jsonl, list_files
from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle
from batch_llm.layout import RunLayout
from helpers import demo_config, fault_env

# batch_size 1: no padding, so greedy outputs do not depend on which rows share a batch after a resume. 8 new
# tokens a row: the per-token loop of batch 1 is most of the matrix's time, and 8 tell outputs apart as well.
SPEC_OVERRIDES = dict(engine__kind="transformers", engine__batch_size=1, engine__commit_every_rows=4,
                      sharding__num_shards=1, sampling__max_tokens=8, cache__enabled=False)


def _prepare(tmp, run_id, **over):
    cfg = demo_config(tmp, **{**SPEC_OVERRIDES, **over})
    layout = RunLayout.for_run(cfg, run_id=run_id, ds="2026-11-04")
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(), "model": model.ref().model_dump(),
            "shard": plan.shards[0].model_dump()}
    return cfg, layout, spec


def _shard_dir(layout) -> Location:
    return layout.stage("infer").child("shard-00000")


def _outputs(layout) -> list[dict]:
    return list(iter_jsonl(_shard_dir(layout).child("outputs.jsonl").path()))


def _chunk_ids(layout) -> list[str]:
    return [r["id"] for f in list_files(_shard_dir(layout).child("chunks").path(), ".jsonl") for r in iter_jsonl(f)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, demo_model_dir):
    _, layout, spec = _prepare(tmp_path_factory.mktemp("base"), "baseline")
    WorkerHandle.start(spec).wait(on_line=lambda _: None)
    rows = _outputs(layout)
    assert len(rows) == 20
    return {r["id"]: r["output"] for r in rows}


@pytest.mark.parametrize("fault", ["before_commit:2", "after_commit:1", "after_commit:3", "before_manifest:1"])
def test_crash_then_resume_equals_uninterrupted(tmp_path, baseline, fault):
    _, layout, spec = _prepare(tmp_path, f"crash-{fault}")
    with pytest.raises(WorkerFailed, match="killed by signal 9"):
        WorkerHandle.start(spec, env=fault_env(fault)).wait(on_line=lambda _: None)
    committed_before = _chunk_ids(layout)
    lines: list[str] = []
    WorkerHandle.start(spec).wait(on_line=lines.append)
    if committed_before:
        assert any(f"{len(set(committed_before))} rows already committed" in line for line in lines), lines[-5:]
    ids = _chunk_ids(layout)
    assert len(ids) == len(set(ids)) == 20, "a row was committed twice or lost"
    assert {r["id"]: r["output"] for r in _outputs(layout)} == baseline


def test_task_killed_mid_shard_resumes(tmp_path, baseline):
    """What on_kill does (SIGTERM to the group, then SIGKILL): stop after the first chunk, retry, compare."""
    _, layout, spec = _prepare(tmp_path, "killed")
    handle = WorkerHandle.start(spec)
    chunks = _shard_dir(layout).child("chunks").path()
    deadline = time.monotonic() + 120
    while not list_files(chunks, ".jsonl") and time.monotonic() < deadline:
        time.sleep(0.2)
    handle.stop(grace_seconds=5)
    assert handle.proc.poll() is not None
    from batch_llm.host.procgroup import process_group_alive

    assert not process_group_alive(handle.pid)
    # the first attempt was cut short: some rows committed, not all, and no shard manifest
    first = set(_chunk_ids(layout))
    assert 0 < len(first) < 20, len(first)
    assert not (_shard_dir(layout).path() / "manifest.json").exists()
    lines: list[str] = []
    WorkerHandle.start(spec).wait(on_line=lines.append)
    assert any(f"resuming shard 0: {len(first)} rows already committed" in line for line in lines), lines[-5:]
    ids = _chunk_ids(layout)
    assert len(ids) == len(set(ids)) == 20
    assert {r["id"]: r["output"] for r in _outputs(layout)} == baseline


def test_vllm_crash_after_commit_resumes(tmp_path, demo_model_dir):
    _, layout, spec = _prepare(tmp_path, "vllm-crash", engine__kind="vllm", engine__commit_every_rows=1)
    with pytest.raises(WorkerFailed, match="killed by signal 9"):
        WorkerHandle.start(spec, env=fault_env("after_commit:3")).wait(on_line=lambda _: None)
    assert 0 < len(_chunk_ids(layout)) < 20
    WorkerHandle.start(spec).wait(on_line=lambda _: None)
    ids = _chunk_ids(layout)
    assert len(ids) == len(set(ids)) == 20
    assert all(r["output"].strip() for r in _outputs(layout))


def test_merge_streams_chunks_in_input_order_each_id_once(tmp_path, monkeypatch):
    """The final merge of a shard: more chunks than one merge pass takes (so runs are merged in passes), a
    row committed twice (an interrupted commit), and a missing row, which fails the merge with its id."""
    import random

    from batch_llm.io.storage import write_jsonl
    from batch_llm.stages import shard_merge

    monkeypatch.setattr(shard_merge, "MERGE_FAN_IN", 3)
    shard_dir = Location(str(tmp_path / "shard"))
    rows = [{"id": f"r{i}", "idx": i * 7, "output": f"o{i}", "finish_reason": "stop", "prompt_tokens": 3,
             "completion_tokens": 2, "cached": False, "error": "too long" if i % 9 == 0 else None}
            for i in range(100)]
    shard_file = tmp_path / "rows.jsonl"
    write_jsonl(Location(str(shard_file)).path(), [{"id": r["id"], "idx": r["idx"]} for r in rows])
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    chunks = [sorted(shuffled[i:i + 8], key=lambda r: r["idx"]) for i in range(0, 100, 8)]
    chunks.append([rows[42]])  # committed twice
    for n, chunk in enumerate(chunks):
        write_jsonl(shard_dir.child("chunks").child(f"chunk-{n:05d}.jsonl").path(), chunk)
    m = shard_merge.finish_shard(0, shard_dir, shard_dir.child("chunks"), Location(str(shard_file)).path(), 100)
    ok = list(iter_jsonl(shard_dir.child("outputs.jsonl").path()))
    bad = list(iter_jsonl(shard_dir.child("errors.jsonl").path()))
    assert [r["id"] for r in ok] == [r["id"] for r in rows if not r["error"]]
    assert [r["id"] for r in bad] == [r["id"] for r in rows if r["error"]]
    assert m.metrics.model_dump(include={"rows", "ok", "errors", "invalid_outputs", "invalid_output_tokens",
                                         "input_tokens", "cached_prompt_tokens", "output_tokens"}) == {
        "rows": 100, "ok": 88, "errors": 12, "invalid_outputs": 0, "invalid_output_tokens": 0, "input_tokens": 300,
        "cached_prompt_tokens": 0, "output_tokens": 176}

    for f in list_files(shard_dir.child("chunks").path(), ".jsonl"):
        if any(r["id"] == "r55" for r in iter_jsonl(f)):
            write_jsonl(f, [r for r in iter_jsonl(f) if r["id"] != "r55"])
    other = Location(str(tmp_path / "other"))
    with pytest.raises(RuntimeError, match=r"1 rows have no committed result \(first: \['r55'\]\)"):
        shard_merge.finish_shard(0, other, shard_dir.child("chunks"), Location(str(shard_file)).path(), 100)
    assert not (tmp_path / "other" / "outputs.jsonl").exists(), "a failed merge must not publish a partial file"
