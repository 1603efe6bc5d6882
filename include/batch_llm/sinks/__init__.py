"""Table sinks: publish's rows as one partition of an Iceberg or Delta table, replaced in one atomic commit.

The file versions (``_CURRENT.json`` switched by compare-and-swap) are the default; with a table configured,
publish streams the run's rows to a sink instead, which gives the same guarantees through the table format's
own machinery: readers see the day before or after the commit, never a mix; a re-run or a Clear replaces the
day; of two publishers of one day racing, the format's optimistic concurrency lets one commit and the other
writes again against the winner's snapshot (no lost rows, no day twice); retention is the format's own
(Delta ``vacuum``, Iceberg snapshot expiry), never inside the retention window::

    with spooled_rows(rows, types=fields) as batches:
        commit = DeltaSink("s3://lake/reviews", options, partition_columns=["dt"]).publish(
            batches, {"dt": "2026-11-30"}, {"run_id": "scheduled__2026-11-30", "rows_published": "1000"})
    commit.snapshot_id       # the Delta version / Iceberg snapshot id holding the day

The libraries (``deltalake``, ``pyiceberg``) are the ``tables`` extra, imported when a sink writes.
"""
from batch_llm.sinks.base import RowBatches, TableCommit, TableConflict, TableSchemaError, TableSink
from batch_llm.sinks.delta import DeltaSink
from batch_llm.sinks.iceberg import IcebergSink
from batch_llm.sinks.rows import spooled_rows

__all__ = ["DeltaSink", "IcebergSink", "RowBatches", "TableCommit", "TableConflict", "TableSchemaError",
           "TableSink", "spooled_rows"]
