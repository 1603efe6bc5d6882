"""sharding.shards_per_task with a real engine (CPU): one worker and one engine serve a task's consecutive shards
in turn, the engine starts once per task, and each shard keeps its own commits, manifest and exactly-once resume.

- ``batch-llm run`` (transformers): 4 shards two to a task publish what 4 tasks of one shard publish, with two
  engine starts (manifests and log), the two other shards naming the start they shared;
- the worker killed after a commit in a task's second shard: the retry leaves the first shard's committed
  manifest as it was, resumes the second from its chunks, and every row is committed once (transformers);
- a shard with too many error rows first in a task: the task's later shard still runs and commits, the task then
  fails naming the first, and a tolerant re-run takes both as committed (transformers);
- the DAG through ``dag.test()`` on the demo's own engine (vLLM): ceil(4 / 2) = 2 mapped inference tasks, every
  valid row published once in input order, two engine starts.
"""
from __future__ import annotations

import datetime as dt
import json
import os

import pytest
from batch_llm import api
from batch_llm.io.storage import Location, iter_jsonl, list_files, read_json
from batch_llm.isolation.worker_parent import WorkerFailed, WorkerHandle
from batch_llm.layout import RunLayout
from helpers import FAULT_INJECTION, ROOT, demo_config, run_demo_cli

DS = "2026-11-06"
FAST = ["engine.kind=transformers", "engine.batch_size=1", "sampling.max_tokens=12", "evaluate.enabled=false",
        "cache.enabled=false", "sharding.num_shards=4"]
DEMO_INPUT = ROOT / "include" / "sample_data" / "demo_prompts.jsonl"


def _published(current: dict) -> dict[str, str]:
    return {r["id"]: r["output"] for r in iter_jsonl(Location(current["dataset"]).path())}


def test_two_shards_a_task_publish_the_same_rows_with_one_engine_start_per_task(tmp_path, demo_model_dir):
    cur1, sum1, _ = run_demo_cli(DEMO_INPUT, tmp_path / "one", ds=DS, run_id="k1", sets=FAST)
    cur2, sum2, out2 = run_demo_cli(DEMO_INPUT, tmp_path / "two", ds=DS, run_id="k2",
                                    sets=[*FAST, "sharding.shards_per_task=2"])
    assert len(_published(cur1)) == 20
    assert list(_published(cur2).items()) == list(_published(cur1).items())  # same rows, same order, same text
    m1 = [s["metrics"] for s in sum1["manifests"]["infer"]]
    m2 = [s["metrics"] for s in sum2["manifests"]["infer"]]
    assert [s["shard"] for s in sum2["manifests"]["infer"]] == [0, 1, 2, 3]
    assert sum(m["engine_start_seconds"] > 0 for m in m1) == 4
    assert [m["engine_start_seconds"] > 0 for m in m2] == [True, False, True, False]
    assert [m["engine_shared_from"] for m in m2] == [None, 0, None, 2]
    assert out2.count("engine transformers") == 2 and "started 1 time(s)" in out2, out2[-3000:]
    starts = sum(m["engine_start_seconds"] for m in m2)
    print(f"engine start: {sum(m['engine_start_seconds'] for m in m1):.1f}s over 4 tasks, {starts:.1f}s over 2")


# ------------------------------------------------------------------------------ a kill in a task's second shard
WORKER_OVERRIDES = dict(engine__kind="transformers", engine__batch_size=1, engine__commit_every_rows=2,
                        sharding__num_shards=2, sharding__shards_per_task=2, sampling__max_tokens=12,
                        cache__enabled=False)


def _spec(tmp, run_id):
    cfg = demo_config(tmp, **WORKER_OVERRIDES)
    layout = RunLayout.for_run(cfg, run_id=run_id, ds=DS)
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    (task,) = api.shard_tasks(cfg, plan)
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(), "model": model.ref().model_dump(),
            "shards": [s.model_dump() for s in task]}
    return layout, plan, spec


def _shard_dir(layout, i):
    return layout.stage("infer").child(f"shard-{i:05d}").path()


def _chunk_ids(layout, i) -> list[str]:
    return [r["id"] for f in list_files(_shard_dir(layout, i) / "chunks", ".jsonl") for r in iter_jsonl(f)]


def _outputs(layout) -> dict[str, str]:
    return {r["id"]: r["output"] for i in (0, 1) for r in iter_jsonl(_shard_dir(layout, i) / "outputs.jsonl")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_model_dir):
    layout, _, spec = _spec(tmp_path_factory.mktemp("whole"), "whole")
    result = WorkerHandle.start(spec).wait(on_line=lambda _: None)
    assert [m["shard"] for m in result["shards"]] == [0, 1]
    return _outputs(layout)


def test_a_worker_killed_in_a_tasks_second_shard_resumes_it_and_does_not_redo_the_first(tmp_path, uninterrupted):
    layout, plan, spec = _spec(tmp_path, "killed")
    fault = tmp_path / "fault"
    fault.write_text("after_commit 1 shard-00001\n")  # the first commit in the second shard's folder
    env = {"BATCH_LLM_FAULT_FILE": str(fault),
           "PYTHONPATH": os.pathsep.join(p for p in (str(FAULT_INJECTION), os.environ.get("PYTHONPATH")) if p)}
    with pytest.raises(WorkerFailed, match="killed by signal 9"):
        WorkerHandle.start(spec, env=env).wait(on_line=lambda _: None)
    first = _shard_dir(layout, 0) / "manifest.json"
    assert first.exists() and not (_shard_dir(layout, 1) / "manifest.json").exists()
    before = (first.read_bytes(), first.stat().st_mtime_ns, sorted(list_files(_shard_dir(layout, 0) / "chunks")))
    cut = set(_chunk_ids(layout, 1))
    assert 0 < len(cut) < plan.shards[1].rows, cut

    lines: list[str] = []
    result = WorkerHandle.start(spec).wait(on_line=lines.append)  # the retry, same spec
    assert any("shard 0 already committed" in line for line in lines), lines[-10:]
    assert any(f"resuming shard 1: {len(cut)} rows already committed" in line for line in lines), lines[-10:]
    assert (first.read_bytes(), first.stat().st_mtime_ns,
            sorted(list_files(_shard_dir(layout, 0) / "chunks"))) == before  # not redone, not rewritten
    m0, m1 = result["shards"]
    assert m0 == json.loads(before[0]) and m1["metrics"]["engine_start_seconds"] > 0  # the retry's one start
    for i, s in enumerate(plan.shards):
        ids = _chunk_ids(layout, i)
        assert len(ids) == len(set(ids)) == s.rows, "a row was committed twice or lost"
    assert _outputs(layout) == uninterrupted  # greedy: the same text as a run never killed


# ------------------------------------------------------------------------------ the DAG (the demo's vLLM engine)
def test_the_dag_maps_ceil_shards_over_k_tasks_and_publishes_every_row_once(tmp_path, airflow_db, demo_model_dir,
                                                                          demo_config_path):
    from batch_llm.config import load_config
    from batch_llm_airflow.dag_factory import pipeline_dag

    cfg = load_config(demo_config_path).with_overrides({
        "output.path": str(tmp_path / "out"), "sharding.num_shards": 4, "sharding.shards_per_task": 2,
        "evaluate.enabled": False, "sampling.max_tokens": 8, "cache.enabled": False})
    dr = pipeline_dag(cfg, source="demo.yaml (shards_per_task)").test(
        logical_date=dt.datetime.fromisoformat(DS).replace(tzinfo=dt.timezone.utc))
    assert str(dr.state).endswith("success"), dr.state
    infer = [ti for ti in dr.get_task_instances() if ti.task_id == "pipeline.batch_inference"]
    assert sorted(ti.map_index for ti in infer) == [0, 1]  # ceil(4 / 2) mapped tasks
    assert all(str(ti.state).endswith("success") for ti in infer)
    current = read_json(Location(str(tmp_path / "out")).child(cfg.name, f"dt={DS}", "_CURRENT.json").path())
    rows = list(iter_jsonl(Location(current["dataset"]).path()))
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 20 and all(r["output"].strip() for r in rows)
    summary = read_json(Location(current["version"]).child("summary.json").path())
    shards = summary["manifests"]["infer"]
    assert [s["shard"] for s in shards] == [0, 1, 2, 3]
    assert [s["metrics"]["engine_start_seconds"] > 0 for s in shards] == [True, False, True, False]
    assert [s["metrics"]["engine_shared_from"] for s in shards] == [None, 0, None, 2]
    assert summary["rows"]["published"] == 20


# ------------------------------------------------------------------ a shard with too many errors in a task
def test_a_failing_shard_does_not_stop_the_tasks_later_shards(tmp_path, demo_model_dir):
    """max_error_rate 0 and a prompt over max_model_len in the task's first shard: that shard fails (its error
    row and outputs written), the second still runs and commits on the same engine, then the task fails naming
    the first; a re-run with a tolerant threshold takes both committed shards as they are, starting no engine."""
    from batch_llm.manifests import ShardManifest
    from batch_llm.stages.infer.runner import ShardFailed

    src = tmp_path / "input.jsonl"
    rows = [{"id": "huge", "prompt": "lorem ipsum " * 2_000}] + [{"id": f"ok-{i}", "prompt": f"Say {i}."}
                                                                    for i in range(7)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = demo_config(tmp_path, **{**WORKER_OVERRIDES, "engine__max_model_len": 256, "engine__max_error_rate": 0.0,
                                   "input__path": str(src)})
    layout = RunLayout.for_run(cfg, run_id="fail-first", ds=DS)
    model = api.fetch(cfg, layout)
    plan = api.plan_shards(cfg, layout)
    (task,) = api.shard_tasks(cfg, plan)
    assert "huge" in {r["id"] for r in iter_jsonl(Location(task[0].url).path())}  # the first shard fails
    said: list[str] = []
    with pytest.raises(ShardFailed, match=r"1 of 2 shards of this task failed \(the others committed\): shard 0: "):
        api.infer_shards(cfg, layout, model, task, say=said.append)
    assert any("the task's other shards go on" in s for s in said), said
    first, second = (ShardManifest.read_if_done(_shard_dir(layout, i)) for i in (0, 1))
    assert first is not None and first.metrics.errors == 1 and first.metrics.ok == 3
    assert second is not None and second.metrics.ok == 4 and second.metrics.errors == 0
    assert second.metrics.engine_shared_from == 0  # the second shard ran on the first's engine
    tolerant = cfg.with_overrides({"engine.max_error_rate": 0.5})
    again: list[str] = []
    ms = api.infer_shards(tolerant, layout, model, task, say=again.append)
    assert [m.metrics.ok for m in ms] == [3, 4] and "started 0 time(s)" in again[-1], again
