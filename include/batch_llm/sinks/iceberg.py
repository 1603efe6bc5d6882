"""An Apache Iceberg table through a pyiceberg catalog: a SQL catalog (SQLite for one machine, PostgreSQL in
production) or a REST catalog. Data and metadata files go to the catalog's warehouse (a local folder or
``s3://``).

A publish is one catalog commit of one transaction: a delete of the partition (whole files: the table is
identity-partitioned by the partition columns) and an append of the run's data files, written batch by batch
(pyiceberg's own ``overwrite`` takes the whole run as one Arrow table; it makes the same two snapshots). The
catalog accepts the commit only against the metadata it was made from; pyiceberg re-applies a commit that lost
to a concurrent one and validates it first: when the winner added files to the same partition it raises
``ValidationException`` (a conflict, written again by ``TableSink.publish``; the loser's data files are
deleted), when the winner wrote another partition the commit goes through after it.

Schema changes follow Iceberg's rules (``union_by_name``): a new column is added (null in earlier rows), a
column a run lacks is null in its rows; a column's type does not change. The commit's
metadata is in both snapshots' summaries (the snapshot log, ``<table>.snapshots`` in Spark or Trino).
Retention expires snapshots older than the window (never the current one) and deletes the files only they
reached, then the orphans: data files under the table's data folder that no snapshot reads and older than the
window (a publisher killed between writing them and its commit), at most ``MAX_ORPHANS_PER_PASS`` a pass.
"""
from __future__ import annotations

import datetime as dt
import itertools
import logging
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_llm.sinks.base import CHECKPOINT_EVENT, COMMIT_TOKEN, TableSchemaError, TableSink

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.catalog import Catalog

log = logging.getLogger("batch_llm.sinks")

MAX_ORPHANS_PER_PASS = 1000  # orphan data files one retention pass deletes


class IcebergSink(TableSink):
    """The table ``identifier`` (``namespace.name``) of the catalog that ``catalog_properties`` describe (pyiceberg's
    ``load_catalog`` properties: ``type``, ``uri``, ``warehouse``, ``s3.*``, credentials)."""

    format = "iceberg"

    def __init__(self, catalog_properties: dict[str, str], identifier: str, *, catalog_name: str = "batch_llm",
                 partition_columns: list[str], attempts: int = 5, backoff_s: float = 0.5):
        super().__init__(partition_columns=partition_columns, attempts=attempts, backoff_s=backoff_s)
        namespace, _, table = identifier.rpartition(".")
        if not namespace or not table:
            raise ValueError(f"Iceberg table {identifier!r}: name it as namespace.table")
        self.identifier, self.namespace = identifier, namespace
        self.catalog_name, self.properties = catalog_name, dict(catalog_properties)
        self._catalog: Catalog | None = None

    @property
    def name(self) -> str:
        return f"{self.catalog_name}.{self.identifier}"

    @property
    def catalog(self):
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            uri = self.properties.get("uri", "")
            if self.properties.get("type") == "sql" and uri.startswith("sqlite:///"):
                Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            self._catalog = load_catalog(self.catalog_name, **self.properties)
        return self._catalog

    def table(self):
        """The pyiceberg ``Table``; None where there is no table yet."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self.catalog.load_table(self.identifier)
        except NoSuchTableError:
            return None

    def _table_schema(self) -> pa.Schema | None:
        table = self.table()
        return table.schema().as_arrow() if table is not None else None

    def _table_for(self, schema: pa.Schema):
        """The table, made (with its partition spec, in one commit) when there is none yet."""
        from pyiceberg.exceptions import TableAlreadyExistsError

        table = self.table()
        if table is None:
            self.catalog.create_namespace_if_not_exists(self.namespace)
            try:
                txn = self.catalog.create_table_transaction(self.identifier, schema=schema)
                with txn.update_spec() as spec:
                    for c in self.partition_columns:
                        spec.add_identity(c)
                txn.commit_transaction()
            except TableAlreadyExistsError:  # a concurrent publisher made it first
                pass
            table = self.catalog.load_table(self.identifier)
        cols = [table.schema().find_column_name(f.source_id) for f in table.spec().fields]
        if cols != self.partition_columns:
            raise TableSchemaError(f"table {self.name} is partitioned by {cols}, this pipeline by "
                                   f"{self.partition_columns}")
        return table

    def _replace_partition(self, schema: pa.Schema, batches: Iterable[pa.RecordBatch], partition: dict[str, str],
                           metadata: dict[str, str]) -> tuple[int, int | None]:
        from functools import reduce

        from pyiceberg.exceptions import ValidationError
        from pyiceberg.expressions import And, BooleanExpression, EqualTo
        from pyiceberg.io.pyarrow import _dataframe_to_data_files

        table = self._table_for(schema)
        txn = table.transaction()
        if set(schema.names) - set(table.schema().column_names):  # a changed type was refused before (_fitted)
            try:
                with txn.update_schema() as update:
                    update.union_by_name(schema)
            except (ValidationError, ValueError) as e:
                raise TableSchemaError(f"table {self.name}: the rows do not fit its schema: {e}") from None
        target = txn.table_metadata.schema().as_arrow()
        # keywords: pydantic's checker reads pyiceberg's predicates by their fields; one column: its condition alone
        conditions: list[BooleanExpression] = [EqualTo(term=c, value=v) for c, v in partition.items()]
        condition = reduce(And, conditions)
        written: list[str] = []
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Delete operation did not match any records")
                txn.delete(condition, snapshot_properties=metadata)
            # The append snapshot of the same transaction, fed one batch at a time (a private producer: the
            # public overwrite wants the whole run as one Arrow table)
            with txn._append_snapshot_producer(metadata) as append:
                counter = itertools.count(0)
                for batch in batches:
                    for data_file in _dataframe_to_data_files(
                            table_metadata=txn.table_metadata, write_uuid=append.commit_uuid,
                            df=_conform(batch, target), io=table.io, counter=counter):
                        written.append(data_file.file_path)
                        append.append_data_file(data_file)
            sys.audit(CHECKPOINT_EVENT, "before_table_commit", self.name)  # the data files are written
            committed = txn.commit_transaction()
        except BaseException:
            _delete_files(table.io, written)  # none of them is in a snapshot
            raise
        return _snapshots_of(committed, metadata[COMMIT_TOKEN], self.name)

    def _is_conflict(self, error: Exception) -> bool:
        from pyiceberg.exceptions import CommitFailedException, ValidationException

        return isinstance(error, (CommitFailedException, ValidationException))

    def expire(self, retention_hours: float, *, now: dt.datetime | None = None) -> dict[str, Any]:
        table = self.table()
        if table is None:
            return {"expired_snapshots": 0, "removed_files": 0, "removed_orphans": 0}
        cutoff = (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(hours=retention_hours)
        cutoff_ms = int(cutoff.timestamp() * 1000)
        protected = {ref.snapshot_id for ref in table.metadata.refs.values()}
        expired = [s for s in table.snapshots() if s.timestamp_ms < cutoff_ms and s.snapshot_id not in protected]
        gone: set[str] = set()
        if expired:
            reached_by_expired = _files_of(expired, table.io)
            table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in expired]).commit()
            table.refresh()
            gone = reached_by_expired - _files_of(table.snapshots(), table.io)
            _delete_files(table.io, sorted(gone))
        return {"expired_snapshots": len(expired), "removed_files": len(gone),
                "removed_orphans": self._remove_orphans(table, cutoff)}

    def _remove_orphans(self, table, cutoff: dt.datetime) -> int:
        """Deletes data files under the table's data folder that no snapshot reads and that were written before
        ``cutoff``: the files of a publisher killed between writing them and its commit (a failed commit deletes
        its own). A file younger than the window may be a running publisher's, not yet committed, so it stays.
        At most ``MAX_ORPHANS_PER_PASS`` a pass: a backlog goes over the next publishes."""
        from pyarrow.fs import FileSelector, FileType
        from pyiceberg.io.pyarrow import PyArrowFileIO

        if not isinstance(table.io, PyArrowFileIO):  # the other FileIO lists nothing: no orphans found
            return 0
        scheme, netloc, root = PyArrowFileIO.parse_location(table.location_provider().data_path)
        fs = table.io.fs_by_scheme(scheme, netloc)
        # listed before the snapshots are read: a commit landing in between is then among the snapshots read
        listed = [f for f in fs.get_file_info(FileSelector(root, recursive=True, allow_not_found=True))
                  if f.type == FileType.File]
        old = [f.path for f in listed if f.mtime is not None and f.mtime < cutoff]
        if not old:
            return 0
        table.refresh()
        read = {PyArrowFileIO.parse_location(p)[2] for p in _files_of(table.snapshots(), table.io)}
        if read.isdisjoint(f.path for f in listed) and any(p.startswith(root) for p in read):
            # the snapshots' files are not named as the listing names them: delete nothing rather than guess
            log.warning("table %s: its data files are not found under %s; orphans left", self.name, root)
            return 0
        orphans = [p for p in old if p not in read][:MAX_ORPHANS_PER_PASS]
        for p in orphans:
            try:
                fs.delete_file(p)
            except OSError as e:  # an orphan left is a cost, not a wrong result: the next pass tries again
                log.warning("table %s: could not delete the orphan %s: %s", self.name, p, e)
        if orphans:
            log.info("table %s: deleted %d data files no snapshot reads (older than %s)", self.name, len(orphans),
                     cutoff.isoformat(timespec="seconds"))
        return len(orphans)


def _conform(batch: pa.RecordBatch, target: pa.Schema) -> pa.Table:
    """The batch in the table's column order and types; a column the run lacks is null."""
    import pyarrow as pa

    cols = []
    for f in target:
        i = batch.schema.get_field_index(f.name)
        cols.append(batch.column(i).cast(f.type) if i >= 0 else pa.nulls(batch.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=target)


def _snapshots_of(table, token: str, name: str) -> tuple[int, int | None]:
    """(the append snapshot of this attempt's commit, the snapshot before its first one)."""
    ours = [s for s in table.snapshots() if (s.summary and s.summary.get(COMMIT_TOKEN)) == token]
    if not ours:
        raise RuntimeError(f"table {name}: the commit just made is not in its snapshot log")
    return ours[-1].snapshot_id, ours[0].parent_snapshot_id


def _files_of(snapshots: Iterable, io) -> set[str]:
    """Every file the snapshots read: their manifest lists, manifests and live data files (a manifest that
    several snapshots share is read once)."""
    out: set[str] = set()
    for s in snapshots:
        out.add(s.manifest_list)
        for m in s.manifests(io):
            if m.manifest_path in out:
                continue
            out.add(m.manifest_path)
            out.update(e.data_file.file_path for e in m.fetch_manifest_entry(io, discard_deleted=True))
    return out


def _delete_files(io, paths: Iterable[str]) -> None:
    for p in paths:
        try:
            io.delete(p)
        except Exception as e:  # noqa: BLE001 - an orphan left behind is a cost, not a wrong result
            log.warning("could not delete %s: %s", p, e)
