"""sharding.shards_per_task without an engine: the plan task hands the mapped tasks groups of consecutive shards
(each task one engine), the plan itself does not depend on the grouping (changing it re-plans nothing, so no
committed shard is redone), and the filter takes the tasks' lists of results as the shards they hold.
(With a real engine: tests/system/test_shards_per_task.py.)"""
from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest
from batch_llm.api import content_filter, plan_shards, shard_tasks
from batch_llm.config import ConfigError
from batch_llm.io.storage import Location, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import ShardManifest
from batch_llm_airflow.operators import PlanShardsOperator
from helpers import demo_config


def _context() -> dict:
    day = dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc)
    return {"dag_run": SimpleNamespace(logical_date=day, run_after=day, clear_number=0),
            "run_id": "scheduled__2026-11-30", "params": {}}


def _input(tmp_path, n=10):
    src = tmp_path / "in" / "prompts.jsonl"
    write_jsonl(Location(str(src)).path(), [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(n)])
    return str(src)


def test_shards_per_task_defaults_to_one_and_must_be_positive(tmp_path):
    assert demo_config(tmp_path).sharding.shards_per_task == 1
    with pytest.raises(ConfigError, match="shards_per_task"):
        demo_config(tmp_path, sharding__shards_per_task=0)


@pytest.mark.parametrize("per_task, tasks", [(1, [[0], [1], [2], [3], [4]]), (2, [[0, 1], [2, 3], [4]]),
                                             (5, [[0, 1, 2, 3, 4]]), (8, [[0, 1, 2, 3, 4]])])
def test_the_plan_task_maps_ceil_shards_over_k_tasks_of_consecutive_shards(tmp_path, per_task, tasks):
    cfg = demo_config(tmp_path, input__path=_input(tmp_path), sharding__num_shards=5,
                      sharding__shards_per_task=per_task)
    op = PlanShardsOperator(task_id="plan_shards", pipeline_config=cfg.model_dump(mode="json"))
    out = op.execute(_context())
    if per_task == 1:  # the XCom of before: one ShardSpec per mapped task
        assert [s["index"] for s in out] == [t[0] for t in tasks]
    else:
        assert [[s["index"] for s in t] for t in out] == tasks
        assert all(set(s) == {"index", "rows", "url", "plan_key"} for t in out for s in t)  # references only


def test_the_grouping_is_not_part_of_the_plan(tmp_path):
    """A Clear after shards_per_task changed finds the same plan (same key, same shard files): the committed
    shards are kept, not redone."""
    src = _input(tmp_path)
    one = demo_config(tmp_path, input__path=src, sharding__num_shards=4)
    layout = RunLayout.for_run(one, run_id="r", ds="2026-11-30")
    first = plan_shards(one, layout)
    again = plan_shards(one.with_overrides({"sharding.shards_per_task": 3}), layout)
    assert again.input_key == first.input_key and again.shards == first.shards
    assert [[s.index for s in t] for t in shard_tasks(one.with_overrides({"sharding.shards_per_task": 3}), first)] \
        == [[0, 1, 2], [3]]


def test_the_filter_takes_a_tasks_list_of_results_as_its_shards(tmp_path):
    src = _input(tmp_path, 4)
    cfg = demo_config(tmp_path, input__path=src, sharding__num_shards=2, filter__enabled=False)
    layout = RunLayout.for_run(cfg, run_id="r", ds="2026-11-30")
    plan = plan_shards(cfg, layout)
    results = []
    for s in plan.shards:
        d = layout.stage("infer").child(f"shard-{s.index:05d}")
        rows = [{"id": f"r{i}", "idx": i, "output": "x"} for i in range(s.index * 2, s.index * 2 + 2)]
        write_jsonl(d.child("outputs.jsonl").path(), rows)
        write_jsonl(d.child("errors.jsonl").path(), [])
        results.append(ShardManifest(shard=s.index, outputs=d.child("outputs.jsonl").url,
                                     errors=d.child("errors.jsonl").url, metrics={"rows": 2}, checksum="c",
                                     plan_key=s.plan_key).result().model_dump(mode="json"))
    m = content_filter(cfg, layout, plan, [results])  # one task of two shards: a list in the list
    assert m.rows == 4
