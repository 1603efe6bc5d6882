"""A Delta Lake table by path (a local folder or ``s3://``), written with delta-rs (the ``deltalake`` package).

A publish is one ``write_deltalake(mode="overwrite", predicate=<partition>)``: Delta's ``replaceWhere``, one
commit that removes the partition's files and adds the run's. delta-rs checks the commit against every commit
since the version it read: a concurrent commit that wrote the same partition makes it raise
``CommitFailedError`` (a conflict, written again by ``TableSink.publish``); one that wrote another partition does
not conflict, and delta-rs commits after it. On S3 delta-rs commits a version with a conditional PUT
(``If-None-Match``), so no lock service is needed where the store supports it (AWS S3 and the S3 servers the
tests run do).

Schema changes follow Delta's rules (``schema_mode="merge"``): a new column is added to the table (null in the
partitions written before), a column a run lacks is null in its rows; a column whose type changed is refused
(``TableSink._fitted``, before anything is written).
The commit's metadata lands in its ``commitInfo`` (``DESCRIBE HISTORY``, ``DeltaTable.history()``).
Retention is ``vacuum`` (files no version within the window reads, and orphans of failed writers older than it)
and the log's own clean-up (``delta.logRetentionDuration``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_llm.sinks.base import COMMIT_TOKEN, TableSchemaError, TableSink, sql_literal
from batch_llm.sinks.s3 import S3Access, is_s3

if TYPE_CHECKING:
    import pyarrow as pa


class DeltaSink(TableSink):
    """The Delta table at ``url``; ``storage_options``: the location's fsspec options (credentials, endpoint)."""

    format = "delta"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, partition_columns: list[str],
                 attempts: int = 5, backoff_s: float = 0.5):
        super().__init__(partition_columns=partition_columns, attempts=attempts, backoff_s=backoff_s)
        local = url.removeprefix("file://")
        self.url = local if "://" in local else str(Path(local).absolute())  # a relative folder: one table wherever
        self._options = S3Access.of(storage_options).delta_options() if is_s3(url) else None

    @property
    def name(self) -> str:
        return self.url

    def table(self, version: int | None = None):
        """The ``DeltaTable`` (at ``version``); None where there is no table yet."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.url, version=version, storage_options=self._options)
        except TableNotFoundError:
            return None

    def _table_schema(self) -> pa.Schema | None:
        import pyarrow as pa

        table = self.table()
        return pa.schema(table.schema().to_arrow()) if table is not None else None

    def _replace_partition(self, schema: pa.Schema, batches: Iterable[pa.RecordBatch], partition: dict[str, str],
                           metadata: dict[str, str]) -> tuple[int, int | None]:
        import pyarrow as pa
        from deltalake import CommitProperties, write_deltalake
        from deltalake.exceptions import SchemaMismatchError

        existing = self.table()
        if existing is not None and (cols := existing.metadata().partition_columns) != self.partition_columns:
            raise TableSchemaError(f"table {self.url} is partitioned by {cols}, this pipeline by "
                                   f"{self.partition_columns}")
        predicate = " AND ".join(f'"{c}" = {sql_literal(v)}' for c, v in partition.items())
        try:
            write_deltalake(self.url, pa.RecordBatchReader.from_batches(schema, iter(batches)), mode="overwrite",
                            predicate=predicate, partition_by=self.partition_columns, schema_mode="merge",
                            storage_options=self._options,
                            commit_properties=CommitProperties(custom_metadata=metadata))
        except SchemaMismatchError as e:
            raise TableSchemaError(f"table {self.url}: the rows do not fit its schema: {e}") from None
        version = self._version_of(metadata[COMMIT_TOKEN])
        return version, (version - 1 if version > 0 else None)

    def _version_of(self, token: str) -> int:
        """The version of this attempt's commit (other commits may have landed after it)."""
        table = self.table()
        for entry in table.history(limit=100) if table is not None else []:
            if entry.get(COMMIT_TOKEN) == token:
                return int(entry["version"])
        raise RuntimeError(f"table {self.url}: the commit just made is not in the table's last 100 versions")

    def _is_conflict(self, error: Exception) -> bool:
        from deltalake.exceptions import CommitFailedError

        return isinstance(error, CommitFailedError)

    def expire(self, retention_hours: float) -> dict[str, Any]:
        table = self.table()
        if table is None:
            return {"removed_files": 0}
        # full: also the orphans of writers whose commit failed; a file is removed only when no version younger
        # than the window reads it, so a reader of such a version keeps its files
        removed = table.vacuum(retention_hours=math.ceil(retention_hours), dry_run=False,
                               enforce_retention_duration=False, full=True)
        table.cleanup_metadata()
        return {"removed_files": len(removed)}
