"""What a Clear in the Airflow UI finds: the run folder of its DAG run, whatever the clear count; the committed plan
while the input holds, a new plan when it changed; a shard folder started over when it was made for another plan
or model, resumed otherwise. (The whole path with a real scheduler: tests/system/test_rest_backfill.py.)"""
from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace

import pytest
from batch_llm.api import plan_shards
from batch_llm.io.storage import Location, exists, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import ShardResult
from batch_llm.stages.content_filter import check_shards_of_plan
from batch_llm.stages.infer.identity import drop_stale_shard
from batch_llm_airflow.operators import PlanShardsOperator
from helpers import demo_config


def _context(clear_number: int) -> dict:
    day = dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc)
    return {"dag_run": SimpleNamespace(logical_date=day, run_after=day, clear_number=clear_number),
            "run_id": "scheduled__2026-11-30", "params": {}}


def test_a_cleared_task_works_in_the_run_folder_of_its_dag_run(tmp_path):
    """Airflow raises dag_run.clear_number on any Clear of a task of the run: a folder named by it would hide the
    upstream stages' manifests from the cleared task (before: '<run_id>.clear1', empty)."""
    cfg = demo_config(tmp_path).model_dump(mode="json")
    op = PlanShardsOperator(task_id="plan_shards", pipeline_config=cfg)
    folders = {op.resolve(_context(n))[1].run_dir.url for n in (0, 1, 3)}
    assert len(folders) == 1 and folders.pop().endswith("/runs/dt=2026-11-30/scheduled__2026-11-30")


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(start, start + n)]


def test_the_plan_is_reused_while_its_input_holds_and_made_again_when_it_changed(tmp_path):
    src = tmp_path / "in" / "prompts.jsonl"
    write_jsonl(Location(str(src)).path(), _rows(4))
    cfg = demo_config(tmp_path, input__path=str(src))
    layout = RunLayout.for_run(cfg, run_id="scheduled__1", ds="2026-11-30")
    first = plan_shards(cfg, layout)
    again = plan_shards(cfg, layout)
    assert again == first and first.rows_read == 4 and first.input_key
    assert all(s.plan_key == first.input_key[:16] for s in first.shards)

    write_jsonl(Location(str(src)).path(), _rows(6))           # late rows landed; the day is cleared
    later = plan_shards(cfg, layout)
    assert later.rows_read == 6 and later.input_key != first.input_key
    assert {s.plan_key for s in later.shards} == {later.input_key[:16]}

    # The same bytes written again (same size, a new mtime): a new fingerprint, so planned again (never stale).
    write_jsonl(Location(str(src)).path(), _rows(6))
    assert plan_shards(cfg, layout).input_key != later.input_key
    # A setting the planner reads changed (a Clear after editing the YAML): planned again.
    resharded = cfg.with_overrides({"sharding.rows_per_shard": 2, "sharding.num_shards": None})
    assert len(plan_shards(resharded, layout).shards) == 3


def test_a_shard_folder_made_for_other_inputs_starts_over_and_one_made_for_these_resumes(tmp_path):
    shard_dir = Location(str(tmp_path / "infer" / "shard-00000"))
    chunk = shard_dir.child("chunks", "chunk-00000-ab.jsonl")
    write_jsonl(chunk.path(), [{"id": "r0", "idx": 0, "output": "old model's answer"}])
    a, b = {"plan": "p1", "model": "m1"}, {"plan": "p1", "model": "m2"}
    drop_stale_shard(shard_dir, a)             # a folder from before the keys: no marker, started over
    assert not exists(chunk.path())
    write_jsonl(chunk.path(), [{"id": "r0", "idx": 0, "output": "answer"}])
    drop_stale_shard(shard_dir, dict(a))       # a retry or a Clear of the same inputs: resumed
    assert exists(chunk.path())
    said: list[str] = []
    drop_stale_shard(shard_dir, b, said.append)  # the plan or the model changed since: started over, saying why
    assert not exists(chunk.path())
    marker = json.loads(shard_dir.child("inputs.json").path().read_text())
    assert marker["parts"] == b and marker["started_over"] == "the model changed" and "the model changed" in said[0]


def test_the_filter_refuses_shards_of_another_plan_or_a_missing_shard(tmp_path):
    src = tmp_path / "prompts.jsonl"
    write_jsonl(Location(str(src)).path(), _rows(6))
    cfg = demo_config(tmp_path, input__path=str(src), sharding__rows_per_shard=3, sharding__num_shards=None)
    plan = plan_shards(cfg, RunLayout.for_run(cfg, run_id="r", ds="2026-11-30"))
    assert len(plan.shards) == 2

    def result(index: int, plan_key: str | None) -> ShardResult:
        return ShardResult(shard=index, outputs="o", errors="e", metrics={"rows": 3}, plan_key=plan_key)

    check_shards_of_plan(plan, [result(0, plan.input_key[:16]), result(1, None)])  # None: from before the keys
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        check_shards_of_plan(plan, [result(0, plan.input_key[:16])])
    with pytest.raises(ValueError, match=r"made for another plan \[1\].*clear the plan task"):
        check_shards_of_plan(plan, [result(0, plan.input_key[:16]), result(1, "0123456789abcdef")])
