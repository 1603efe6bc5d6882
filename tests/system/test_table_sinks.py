"""The table sinks, called directly: Delta by path (a local folder and the S3 server on loopback) and Iceberg through
a SQLite SQL catalog (a local warehouse and one on the S3 server). Everything published is read back with DuckDB's
delta and iceberg readers: a first run, a re-run of the day, two publishers of one day racing, a backfill over
three days, a column added later, and retention."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from batch_llm.sinks import DeltaSink, IcebergSink, TableConflict, TableSchemaError, spooled_rows
from batch_llm.sinks.s3 import S3Access
from table_readers import duckdb_connection, reads_s3, rows_by_day, scan_sql

D1, D2, D3 = "2026-11-28", "2026-11-29", "2026-11-30"


@dataclass
class Backend:
    name: str
    table: dict            # what table_readers reads
    options: dict | None   # the location's storage options
    catalog: dict | None   # Iceberg catalog properties
    con: object            # DuckDB

    def sink(self, **kw):
        kw.setdefault("backoff_s", 0.05)
        if self.table["format"] == "delta":
            return DeltaSink(self.table["url"], self.options, partition_columns=["dt"], **kw)
        return IcebergSink(self.catalog, self.table["identifier"], partition_columns=["dt"], **kw)


@pytest.fixture(scope="module")
def duckdb():
    """One DuckDB for the module: loading its extensions takes seconds."""
    con = duckdb_connection()
    yield con
    con.close()


@pytest.fixture(params=["delta-local", "delta-s3", "iceberg-local", "iceberg-s3"])
def backend(request, tmp_path, duckdb) -> Backend:
    fmt, where = request.param.split("-")
    s3 = request.getfixturevalue("s3") if where == "s3" else None
    base = f"s3://{s3.bucket}/{tmp_path.name}" if s3 else f"file://{tmp_path}"
    options = s3.storage_options() if s3 else None
    con = duckdb
    if s3:
        reads_s3(con, s3)
    if fmt == "delta":
        url = f"{base}/reviews" if s3 else str(tmp_path / "reviews")
        return Backend(request.param, {"format": "delta", "url": url}, options, None, con)
    db = tmp_path / "catalog.db"
    catalog = {"type": "sql", "uri": f"sqlite:///{db}", "warehouse": f"{base}/warehouse",
               **(S3Access.of(options).iceberg_properties() if s3 else {})}
    return Backend(request.param, {"format": "iceberg", "catalog_db": str(db), "identifier": "batch_llm.reviews"},
                   options, catalog, con)


def rows_of(run: str, n: int = 3, **extra) -> list[dict]:
    return [{"id": f"r{i}", "output": f"{run} answer {i}", "prompt_tokens": 3 + i, **extra} for i in range(n)]


def publish(sink, day: str, run: str, rows: list[dict] | None = None, *, batches_hook=None):
    rows = rows_of(run) if rows is None else rows
    with spooled_rows(rows, batch_rows=2) as spooled:   # two rows a batch: every commit streams several batches
        if batches_hook is not None:
            spooled = batches_hook(spooled)
        return sink.publish(spooled, {"dt": day}, {"run_id": run, "rows_published": str(len(rows))})


def expected(run: str, n: int = 3) -> list[tuple]:
    return [(r["id"], r["output"]) for r in rows_of(run, n)]


def test_a_first_run_is_one_partition_with_its_run_in_the_commit(backend):
    commit = publish(backend.sink(), D1, "run-a")
    assert rows_by_day(backend.con, backend.table) == {D1: expected("run-a")}
    assert commit.rows == 3 and commit.attempts == 1 and commit.partition == {"dt": D1}
    assert commit.metadata == {"run_id": "run-a", "rows_published": "3"}
    sink = backend.sink()
    if backend.table["format"] == "delta":   # DESCRIBE HISTORY's commitInfo
        (entry,) = [h for h in sink.table().history() if h["version"] == commit.snapshot_id]
        assert entry["run_id"] == "run-a" and entry["operationParameters"]["mode"] == "Overwrite"
    else:                                    # the snapshot log's summary
        summary = sink.table().snapshot_by_id(commit.snapshot_id).summary
        assert summary["run_id"] == "run-a" and summary["rows_published"] == "3"


def test_a_rerun_of_the_day_replaces_it_and_the_day_before_stays_readable(backend):
    sink = backend.sink()
    first = publish(sink, D1, "run-a")
    publish(sink, D2, "other-day")
    again = publish(sink, D1, "run-b", rows_of("run-b", 2))   # fewer rows: replaced, not merged
    assert rows_by_day(backend.con, backend.table) == {D1: expected("run-b", 2), D2: expected("other-day")}
    assert again.previous_snapshot_id is not None and again.snapshot_id != first.snapshot_id
    # time travel to the snapshot before the re-run: run-a's rows of the day
    assert _day_at(backend, again.previous_snapshot_id, D1) == expected("run-a")


def _day_at(backend: Backend, snapshot: int, day: str) -> list[tuple]:
    if backend.table["format"] == "iceberg":
        sql = scan_sql({**backend.table, "snapshot_id": snapshot})
    else:   # DuckDB's delta_scan reads the latest version only: the version's files, as its log lists them
        files = backend.sink().table(version=snapshot).file_uris()
        sql = f"read_parquet({files!r}, hive_partitioning = true)"
    return backend.con.sql(f"SELECT id, output FROM {sql} WHERE dt = '{day}' ORDER BY id").fetchall()


class _Racing:
    """Rows whose first read pauses after one batch until the other publisher got that far too: both have read
    the table before either commits."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier, self.reads = barrier, 0

    def __call__(self, spooled):
        outer = self

        def batches():
            outer.reads += 1
            for i, b in enumerate(spooled.batches()):
                yield b
                if i == 0 and outer.reads == 1:
                    outer.barrier.wait(timeout=60)
        return type(spooled)(schema=spooled.schema, batches=batches)


@pytest.mark.parametrize("attempts", [5, 1], ids=["retried", "out-of-attempts"])
def test_two_publishers_of_one_day_racing(backend, attempts):
    """One commits; the other's commit is refused by the format and written again against the winner's snapshot
    (or, out of attempts, fails naming the day). The day holds one run's rows, never both, never none."""
    publish(backend.sink(), D1, "yesterday")
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def run(name: str):
        try:
            results[name] = publish(backend.sink(attempts=attempts), D1, name, batches_hook=_Racing(barrier))
        except Exception as e:  # noqa: BLE001 - the loser's error is what the test looks at
            results[name] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in ("run-x", "run-y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    day = rows_by_day(backend.con, backend.table)[D1]
    if attempts > 1:
        commits = sorted(results.values(), key=lambda c: c.attempts)
        assert [c.attempts for c in commits] == [1, 2]          # the loser wrote again, once, after the winner
        assert day == expected(commits[-1].metadata["run_id"])  # so its rows hold the day, whole
        assert commits[-1].previous_snapshot_id == commits[0].snapshot_id
    else:
        (lost,) = [e for e in results.values() if isinstance(e, TableConflict)]
        (won,) = [c for c in results.values() if not isinstance(c, Exception)]
        assert f"dt={D1}" in str(lost) and "concurrent writer" in str(lost)
        assert day == expected(won.metadata["run_id"])


@pytest.mark.parametrize("backend", ["delta-local", "delta-s3"], indirect=True)
def test_racing_publishers_each_record_the_version_their_own_commit_made(backend):
    """Twelve publishers of twelve days commit at once (delta-rs commits each after the others, no conflict):
    the version each one returns is the one whose commit file carries its run id, whatever landed after it."""
    import json

    from batch_llm.io.storage import Location

    publish(backend.sink(), D1, "first")   # the table exists: every racer reads it, then commits
    barrier = threading.Barrier(12)
    results: dict[str, object] = {}

    def run(i: int):
        barrier.wait(timeout=60)
        try:
            results[f"run-{i}"] = publish(backend.sink(attempts=3), f"2026-12-{i + 1:02d}", f"run-{i}")
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[f"run-{i}"] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    log = Location(backend.table["url"], backend.options or {}).child("_delta_log")
    carried = {}
    for run_id, commit in results.items():
        assert not isinstance(commit, Exception), (run_id, commit)
        lines = log.child(f"{commit.snapshot_id:020d}.json").path().read_text().splitlines()
        carried[run_id] = next(json.loads(x)["commitInfo"] for x in lines if '"commitInfo"' in x).get("run_id")
    assert carried == {run_id: run_id for run_id in results}


def test_a_backfill_over_three_days_then_one_day_again(backend):
    sink = backend.sink()
    for day in (D1, D2, D3):
        publish(sink, day, f"backfill-{day}")
    publish(sink, D2, "reprocess", rows_of("reprocess", 4))
    assert rows_by_day(backend.con, backend.table) == {
        D1: expected(f"backfill-{D1}"), D2: expected("reprocess", 4), D3: expected(f"backfill-{D3}")}


def test_a_column_added_later_is_null_in_the_days_before_and_a_changed_type_is_refused(backend):
    sink = backend.sink()
    publish(sink, D1, "before")
    publish(sink, D2, "added", rows_of("added", sentiment="positive"))
    publish(sink, D3, "without", rows_of("without", prompt_tokens=None))   # lacks it again; tokens null in every row
    got = rows_by_day(backend.con, backend.table, "id, sentiment, prompt_tokens")
    assert [r[1] for r in got[D1]] == [None] * 3 and got[D3] == [("r0", None, None), ("r1", None, None),
                                                                 ("r2", None, None)]
    assert got[D2] == [("r0", "positive", 3), ("r1", "positive", 4), ("r2", "positive", 5)]
    with pytest.raises(TableSchemaError, match="do not fit its schema"):
        publish(sink, D1, "retyped", [{"id": "r0", "output": "x", "prompt_tokens": "three"}])
    assert len(rows_by_day(backend.con, backend.table)[D1]) == 3   # the refused run changed nothing


def test_retention_keeps_the_window_and_removes_what_only_older_snapshots_read(backend, tmp_path):
    sink = backend.sink()
    first = publish(sink, D1, "run-a")
    publish(sink, D1, "run-b")
    assert sink.expire(1.0) in ({"removed_files": 0}, {"expired_snapshots": 0, "removed_files": 0, "removed_orphans": 0})
    assert _day_at(backend, first.snapshot_id, D1) == expected("run-a")   # within the window: still readable
    if backend.name == "delta-local":
        # an orphan of a publisher whose commit failed, older than the window, goes; run-a's files stay
        orphan = Path(backend.table["url"]) / f"dt={D1}" / "part-orphan.parquet"
        orphan.write_bytes(b"never committed")
        old = time.time() - 2 * 3600
        os.utime(orphan, (old, old))
        assert sink.expire(1.0) == {"removed_files": 1} and not orphan.exists()
        assert _day_at(backend, first.snapshot_id, D1) == expected("run-a")
    elif backend.table["format"] == "iceberg":
        import datetime as dt

        before = len(sink.table().snapshots())
        later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)   # every snapshot ages out
        done = sink.expire(1.0, now=later)
        assert done["expired_snapshots"] == before - 1 and done["removed_files"] > 0   # all but the current one
        assert rows_by_day(backend.con, backend.table) == {D1: expected("run-b")}
        assert sink.table().snapshot_by_id(first.snapshot_id) is None


_KILLED_PUBLISH = """
import json, sys
from batch_llm.sinks import IcebergSink, spooled_rows
catalog, identifier, day = json.loads(sys.argv[1])
with spooled_rows([{"id": f"r{i}", "output": "killed", "prompt_tokens": i} for i in range(6)], batch_rows=2) as rows:
    IcebergSink(catalog, identifier, partition_columns=["dt"]).publish(rows, {"dt": day}, {"run_id": "killed"})
"""


@pytest.mark.parametrize("backend", ["iceberg-local"], indirect=True)
def test_a_publisher_killed_before_its_iceberg_commit_leaves_orphans_the_next_retention_removes(backend):
    """A publisher killed after writing its data files and before its commit leaves files no snapshot reads; the
    next publish's retention deletes them once older than the window (younger ones may be a running publisher's
    and stay), never a file a snapshot reads, and the table reads as before."""
    import json
    import subprocess
    import sys

    from helpers import fault_env

    sink = backend.sink()
    publish(sink, D1, "run-a")
    data = Path(sink.table().location_provider().data_path.removeprefix("file://"))
    committed = set(data.rglob("*.parquet"))
    killed = subprocess.run([sys.executable, "-c", _KILLED_PUBLISH,
                             json.dumps([backend.catalog, backend.table["identifier"], D1])],
                            env={**os.environ, **fault_env("before_table_commit:1")}, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    orphans = set(data.rglob("*.parquet")) - committed
    assert len(orphans) == 3   # six rows, two a batch
    publish(sink, D2, "run-b")
    assert sink.expire(1.0)["removed_orphans"] == 0 and all(p.exists() for p in orphans)   # young: kept
    old = time.time() - 2 * 3600
    for p in data.rglob("*.parquet"):   # every data file, the committed ones too, older than the window
        os.utime(p, (old, old))
    assert sink.expire(1.0) == {"expired_snapshots": 0, "removed_files": 0, "removed_orphans": 3}
    assert not any(p.exists() for p in orphans) and all(p.exists() for p in committed)
    assert rows_by_day(backend.con, backend.table) == {D1: expected("run-a"), D2: expected("run-b")}
