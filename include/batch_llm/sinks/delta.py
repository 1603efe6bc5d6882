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
The commit's metadata lands in its ``commitInfo`` (``DESCRIBE HISTORY``, ``DeltaTable.history()``). The version a
publish records is the one its own commit created (delta-rs moves the written table object to it), checked against
that version's commit file carrying the attempt's token, never the newest version after the write.
Retention is ``vacuum`` (files no version within the window reads, and orphans of failed writers older than it)
and the log's own clean-up (``delta.logRetentionDuration``).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_llm.io.storage import Location
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
        self._log = Location(self.url, dict(storage_options or {})).child("_delta_log")

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
            # the table object, not its URL: delta-rs moves it to the version its commit created
            write_deltalake(existing if existing is not None else self.url,
                            pa.RecordBatchReader.from_batches(schema, iter(batches)), mode="overwrite",
                            predicate=predicate, partition_by=self.partition_columns, schema_mode="merge",
                            storage_options=self._options,
                            commit_properties=CommitProperties(custom_metadata=metadata))
        except SchemaMismatchError as e:
            raise TableSchemaError(f"table {self.url}: the rows do not fit its schema: {e}") from None
        version = existing.version() if existing is not None else self._version_of(metadata[COMMIT_TOKEN])
        if self._commit_info(version).get(COMMIT_TOKEN) != metadata[COMMIT_TOKEN]:
            raise RuntimeError(f"table {self.url}: version {version} is not the commit just made")
        return version, (version - 1 if version > 0 else None)

    def _version_of(self, token: str) -> int:
        """The version whose commit carries ``token``, searched from the newest down (the commit that made the
        table: writers racing to make it may have committed after it). Read from the log's commit files, not
        ``DeltaTable.history()``: delta-rs lists the newest commits in storage there but numbers them from the
        version it loaded, so a commit that lands in between shifts every number."""
        table = self.table()
        newest = table.version() if table is not None else -1
        for version in range(newest, max(newest - 100, -1), -1):
            if self._commit_info(version).get(COMMIT_TOKEN) == token:
                return version
        raise RuntimeError(f"table {self.url}: the commit just made is not in the table's last 100 versions")

    def _commit_info(self, version: int) -> dict[str, Any]:
        """The ``commitInfo`` of ``version``'s commit file (its custom metadata included); {} where it has none."""
        text = self._log.child(f"{version:020d}.json").path().read_text()
        for line in text.splitlines():
            if line.strip() and "commitInfo" in (action := json.loads(line)):
                return action["commitInfo"]
        return {}

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
