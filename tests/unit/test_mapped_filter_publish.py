"""The filter per shard and the publish from parts, without an engine (the shards' outputs written as the echo
engine of the tests writes them): the join of the parts' counts adds up, every input line is published once or
reported, a redone part leaves the others as they were, a part made from other outputs is refused, and
``output.parts`` publishes the same rows, one file a shard, as the one-writer publish does.
(Through a real scheduler: tests/system/test_rest_backfill.py, the Clear of one shard's filter.)"""
from __future__ import annotations

import json

import pytest
from batch_llm import api
from batch_llm.config import ConfigError, parse_config
from batch_llm.io.storage import Location, iter_jsonl, read_json, write_jsonl
from batch_llm.layout import RunLayout
from batch_llm.manifests import ShardMetrics, ShardResult
from batch_llm.stages.publish import published_lines


def _day(tmp_path) -> str:
    """Two files: one invalid row, and an id of the first file again in the second (a duplicate)."""
    src = tmp_path / "in"
    write_jsonl(Location(str(src / "a.jsonl")).path(), [{"id": f"r{i}", "prompt": f"q {i}"} for i in range(7)])
    write_jsonl(Location(str(src / "b.jsonl")).path(),
                [{"id": "r3", "prompt": "again"}, {"id": "bad"}] + [{"id": f"s{i}", "prompt": f"q {i}"} for i in range(5)])
    return str(src)


def _cfg(tmp_path, out: str, **output):
    return parse_config({"name": "mapped", "model": {"ref": "org/m"}, "input": {"path": _day(tmp_path)},
                         "output": {"path": str(tmp_path / out), **output}, "sharding": {"num_shards": 3},
                         "cache": {"enabled": False}, "evaluate": {"enabled": False},
                         "filter": {"lists": [{"name": "en", "path": "builtin:en", "action": "drop"}]}})


def _echo(layout, plan) -> list[ShardResult]:
    """Each shard's outputs as the shard runner writes them with the echo engine (``echo <n>``), row s2 failed,
    row r5 with a listed word (dropped by the filter)."""
    results = []
    for s in plan.shards:
        d = layout.shard_dir(s.index)
        rows = sorted(iter_jsonl(Location(s.url).path()), key=lambda r: r["idx"])
        ok = [{"id": r["id"], "idx": r["idx"], "output": f"echo {r['idx']}" + (" password" if r["id"] == "r5" else ""),
               "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2, "error": None}
              for r in rows if r["id"] != "s2"]
        bad = [{"id": r["id"], "idx": r["idx"], "error": "engine failed", "prompt_tokens": 3, "completion_tokens": 0}
               for r in rows if r["id"] == "s2"]
        write_jsonl(d.child("outputs.jsonl").path(), ok)
        write_jsonl(d.child("errors.jsonl").path(), bad)
        results.append(ShardResult(shard=s.index, outputs=d.child("outputs.jsonl").url, plan_key=s.plan_key,
                                   errors=d.child("errors.jsonl").url,
                                   metrics=ShardMetrics(rows=len(rows), ok=len(ok), errors=len(bad))))
    return results


def _run(cfg):
    layout = RunLayout.for_run(cfg, run_id="manual__1", ds="2026-12-06")
    plan = api.plan_shards(cfg, layout)
    shards = _echo(layout, plan)
    filtered = api.content_filter(cfg, layout, plan, shards)
    published = api.publish(cfg, layout, plan, filtered, api.evaluate(cfg, layout, plan, filtered))
    return layout, plan, shards, filtered, published


def test_the_join_adds_up_and_every_line_is_published_or_reported(tmp_path):
    _, plan, _, filtered, published = _run(_cfg(tmp_path, "one"))
    assert (plan.rows_read, plan.invalid, plan.duplicates, len(plan.shards)) == (14, 2, 1, 3)
    assert [p.shard for p in filtered.parts] == [0, 1, 2]
    assert filtered.rows == sum(p.rows for p in filtered.parts) == 10  # 12 valid, one failed, one dropped
    assert (filtered.inference_error_rows, filtered.summary.rows_dropped) == (1, 1)
    assert filtered.summary.hits_per_list == {"en": 1} and filtered.summary.dropped_ids == ["r5"]
    summary = read_json(Location(published.summary).path())
    assert summary["rows"]["read"] == 14 and summary["rows_published"] == 10
    errors = list(iter_jsonl(Location(published.errors).path()))
    assert sorted(e["stage"] for e in errors) == ["content_filter", "infer", "plan", "plan"]
    ids = [r["id"] for r in iter_jsonl(Location(published.dataset).path())]
    assert ids == [f"r{i}" for i in range(7) if i != 5] + ["s0", "s1", "s3", "s4"]  # input order, r3 once


def test_a_redone_part_leaves_the_others_and_a_stale_part_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "one")
    layout, plan, shards, filtered, _ = _run(cfg)
    parts = [read_json(layout.shard_dir(i, "filter").child("manifest.json").path()) for i in range(3)]
    again = api.filter_shard(cfg, layout, plan, shards[1])  # a Clear of filter_shard[1]
    joined = api.join_filter(cfg, layout, plan, shards, [parts[0], again.model_dump(), parts[2]])
    assert joined.rows == filtered.rows and joined.generation != filtered.generation
    assert [read_json(layout.shard_dir(i, "filter").child("manifest.json").path())["generation"]
            for i in (0, 2)] == [parts[0]["generation"], parts[2]["generation"]]
    # shard 1 generated again (more bytes) after its filter ran: the join names it
    rows = list(iter_jsonl(Location(shards[1].outputs).path()))
    write_jsonl(Location(shards[1].outputs).path(), [{**r, "output": r["output"] + " again"} for r in rows])
    with pytest.raises(ValueError, match=r"not filtered none, filtered from other outputs \[1\]"):
        api.join_filter(cfg, layout, plan, shards, [parts[0], again.model_dump(), parts[2]])
    with pytest.raises(ValueError, match=r"not filtered \[2\]"):
        api.join_filter(cfg, layout, plan, shards, [parts[0], api.filter_shard(cfg, layout, plan, shards[1])])


def test_parts_publish_the_same_rows_one_file_a_shard(tmp_path):
    *_, one = _run(_cfg(tmp_path, "one"))
    layout, plan, _, filtered, parts = _run(_cfg(tmp_path, "parts", parts=True))
    assert all(s.records for s in plan.shards) and all(p.data for p in filtered.parts)
    files = sorted(Location(parts.dataset).path().iterdir())
    assert [f.name for f in files] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    got = [r for f in files for r in map(json.loads, f.read_text().splitlines())]
    assert got == list(iter_jsonl(Location(one.dataset).path()))
    assert list(published_lines(parts.dataset)) == got == list(published_lines(one.dataset))  # what readers take
    assert parts.rows == one.rows == 10 and parts.error_rows == one.error_rows == 4
    summary = read_json(Location(parts.summary).path())
    assert summary["rows"] == read_json(Location(one.summary).path())["rows"]
    assert read_json(layout.published.child("_CURRENT.json").path())["dataset"] == parts.dataset


def test_parts_are_refused_with_a_table(tmp_path):
    with pytest.raises(ConfigError, match="output.parts"):
        _cfg(tmp_path, "t", parts=True, table={"format": "delta"})


def test_copy_object_links_locally_and_copies_within_a_store(tmp_path):
    from batch_llm.io.storage import copy_object

    src = Location(str(tmp_path / "a" / "data.jsonl"))
    write_jsonl(src.path(), [{"id": "x"}])
    local = Location(str(tmp_path / "v" / "data" / "part-00000.jsonl"))
    copy_object(src.path(), local.path())
    assert local.path().read_bytes() == src.path().read_bytes()
    assert (tmp_path / "v" / "data" / "part-00000.jsonl").stat().st_ino == (tmp_path / "a" / "data.jsonl").stat().st_ino
    write_jsonl(src.path(), [{"id": "y"}])  # a part written again (a new file): the published copy keeps its rows
    assert [r["id"] for r in iter_jsonl(local.path())] == ["x"]
    mem = Location("memory://mapped-copy/a.jsonl")
    copy_object(src.path(), mem.path())  # between stores: streamed
    copy_object(mem.path(), Location("memory://mapped-copy/v/b.jsonl").path())  # within one: the store's copy
    assert [r["id"] for r in iter_jsonl(Location("memory://mapped-copy/v/b.jsonl").path())] == ["y"]


def test_the_operators_hand_over_the_parts_and_publish_them(tmp_path):
    """The DAG's tasks in turn, each given what XCom would hand it (JSON): plan_shards, the shards (echo),
    filter_shard × 3 with output.parts, content_filter (the join), evaluate; then publish."""
    import datetime as dt
    from types import SimpleNamespace

    from batch_llm.layout import read_manifest_at
    from batch_llm_airflow.operators import (
        ContentFilterOperator,
        EvaluateOperator,
        PlanShardsOperator,
        ShardFilterOperator,
    )

    cfg = _cfg(tmp_path, "dag", parts=True)
    day = dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc)
    ctx = {"dag_run": SimpleNamespace(logical_date=day, run_after=day, clear_number=0),
           "run_id": "scheduled__2026-11-30", "params": {}, "outlet_events": {}}
    common = {"pipeline_config": cfg.model_dump(mode="json")}
    specs = json.loads(json.dumps(PlanShardsOperator(task_id="plan_shards", **common).execute(ctx)))
    assert [s["index"] for s in specs] == [0, 1, 2] and all(s["records"] for s in specs)
    layout = RunLayout.for_run(cfg, run_id=ctx["run_id"], ds="2026-11-30")
    shards = [s.model_dump(mode="json") for s in _echo(layout, api.plan_shards(cfg, layout))]
    parts = [json.loads(json.dumps(ShardFilterOperator(task_id="filter_shard", shard=s, **common).execute(ctx)))
             for s in shards]
    assert [p["shard"] for p in parts] == [0, 1, 2] and sum(p["data_rows"] for p in parts) == 10
    counts = ContentFilterOperator(task_id="content_filter", shards=shards, parts=parts, **common).execute(ctx)
    assert counts == {"rows": 10, "inference_error_rows": 1}
    # a task of two shards (sharding.shards_per_task): its filter task takes and returns their list
    pair = ShardFilterOperator(task_id="filter_shard", shard=shards[:2], **common).execute(ctx)
    assert [p["shard"] for p in pair] == [0, 1]
    counts = ContentFilterOperator(task_id="content_filter", shards=[shards[:2], shards[2]], parts=[pair, parts[2]],
                                   **common).execute(ctx)
    assert counts == {"rows": 10, "inference_error_rows": 1}
    EvaluateOperator(task_id="evaluate", **common).execute(ctx)
    # (the publish task also reads the fetch and quantize manifests this run has none of: the library's publish)
    ref = api.publish(cfg, layout, read_manifest_at(layout, "plan"), read_manifest_at(layout, "filter"),
                      read_manifest_at(layout, "evaluate"))
    current = read_json(layout.published.child("_CURRENT.json").path())
    assert current["rows"] == 10 and ref.rows == 10
    files = sorted(Location(current["dataset"]).path().iterdir())
    assert [sum(1 for _ in f.open()) for f in files] == [p["data_rows"] for p in parts]
