"""Exactly-once resume: the worker is killed (SIGKILL) at several points, a retry resumes, and the final
shard output equals an uninterrupted run's: every row once, same text (greedy decoding).

The crash matrix runs on the transformers engine (seconds to start, so the matrix stays affordable on CPU);
the resume bookkeeping does not depend on the engine, and one crash-resume runs on vLLM too.
"""
from __future__ import annotations

import time

import pytest

from batch_llm import stages
from batch_llm.storage import Location, iter_jsonl, list_files
from batch_llm.worker import WorkerFailed, WorkerHandle
from helpers import demo_config

# batch_size 1: no padding, so greedy outputs do not depend on which rows share a batch after a resume.
SPEC_OVERRIDES = dict(engine__kind="transformers", engine__batch_size=1, engine__commit_every_rows=4,
                      sharding__num_shards=1, sampling__max_tokens=16, cache__enabled=False)


def _prepare(tmp, run_id, **over):
    cfg = demo_config(tmp, **{**SPEC_OVERRIDES, **over})
    layout = stages.RunLayout.for_run(cfg, run_id=run_id, ds="2026-11-04")
    model = stages.fetch(cfg, layout)
    plan = stages.plan_shards(cfg, layout)
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(), "model": model,
            "shard": plan["shards"][0]}
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
        WorkerHandle.start(spec, env={"BATCH_LLM_FAULT": fault}).wait(on_line=lambda _: None)
    committed_before = _chunk_ids(layout)
    lines: list[str] = []
    WorkerHandle.start(spec).wait(on_line=lines.append)
    if committed_before:
        assert any(f"{len(set(committed_before))} rows already committed" in l for l in lines), lines[-5:]
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
    from batch_llm.worker import process_group_alive

    assert not process_group_alive(handle.pid)
    WorkerHandle.start(spec).wait(on_line=lambda _: None)
    ids = _chunk_ids(layout)
    assert len(ids) == len(set(ids)) == 20
    assert {r["id"]: r["output"] for r in _outputs(layout)} == baseline


def test_vllm_crash_after_commit_resumes(tmp_path, demo_model_dir):
    _, layout, spec = _prepare(tmp_path, "vllm-crash", engine__kind="vllm", engine__commit_every_rows=1)
    with pytest.raises(WorkerFailed, match="killed by signal 9"):
        WorkerHandle.start(spec, env={"BATCH_LLM_FAULT": "after_commit:3"}).wait(on_line=lambda _: None)
    assert 0 < len(_chunk_ids(layout)) < 20
    WorkerHandle.start(spec).wait(on_line=lambda _: None)
    ids = _chunk_ids(layout)
    assert len(ids) == len(set(ids)) == 20
    assert all(r["output"].strip() for r in _outputs(layout))
