"""The publish stage with ``output.table``: the run's rows (with its error rows and provenance columns) replace the
day in a Delta table (local and on the S3 server on loopback) or an Iceberg table (SQLite catalog), read back with
DuckDB; a re-run and racing runs of the day; the publish task's Asset event carries the snapshot id. (The sinks
alone, with a forced race, a backfill, schema changes and retention: test_table_sinks.py.)"""
from __future__ import annotations

import datetime as dt
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
from batch_llm.api import publish
from batch_llm.io.storage import Location, exists, iter_jsonl, write_jsonl
from batch_llm.manifests import FetchManifest, QuantizeManifest, RunSummary
from publish_runs import IDS, PARTITION, ready_to_publish
from table_readers import duckdb_connection, reads_s3, scan_sql

DAY = PARTITION.removeprefix("dt=")


@pytest.fixture(scope="module")
def duckdb():
    """One DuckDB for the module: loading its extensions takes seconds."""
    con = duckdb_connection()
    yield con
    con.close()


@pytest.fixture(params=["delta-local", "delta-s3", "iceberg-local"])
def target(request, tmp_path, duckdb):
    """(the output root, the output.table settings, what table_readers reads, a DuckDB connection)."""
    fmt, where = request.param.split("-")
    s3 = request.getfixturevalue("s3") if where == "s3" else None
    root = Location(f"s3://{s3.bucket}/{tmp_path.name}", s3.storage_options()) if s3 else Location(str(tmp_path))
    con = duckdb
    if s3:
        reads_s3(con, s3)
    if fmt == "delta":
        return root, {"format": "delta"}, {"format": "delta", "url": root.child("race", "_table").url}, con
    return root, {"format": "iceberg"}, {"format": "iceberg", "catalog_db": str(tmp_path / "_iceberg" / "catalog.db"),
                                         "identifier": "batch_llm.race"}, con


# Input lines 4-6 the planner refused: an id but no prompt, no id, and a duplicate of line 1's id
PLAN_ERRORS = [{"source": "in.jsonl", "line": 4, "id": 7, "reason": "no prompt"},
               {"source": "in.jsonl", "line": 5, "reason": "missing id (column 'id')"},
               {"source": "in.jsonl", "line": 6, "id": "a", "duplicate_of": "in.jsonl:1",
                "reason": "duplicate id 'a' (first at in.jsonl:1)"}]


def _with_plan_errors(run: tuple) -> tuple:
    """The run with three more input lines, refused by the planner (no output; the table gets their error rows)."""
    cfg, layout, plan, filtered, scores = run
    write_jsonl(Location(plan.errors, layout.output_root.options).path(), PLAN_ERRORS)
    return cfg, layout, plan.model_copy(update={"rows_read": 6, "invalid": 3}), filtered, scores


def _day(con, table: dict, columns: str = "_row_id, _status, output, _error, _run_id") -> list[tuple]:
    return con.sql(f"SELECT {columns} FROM {scan_sql(table)} WHERE dt = '{DAY}' ORDER BY _row_id").fetchall()


def test_a_run_and_a_rerun_of_the_day_replace_it_with_their_rows_and_errors(target):
    root, table_cfg, table, con = target
    first = publish(*_with_plan_errors(ready_to_publish(root, "r1", table=table_cfg)))
    ok = [(k, "ok", "answer of r1", None, "r1") for k in IDS]
    errors = [("in.jsonl:4", "error", None, "no prompt (in.jsonl line 4)", "r1"),
              ("in.jsonl:5", "error", None, "missing id (column 'id') (in.jsonl line 5)", "r1"),
              ("in.jsonl:6", "error", None, "duplicate id 'a' (first at in.jsonl:1) (in.jsonl line 6)", "r1")]
    assert _day(con, table) == sorted([*errors, *ok])
    # Joined on: every row has a stable row id of its own, and its input id where it had one; the duplicate's
    # error row has the id of the row it duplicates, and names that row's line
    assert _day(con, table, "_row_id, id") == sorted([("a", "a"), ("b", "b"), ("c", "c"), ("in.jsonl:4", "7"),
                                                      ("in.jsonl:5", None), ("in.jsonl:6", "a")])
    assert con.sql(f"SELECT count(DISTINCT _row_id), count(*) FROM {scan_sql(table)} WHERE dt = '{DAY}'"
                   ).fetchone() == (6, 6)
    assert first.table["previous_snapshot_id"] is None   # the table's first commit
    assert first.table["metadata"]["rows_read"] == "6" and first.table["metadata"]["rows_plan_errors"] == "3"
    summary = RunSummary.read(Location(first.summary, root.options).path())   # the run's record stays in its folder
    assert summary.dataset == first.dataset and summary.rows.balanced and exists(Location(first.report, root.options).path())

    rerun = ready_to_publish(root, "r2", table=table_cfg)
    again = publish(*rerun)
    assert _day(con, table) == [(k, "ok", "answer of r2", None, "r2") for k in IDS]   # replaced: r1's rows gone
    assert again.replaced == f"{first.dataset}@{first.table['snapshot_id']}"
    assert publish(*rerun) == again   # the task retried after its commit: the same publish, no new commit
    cols = {r[0] for r in con.sql(f"DESCRIBE SELECT * FROM {scan_sql(table)}").fetchall()}
    assert {"_model", "_model_hash", "_config_hash", "finish_reason", "prompt_tokens", "dt"} <= cols


def test_a_files_publish_names_each_error_line_as_the_table_does(tmp_path):
    """Files output: the rows keep the input's id; each line of errors.jsonl carries the row's id where it had
    one, its file and line, and the row id the table would give it."""
    m = publish(*_with_plan_errors(ready_to_publish(Location(str(tmp_path)), "r1")))
    assert [r["id"] for r in iter_jsonl(Location(m.dataset).path())] == IDS
    errors = list(iter_jsonl(Location(m.errors).path()))
    assert [(e.get("id"), e["row_id"], e["source"], e["line"]) for e in errors] == [
        (7, "in.jsonl:4", "in.jsonl", 4), (None, "in.jsonl:5", "in.jsonl", 5), ("a", "in.jsonl:6", "in.jsonl", 6)]
    assert errors[2]["duplicate_of"] == "in.jsonl:1"


def test_runs_of_one_day_racing_leave_one_runs_rows(target):
    root, table_cfg, table, con = target
    publish(*ready_to_publish(root, "before", table=table_cfg))
    runs = [ready_to_publish(root, f"racer{i}", table=table_cfg) for i in range(3)]
    done: list = []
    threads = [threading.Thread(target=lambda r=r: done.append(publish(*r))) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(done) == 3 and len({m.table["snapshot_id"] for m in done}) == 3
    rows = _day(con, table)
    (winner,) = {r[4] for r in rows}
    assert rows == [(k, "ok", f"answer of {winner}", None, winner) for k in IDS]


@pytest.mark.parametrize("target", ["delta-s3", "iceberg-local"], indirect=True)   # S3: through the connection
def test_the_publish_tasks_asset_event_carries_the_snapshot_id(target):
    from airflow.sdk import Asset
    from batch_llm_airflow import operators

    root, table_cfg, table, con = target
    conn = {"conn_id": "lake"} if root.url.startswith("s3://") else {}   # the s3 fixture's Airflow connection
    cfg, layout, plan, filtered, scores = ready_to_publish(root, "manual__1", table=table_cfg, **conn)
    for stage, m in {"plan": plan, "filter": filtered, "evaluate": scores,
                     "fetch": FetchManifest(source="local", id="org/m", local_dir="/m", cache_hit=True, files=[],
                                            total_bytes=0, content_hash="ab" * 32, model_key="org/m@local#abab"),
                     "quantize": QuantizeManifest(id="org/m", local_dir="/m", model_key="org/m@local#abab",
                                                  quantized=False)}.items():
        m.write(layout.stage(stage).path())
    op = operators.PublishOperator(task_id="publish", pipeline_config=cfg.model_dump(mode="json"),
                                   outlets=[Asset("batch_llm://race")])
    events: defaultdict = defaultdict(SimpleNamespace)
    op.execute({"params": {}, "run_id": "manual__1", "outlet_events": events,
                "dag_run": SimpleNamespace(logical_date=dt.datetime(2026, 12, 3), run_after=None)})
    (extra,) = [e.extra for e in events.values()]
    latest = con.sql(f"SELECT count(*) FROM {scan_sql(table)}").fetchone()
    assert latest == (3,) and extra["table_format"] == table_cfg["format"] and extra["run_id"] == "manual__1"
    assert f"{extra['snapshot_id']}" in layout.stage("publish").child("manifest.json").path().read_text()
    assert [r[4] for r in _day(con, table)] == ["manual__1"] * 3
