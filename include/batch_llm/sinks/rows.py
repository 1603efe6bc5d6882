"""Published rows (dicts) as the Arrow batches a table sink writes, in bounded memory.

A table's write needs the rows' schema before its first batch, and a commit that lost to a concurrent writer
writes them again: the rows are spooled once to a local JSONL file while their schema is inferred (the same
typing as the Parquet files: inferred, widened across batches, the output schema's and the sample columns'
types set), then read back from the spool batch by batch as often as the sink asks. Memory holds one batch.

Types no table format stores are mapped to ones they do: unsigned integers become signed 64-bit ones, a
fixed-size list (an embedding) a list, a nested value that is null everywhere a string. A column null in every
row is left null-typed: the sink types it as the table already has it (``TableSink._fitted``).
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from batch_llm.io.formats import _ArrowSchema  # the Parquet files' typing: a table's columns get the same types
from batch_llm.io.storage import iter_jsonl, json_bytes, utf8_safe
from batch_llm.sinks.base import RowBatches

if TYPE_CHECKING:
    import pyarrow as pa

BATCH_ROWS = 50_000  # rows per Arrow batch: one data file's worth for Iceberg, a bounded buffer for Delta


@contextmanager
def spooled_rows(rows: Iterable[dict], *, types: list | None = None, batch_rows: int = BATCH_ROWS,
                 spool_dir: str | None = None) -> Iterator[RowBatches]:
    """The rows as ``RowBatches`` (re-readable while the context is open); ``types``: pyarrow fields whose type
    is known (the output schema's columns), set over what the values suggest."""
    shape = _ArrowSchema(types)
    with tempfile.TemporaryDirectory(prefix="batch_llm_table_", dir=spool_dir) as tmp:
        spool = Path(tmp) / "rows.jsonl"
        with open(spool, "wb") as fh:
            for batch in _chunks(rows, batch_rows):
                try:
                    shape.add(batch)
                except UnicodeEncodeError:  # a lone surrogate: typed as the spool holds it (its escape text)
                    shape.add([utf8_safe(r) for r in batch])
                fh.writelines(json_bytes(r) + b"\n" for r in batch)
        schema = table_schema(shape.final())

        def batches() -> Iterator[pa.RecordBatch]:
            import pyarrow as pa

            for chunk in _chunks(iter_jsonl(spool), batch_rows):
                yield from pa.Table.from_pylist(chunk, schema=schema).combine_chunks().to_batches()

        yield RowBatches(schema=schema, batches=batches)


def table_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every type a table format cannot store mapped to one it can (module docstring)."""
    import pyarrow as pa

    # a top-level column null in every row stays null: the sink gives it the table's type for that column
    return pa.schema([pa.field(f.name, f.type if pa.types.is_null(f.type) else table_type(f.type), nullable=True)
                      for f in schema])


def table_type(t: pa.DataType) -> pa.DataType:
    import pyarrow as pa
    import pyarrow.types as pt

    if pt.is_null(t):
        return pa.string()
    if pt.is_unsigned_integer(t):
        return pa.int64()
    if pt.is_dictionary(t):
        return table_type(t.value_type)
    if pt.is_fixed_size_list(t) or pt.is_list(t) or pt.is_large_list(t):
        return pa.list_(pa.field("element", table_type(t.value_type)))
    if pt.is_struct(t):
        return pa.struct([pa.field(f.name, table_type(f.type)) for f in t])
    if pt.is_large_string(t):
        return pa.string()
    return t


def _chunks(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for r in rows:
        chunk.append(r)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
