"""What every table sink does the same way: one commit that replaces one partition, retried against the new
snapshot when a concurrent writer won, and the record of that commit.

A sink takes the run's rows as a re-readable stream of Arrow batches (``RowBatches``: a retry writes them again,
so the stream is read from a spool, never held whole in memory), the partition's values (``{"dt": "2026-11-30"}``)
and the commit's metadata (run id, model hash, row accounting: strings), and commits them as the table format's
own atomic replacement of that partition (Delta ``replaceWhere``, an Iceberg overwrite by partition filter).
Readers see the partition before or after the commit, never a mix; the other partitions are untouched.

Two publishers of one partition at once: the format's optimistic concurrency lets one commit; the other's
commit is refused (its files are not part of the table), and it writes again against the snapshot that won, so
the partition holds one run's rows, never both and never none. After ``attempts`` refusals in a row it raises
``TableConflict`` naming the table and partition.
"""
from __future__ import annotations

import logging
import random
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("batch_llm.sinks")

# The commit metadata key that names one attempt's commit, so the sink finds its own snapshot in the table's
# history even when other commits landed right after it.
COMMIT_TOKEN = "batch_llm.commit"
# A commit's checkpoints, announced as audit events like the shards' (stages/infer/runner.py): free when nobody listens;
# the fault-injection tests listen and kill the publisher there.
CHECKPOINT_EVENT = "batch_llm.sink.checkpoint"


class TableConflict(RuntimeError):
    """Every attempt of a partition's commit lost to a concurrent writer."""


class TableSchemaError(ValueError):
    """The rows cannot be written into the table's schema (a column's type changed, a partition column clash)."""


@dataclass(frozen=True)
class RowBatches:
    """The rows of one publish: their Arrow schema and a function that streams them (again, for a retry)."""

    schema: pa.Schema
    batches: Callable[[], Iterator[pa.RecordBatch]]


@dataclass(frozen=True)
class TableCommit:
    """One committed replacement of a partition: which snapshot holds it and which one it replaced."""

    format: str                    # "delta" | "iceberg"
    table: str                     # Delta: the table's URL; Iceberg: catalog name and table identifier
    snapshot_id: int               # Delta: the table version; Iceberg: the snapshot id
    previous_snapshot_id: int | None  # the table's snapshot before this commit (time travel to the day before)
    partition: dict[str, str]
    rows: int
    attempts: int
    metadata: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TableSink(ABC):
    """A table that publish replaces partitions of (``DeltaSink``, ``IcebergSink``)."""

    format: ClassVar[str]

    def __init__(self, *, partition_columns: list[str], attempts: int = 5, backoff_s: float = 0.5):
        if not partition_columns:
            raise ValueError("a table sink needs at least one partition column")
        self.partition_columns = list(partition_columns)
        self.attempts = attempts
        self.backoff_s = backoff_s

    @property
    @abstractmethod
    def name(self) -> str:
        """The table, as TableCommit.table and error messages name it."""

    def publish(self, rows: RowBatches, partition: Mapping[str, str], metadata: Mapping[str, str]) -> TableCommit:
        """Replaces ``partition`` with ``rows`` in one commit (retried against the winner's snapshot when a
        concurrent writer's commit came first); returns the commit."""
        values = self._partition_values(partition)
        clash = [c for c in values if c in rows.schema.names]
        if clash:
            raise TableSchemaError(f"table {self.name}: partition column {clash[0]!r} is also a column of the rows; "
                                   "name the partition column otherwise")
        from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

        def wait(state: RetryCallState) -> float:  # grows with the attempt, jittered: racing writers fall out of step
            return self.backoff_s * state.attempt_number * (0.5 + random.random())

        def told(state: RetryCallState) -> None:
            log.warning("table %s: a concurrent commit replaced %s first; writing again against its snapshot in %.1f s "
                        "(attempt %d of %d)", self.name, _where(values), state.upcoming_sleep, state.attempt_number + 1,
                        self.attempts)

        try:
            for attempt in Retrying(stop=stop_after_attempt(self.attempts), wait=wait, before_sleep=told,
                                    retry=retry_if_exception(lambda e: isinstance(e, Exception) and self._is_conflict(e)),
                                    reraise=True):
                with attempt:
                    token = uuid.uuid4().hex
                    md = {**{k: str(v) for k, v in metadata.items()}, COMMIT_TOKEN: token}
                    # against the table as it is now: a concurrent writer may have added a column since the last try
                    schema = with_partition_columns(self._fitted(rows.schema), list(values))
                    counted = _Counted(rows.batches(), values, schema)
                    snapshot, previous = self._replace_partition(schema, counted, values, md)
                    # returned inside the attempt: after it, a failed attempt's loop goes on to the next
                    return TableCommit(format=self.format, table=self.name, snapshot_id=snapshot,
                                       previous_snapshot_id=previous, partition=values, rows=counted.rows,
                                       attempts=attempt.retry_state.attempt_number,
                                       metadata={k: v for k, v in md.items() if k != COMMIT_TOKEN})
        except Exception as e:
            if not self._is_conflict(e):
                raise
            raise TableConflict(
                f"table {self.name}: the commit replacing {_where(values)} lost to a concurrent writer "
                f"{self.attempts} times in a row; the partition holds the winner's rows ({e})") from e
        raise AssertionError("unreachable")  # Retrying returns or raises

    def _fitted(self, schema: pa.Schema) -> pa.Schema:
        """The rows' schema as the table takes it: a column null in every row gets the table's type for it (a
        string where the table has none); a column whose type differs from the table's is refused, naming it."""
        import pyarrow as pa

        table = self._table_schema()
        fields = []
        for f in schema:
            known = table.field(f.name) if table is not None and f.name in table.names else None
            if pa.types.is_null(f.type):
                f = f.with_type(known.type if known is not None else pa.string())
            elif known is not None and _kind(known.type) != _kind(f.type):
                raise TableSchemaError(
                    f"table {self.name}: the rows do not fit its schema: column {f.name!r} is {known.type} in the "
                    f"table and {f.type} in these rows (a column's type cannot change; publish it under a new name)")
            fields.append(f)
        return pa.schema(fields)

    @abstractmethod
    def _table_schema(self) -> pa.Schema | None:
        """The table's current columns as Arrow types; None where there is no table yet."""

    def _partition_values(self, partition: Mapping[str, str]) -> dict[str, str]:
        missing = [c for c in self.partition_columns if c not in partition]
        extra = [c for c in partition if c not in self.partition_columns]
        if missing or extra:
            raise TableSchemaError(f"table {self.name}: partitioned by {self.partition_columns}, given values for "
                                   f"{list(partition)}")
        return {c: str(partition[c]) for c in self.partition_columns}

    @abstractmethod
    def _replace_partition(self, schema: pa.Schema, batches: Iterable[pa.RecordBatch], partition: dict[str, str],
                           metadata: dict[str, str]) -> tuple[int, int | None]:
        """One attempt: writes ``batches`` (the partition columns added) and commits them as the replacement of
        ``partition`` with ``metadata``; returns (the commit's snapshot, the one before it). Raises what
        ``_is_conflict`` recognises when a concurrent commit came first."""

    @abstractmethod
    def _is_conflict(self, error: Exception) -> bool:
        """Whether ``error`` is the format's refusal of a commit that a concurrent writer's came before."""

    @abstractmethod
    def expire(self, retention_hours: float) -> dict[str, Any]:
        """The format's own retention: files and snapshots no reader can need after ``retention_hours`` are
        removed, never the current snapshot nor one younger than the window. Returns what it removed."""


def with_partition_columns(schema: pa.Schema, columns: list[str]) -> pa.Schema:
    import pyarrow as pa

    return pa.schema([*schema, *(pa.field(c, pa.string()) for c in columns)])


class _Counted:
    """The batches with the partition columns appended, counting the rows that went through."""

    def __init__(self, batches: Iterator[pa.RecordBatch], values: dict[str, str], schema: pa.Schema):
        self._batches, self._values, self._schema = batches, values, schema
        self.rows = 0

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        data = pa.schema(list(self._schema)[:len(self._schema) - len(self._values)])
        for b in self._batches:
            n = b.num_rows
            cols = [*b.cast(data).columns, *(pa.array([v] * n, pa.string()) for v in self._values.values())]
            self.rows += n
            yield pa.RecordBatch.from_arrays(cols, schema=self._schema)


def _kind(t: pa.DataType) -> str:
    """A type as the table formats tell types apart: string kinds are one, nested types by their parts; an
    integer or float column may widen (int to long, float to double), which the formats' own rules decide."""
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"list<{_kind(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{f.name}:{_kind(f.type)}" for f in t) + ">"
    return str(t)


def _where(values: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
