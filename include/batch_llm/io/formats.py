"""Row readers and writers, per format, in one place: bytes and files only (what a row means is rows/'s).

Readers never raise on a bad row, in any format: they yield ``RawRow`` objects carrying either the parsed
record or the reason it could not be parsed (bad bytes, a malformed line, a value Python cannot hold, text
UTF-8 cannot hold, a line longer than ``input.max_line_bytes``, skipped without being held), so the planner can
report it and go on. A UTF-8 byte order mark opening a text file is no data. A file none of whose rows can be read
(a corrupt Parquet file, a table without a prompt column) and a local input that is not a regular file (a FIFO, a
device, a socket) raise ``InputFileError`` naming the file. The readers take the input's column rules as an
argument (``ColumnRules``, which the pipeline's ``InputConfig`` satisfies), or its line limit alone (``Lines``).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
from upath import UPath

from batch_llm.io.storage import (
    atomic_writer,
    is_local,
    iter_jsonl,
    json_bytes,
    list_files,
    utf8_safe,
    write_jsonl,
)
from batch_llm.rows.prompt import RawRow, json_value, template_columns

SUFFIX_FORMAT = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}

# The largest CSV cell read, in characters (csv's default is 128 KiB): far past any context window, and
# bounded, so a runaway quote that swallows the rest of a file cannot take the memory with it.
CSV_FIELD_LIMIT = 16 << 20


class ColumnRules(Protocol):
    """The input's rules a reader follows (``InputConfig`` has them): the longest line it reads, and the columns a
    table's header is checked against before its first row."""

    @property
    def max_line_bytes(self) -> int: ...

    @property
    def id_column(self) -> str: ...
    @property
    def messages_column(self) -> str: ...
    @property
    def prompt_column(self) -> str: ...
    @property
    def template(self) -> str | None: ...
    @property
    def image_columns(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class Lines:
    """A line limit alone (``input.max_line_bytes``): a read that checks no columns (a table read as data)."""

    max_line_bytes: int


class InputFileError(ValueError):
    """An input file none of whose rows can be read or be valid: corrupt, or lacking the columns a row needs."""


def detect_format(path: UPath, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in SUFFIX_FORMAT:
        return SUFFIX_FORMAT[suffix]
    raise ValueError(f"cannot tell the format of {path} from its name; set input.format")


def input_files(path: UPath) -> list[UPath]:
    """One file, or every data file of a folder (a partition), in name order; a local one that is not a regular
    file is refused (``regular_file``)."""
    if path.is_dir():
        files = [p for p in list_files(path) if p.suffix.lower() in SUFFIX_FORMAT and not p.name.startswith("_")]
        if not files:
            raise FileNotFoundError(f"no input files (.jsonl, .parquet, .csv) under {path}")
    elif not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    else:
        files = [path]
    for f in files:
        regular_file(f)
    return files


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(f: UPath) -> None:
    """Refuses a local input that is not a regular file, before it is opened: reading a FIFO blocks until a writer
    comes, a device (/dev/zero) never ends. Objects in a store are always files."""
    if not is_local(f):
        return
    mode = os.stat(f.path).st_mode  # through symbolic links: what a read would open
    if not stat.S_ISREG(mode):
        kind = next((what for test, what in _NOT_REGULAR if test(mode)), "not a regular file")
        raise InputFileError(f"{f}: the input is {kind}, not a regular file; give a file or a folder of files")


def bounded_lines(fh: Any, max_bytes: int) -> Iterator[bytes | None]:
    """A binary file's lines, each with its newline; None for a line longer than ``max_bytes`` (its newline not
    counted), skipped in reads of at most ``max_bytes``: memory holds one line at most that long, whatever the file
    holds (a line of gigabytes, a file of zeros without a newline)."""
    if not isinstance(fh, io.BufferedIOBase):  # an object store's file (fsspec) reads lines whole
        fh = io.BufferedReader(fh, buffer_size=1 << 20)
    while line := fh.readline(max_bytes + 1):
        if line.endswith(b"\n") or len(line) <= max_bytes:
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = fh.readline(_SKIP_BYTES)
        yield None


_SKIP_BYTES = 1 << 20  # what an over-long line's rest is skipped in


def long_line(limit: int, unit: str = "bytes") -> str:
    """The error of a line past ``input.max_line_bytes``."""
    return f"longer than {limit} {unit} (input.max_line_bytes); skipped without being read"


def read_rows(path: UPath, fmt: str, rules: ColumnRules | Lines) -> Iterator[RawRow]:
    """Every row of a file or of a folder's data files (in name order), streamed; ``source`` names the file."""
    for f in input_files(path):
        yield from read_file_rows(f, fmt, rules)


def read_file_rows(f: UPath, fmt: str, rules: ColumnRules | Lines,
                   row_groups: tuple[int, int] | None = None) -> Iterator[RawRow]:
    """The rows of one file, streamed, no line past ``rules.max_line_bytes`` held. With column rules
    (``ColumnRules``), a table (CSV, Parquet) whose columns cannot make one valid row is refused before its first
    row: ``InputFileError`` names the file and the columns it has. ``row_groups``: a Parquet file's row groups
    [a, b) only (a part of a plan in parts)."""
    kind = detect_format(f, fmt) if fmt == "auto" else fmt
    columns = None if isinstance(rules, Lines) else rules
    if row_groups is not None and kind != "parquet":
        raise ValueError(f"{f}: row groups asked of a {kind} file")
    if kind == "csv":
        rows = _read_csv(f, rules.max_line_bytes, columns)
    elif kind == "parquet":
        rows = _read_parquet(f, columns, row_groups)
    else:
        rows = _read_jsonl(f, rules.max_line_bytes)
    for raw in rows:
        raw.source = f.name
        yield raw


def sniff_openai_batch(path: UPath, max_line_bytes: int) -> str | None:
    """A .jsonl file whose first object has custom_id and body is OpenAI Batch API input (a line past
    ``max_line_bytes`` is passed over: the scan reports it)."""
    with path.open("rb") as fh:
        for line in bounded_lines(fh, max_line_bytes):
            if line is not None and line.strip():
                try:
                    obj = json.loads(line.removeprefix(UTF8_BOM))
                except (ValueError, RecursionError):
                    return None
                return "openai_batch" if isinstance(obj, dict) and "custom_id" in obj and "body" in obj else None
    return None


_FAST_DECODER = msgspec.json.Decoder()

# A UTF-8 byte order mark: Windows editors (Notepad, Excel's "CSV UTF-8") begin a file with it; it is no data.
UTF8_BOM = b"\xef\xbb\xbf"


def _read_jsonl(path: UPath, max_line_bytes: int) -> Iterator[RawRow]:
    with path.open("rb") as fh:
        for n, raw in enumerate(bounded_lines(fh, max_line_bytes), start=1):
            if raw is None:
                yield RawRow(n, None, f"the line is {long_line(max_line_bytes)}")
                continue
            if n == 1:
                raw = raw.removeprefix(UTF8_BOM)
            if not raw.strip():
                continue
            try:  # the fast path; a line it refuses is parsed again by json, for json's own message
                obj = _FAST_DECODER.decode(raw)
            except (msgspec.DecodeError, ValueError, RecursionError):
                pass
            else:
                if isinstance(obj, dict):
                    yield RawRow(n, obj)
                    continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRow(n, None, f"not valid UTF-8 at byte {e.start}",
                             salvaged=_salvaged(raw.decode("utf-8", errors="surrogateescape")))
                continue
            try:
                obj = json_value(text)
            except json.JSONDecodeError as e:
                yield RawRow(n, None, f"not valid JSON: {e.msg} (column {e.colno})")
                continue
            except ValueError as e:
                yield RawRow(n, None, str(e))
                continue
            if not isinstance(obj, dict):
                yield RawRow(n, None, f"expected a JSON object, got {type(obj).__name__}")
                continue
            why = _unencodable(obj)
            yield RawRow(n, None, why, salvaged=_clean_scalars(obj)) if why else RawRow(n, obj)



def _salvaged(text: str) -> dict | None:
    """What of a line that is not UTF-8 still reads (its bytes kept as lone surrogates, which ``_clean_scalars``
    leaves out): its clean top-level values, None where it is not a JSON object even so."""
    try:
        obj = json_value(text)
    except ValueError:
        return None
    return _clean_scalars(obj) if isinstance(obj, dict) else None


def _clean_scalars(obj: dict) -> dict:
    """The top-level strings and integers of an unusable row that UTF-8 can hold: its id, for its error line."""
    out = {}
    for k, v in obj.items():
        if isinstance(v, (str, int)) and not isinstance(v, bool):
            try:
                msgspec.json.encode({k: v})
            except UnicodeEncodeError:
                continue
            out[k] = v
    return out


def _unencodable(obj: dict) -> str | None:
    """Why a parsed row cannot be written as UTF-8, if it cannot: JSON may escape a lone UTF-16 surrogate
    (``"\\ud800"``), which json parses into a string no UTF-8 file (nor tokenizer) can hold. Asked only of rows
    the fast decoder refused, which refuses those."""
    try:
        msgspec.json.encode(obj)  # strict, unlike json_bytes
    except UnicodeEncodeError as e:
        return (f"holds the escape \\u{ord(e.object[e.start]):04x}, a lone UTF-16 surrogate: no character, "
                f"so no UTF-8 text can hold it")
    return None


def _read_parquet(path: UPath, cfg: ColumnRules | None,
                  row_groups: tuple[int, int] | None = None) -> Iterator[RawRow]:
    """Record batches, one at a time; ``line`` is the 1-based row number in the file. ``row_groups``: only row
    groups [a, b) (a part of a plan in parts), numbered as in the whole file."""
    import pyarrow.parquet as pq

    with path.open("rb") as fh:
        try:
            pf = pq.ParquetFile(fh)
        except _parquet_faults() as e:
            raise InputFileError(f"{path}: not a readable Parquet file ({e})") from e
        if cfg is not None:
            _require_columns(path, pf.schema_arrow.names, cfg)
        n = sum(pf.metadata.row_group(i).num_rows for i in range(row_groups[0])) if row_groups else 0
        # image bytes in a column (input.image_columns): small batches, so a batch holds a few images, not thousands
        size = PARQUET_IMAGE_BATCH_ROWS if cfg is not None and cfg.image_columns else PARQUET_BATCH_ROWS
        for batch in _parquet_batches(pf, path, size, row_groups, first_row=n):
            yield from _batch_rows(batch, n)
            n += batch.num_rows


def _parquet_faults() -> tuple[type[Exception], ...]:
    import pyarrow as pa

    return pa.ArrowException, OSError  # OSError: a page that does not decompress (ArrowIOError is one)


PARQUET_BATCH_ROWS = 4096
PARQUET_IMAGE_BATCH_ROWS = 32


def _parquet_batches(pf, path: UPath, batch_size: int = PARQUET_BATCH_ROWS, row_groups: tuple[int, int] | None = None,
                     first_row: int = 0) -> Iterator:
    """The file's record batches (of row groups [a, b) only, given ``row_groups``, whose first row is the file's
    ``first_row``); a damaged page past the footer stops the file with the row it stopped at (what follows cannot
    be counted, so the file fails as a whole rather than dropping rows unseen)."""
    batches = pf.iter_batches(batch_size=batch_size,
                              row_groups=list(range(*row_groups)) if row_groups is not None else None)
    done = first_row
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except _parquet_faults() as e:
            raise InputFileError(f"{path}: Parquet data unreadable after row {done} ({e})") from e
        done += batch.num_rows
        yield batch


# What converting one Arrow value to Python raises when Python cannot hold it (a date past year 9999) or
# pyarrow cannot convert it (Arrow's errors subclass these).
_VALUE_FAULTS = (ArithmeticError, ValueError, TypeError, NotImplementedError)


def _batch_rows(batch, before: int) -> Iterator[RawRow]:
    """A batch's rows, converted at once; where one value cannot be converted, row by row, so only that row
    fails."""
    try:
        records = batch.to_pylist()
    except _VALUE_FAULTS:
        records = None
    if records is not None:
        for i, rec in enumerate(records, start=before + 1):
            yield RawRow(i, rec)
        return
    columns = list(zip(batch.schema.names, batch.columns))
    for i in range(batch.num_rows):
        rec, error = _converted_row(columns, i)
        yield RawRow(before + i + 1, rec, error)


def _converted_row(columns: list, i: int) -> tuple[dict | None, str | None]:
    rec = {}
    for name, col in columns:
        try:
            rec[name] = col[i].as_py()
        except _VALUE_FAULTS as e:
            return None, f"column {name!r}: {e}"
    return rec, None


def _read_csv(path: UPath, max_line_bytes: int, cfg: ColumnRules | None) -> Iterator[RawRow]:
    """Records with ``line``, the file's line (1: the header) where each starts. Bytes are decoded line by
    line, leniently, so a line that is not UTF-8 fails its record alone.

    Not pyarrow's CSV reader (``open_csv`` with an ``invalid_row_handler``), measured (``python -m bench csv-read``,
    1M rows: pyarrow doing the least a replacement must do 0.95-1.49 s against this reader's 2.13-2.9 s) and kept
    out for what it cannot tell a row's error: its handler numbers a bad row by records, not lines (wrong after a
    quoted line break or a blank line; none with ``use_threads``) and valid rows not at all, so the line would be
    rebuilt here by counting line breaks in every value; one byte that is not UTF-8 fails a string column's whole
    batch (binary columns decoded here instead); a record past ``block_size`` fails the rest of the file, where
    this reader makes an over-long line its row's error and goes on (``test_pyarrow_csv_handler_counts_records_not_lines``).
    """
    csv.field_size_limit(CSV_FIELD_LIMIT)
    with path.open("rb") as fh:
        # utf-8-sig: a byte order mark (Excel's "CSV UTF-8") is not part of the first column's name.
        text = io.TextIOWrapper(fh, encoding="utf-8-sig", errors="surrogateescape", newline="")
        lines = _CountedLines(text, max_line_bytes)
        reader = csv.reader(lines)
        header = _csv_header(reader, lines, path)
        if header is None:  # an empty file: no rows
            return
        if cfg is not None:
            _require_columns(path, header, cfg)
        yield from _csv_records(reader, lines, header)


# Where the lenient decoding put a byte that is not UTF-8 (surrogateescape maps it to U+DC80..U+DCFF).
_UNDECODED = re.compile("[\udc80-\udcff]")


class _LongLine(Exception):
    """A CSV line longer than ``input.max_line_bytes`` characters, skipped: raised through ``csv.reader``, which
    starts its next record afresh on the line after it."""

    def __init__(self, line: int, limit: int) -> None:
        super().__init__(f"line {line} is {long_line(limit, 'characters')}")


class _CountedLines:
    """A text file's lines for ``csv.reader``, counted, noting the first one since ``clear()`` that held bytes
    that are not UTF-8, as (line, byte offset in that line); a line longer than ``max_chars`` is skipped without
    being held (``_LongLine``)."""

    def __init__(self, text: io.TextIOWrapper, max_chars: int) -> None:
        self.text, self.max_chars = text, max_chars
        self.n = 0
        self.bad: tuple[int, int] | None = None

    def __iter__(self) -> _CountedLines:
        return self

    def __next__(self) -> str:
        line = self.text.readline(self.max_chars + 1)
        if not line:
            raise StopIteration
        self.n += 1
        if len(line) > self.max_chars and not line.endswith(("\n", "\r")):
            while line and not line.endswith(("\n", "\r")):
                line = self.text.readline(_SKIP_BYTES)
            raise _LongLine(self.n, self.max_chars)
        if self.bad is None and (m := _UNDECODED.search(line)):
            self.bad = (self.n, len(line[:m.start()].encode("utf-8")))
        return line

    def clear(self) -> None:
        self.bad = None


def _csv_header(reader, lines: _CountedLines, path: UPath) -> list[str] | None:
    """The first non-blank record; a header that cannot be read fails the file (no row could be named)."""
    try:
        header = next((fields for fields in reader if fields), None)
    except csv.Error as e:
        raise InputFileError(f"{path}: the header (line {lines.n}) is not valid CSV: {e}") from None
    except _LongLine as e:
        raise InputFileError(f"{path}: the header: {e}") from None
    if lines.bad:
        raise InputFileError(f"{path}: the header is not valid UTF-8 at byte {lines.bad[1]} (line {lines.bad[0]})")
    return header


def _csv_records(reader, lines: _CountedLines, header: list[str]) -> Iterator[RawRow]:
    while True:
        start = lines.n + 1
        lines.clear()
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # the reader starts afresh on the next line
            yield RawRow(start, None, f"not valid CSV: {e}")
            continue
        except _LongLine as e:  # so does it after this one
            yield RawRow(start, None, str(e))
            continue
        if fields:  # a blank line is no row
            yield _csv_row(start, fields, header, lines.bad)


def _csv_row(start: int, fields: list[str], header: list[str], bad: tuple[int, int] | None) -> RawRow:
    if bad is not None:
        line, byte = bad
        return RawRow(start, None, f"not valid UTF-8 at byte {byte}" + (f" of line {line}" if line != start else ""))
    if len(fields) > len(header):
        return RawRow(start, None, f"{len(fields) - len(header)} more field(s) than the header has")
    if len(fields) < len(header):
        return RawRow(start, None, f"{len(header) - len(fields)} field(s) fewer than the header has")
    return RawRow(start, dict(zip(header, fields)))


def _require_columns(path: UPath, columns: list[str], cfg: ColumnRules) -> None:
    """Refuses a table none of whose rows could be valid: one error naming the file and its columns, rather
    than the same row error once per row."""
    have = set(columns)
    lacks = []
    if cfg.id_column not in have:
        lacks.append(f"the id column {cfg.id_column!r}")
    if "prompt_token_ids" in have:  # pre-tokenized rows need no text columns
        pass
    elif cfg.template:
        needed = sorted(template_columns(cfg.template) - have)
        if needed:
            lacks.append(f"the template's column(s) {', '.join(map(repr, needed))}")
    elif not have & {cfg.messages_column, cfg.prompt_column}:
        lacks.append(f"a prompt column ({cfg.messages_column!r} or {cfg.prompt_column!r})")
    missing_images = [c for c in cfg.image_columns if c not in have]
    if missing_images:
        lacks.append(f"the image column(s) {', '.join(map(repr, missing_images))} (input.image_columns)")
    if lacks:
        raise InputFileError(f"{path}: no row can be valid: the file lacks {' and '.join(lacks)}; "
                             f"its columns: {', '.join(columns) or '(none)'}")


# ---------------------------------------------------------------------------------------------- writing
def _sample_types() -> dict:
    """The Parquet types of the sample columns (``infer.results.SAMPLE_FIELDS``), fixed rather than inferred: a batch
    whose rows have empty top lists or no finish reason would otherwise be typed by what it happens to hold."""
    import pyarrow as pa

    top = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
    token = pa.struct([("token", pa.string()), ("logprob", pa.float64()), ("top", pa.list_(top))])
    return {"outputs": pa.list_(pa.string()), "finish_reasons": pa.list_(pa.string()),
            "logprobs": pa.list_(token), "outputs_logprobs": pa.list_(pa.list_(token))}


def _review_types() -> dict:
    """The content review's columns (``filter.review``), fixed: a batch whose rows all have empty categories would
    otherwise type them as a list of nulls."""
    import pyarrow as pa

    return {"review_verdict": pa.string(), "review_categories": pa.list_(pa.string()), "review_error": pa.string()}

# Rows converted to Arrow at once: one Parquet row group each (and the unit of CSV writes).
WRITE_BATCH_ROWS = 50_000


def write_rows(path: UPath, rows: Iterable[dict], fmt: str, *, types: list | None = None) -> int:
    """Writes rows in ``fmt`` as one atomic object, streamed; returns the count.

    JSONL streams in one pass. CSV needs every column before its header and Parquet one schema before its
    first row group, so those formats spool the rows to a local JSONL file while collecting the columns (or
    the unified Arrow schema), then write from the spool batch by batch: memory holds one batch, not the run.
    """
    if fmt in ("jsonl", "openai_batch"):
        return write_jsonl(path, rows)
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"unknown output format {fmt!r}")
    with tempfile.TemporaryDirectory(prefix="batch_llm_write_") as tmp:
        spool = Path(tmp) / "rows.jsonl"
        shape = _CsvColumns() if fmt == "csv" else _ArrowSchema(types)
        n = 0
        with open(spool, "wb") as fh:
            for batch in _batches(rows, WRITE_BATCH_ROWS):
                try:
                    shape.add(batch)
                except UnicodeEncodeError:  # a lone surrogate: typed as the spool holds it (its escape text)
                    shape.add([utf8_safe(r) for r in batch])
                fh.writelines(json_bytes(r) + b"\n" for r in batch)
                n += len(batch)
        spooled = iter_jsonl(Path(spool))
        with atomic_writer(path) as w:  # no mkdir on S3: it would create a mistyped bucket
            shape.write(w, _batches(spooled, WRITE_BATCH_ROWS))
    return n


def _batches(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for r in rows:
        batch.append(r)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class _CsvColumns:
    """Every column any row has, in order of first appearance; lists and objects are written as JSON."""

    def __init__(self) -> None:
        self.cols: dict[str, None] = {}

    def add(self, batch: list[dict]) -> None:
        for r in batch:
            for k in r:
                if k not in self.cols:
                    self.cols[k] = None

    def write(self, w, batches: Iterator[list[dict]]) -> None:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(self.cols))
        writer.writeheader()
        for batch in batches:
            for r in batch:
                writer.writerow({k: (json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v)
                                 for k, v in r.items()})
            w.write(buf.getvalue().encode("utf-8"))
            buf.seek(0)
            buf.truncate()
        w.write(buf.getvalue().encode("utf-8"))


class _ArrowSchema:
    """The schema every batch fits: the batches' inferred schemas unified (int and float widen, nulls take
    the other side's type)."""

    def __init__(self, types: list | None = None) -> None:
        self.schema = None
        self.types = types or []  # pyarrow fields whose type is known (an output schema's), not inferred

    def add(self, batch: list[dict]) -> None:
        import pyarrow as pa

        # By column, not from_pylist(batch): that takes the columns of the first row only, and a column only
        # some rows have (filter_hits, outputs, logprobs) would be lost when the first row lacks it.
        cols = dict.fromkeys(k for r in batch for k in r)
        s = pa.Table.from_pydict({k: [r.get(k) for r in batch] for k in cols}).schema
        self.schema = s if self.schema is None else pa.unify_schemas([self.schema, s], promote_options="permissive")

    def final(self):
        """The schema of every batch added: inferred, then the sample columns' and the known types set."""
        import pyarrow as pa

        schema = self.schema or pa.schema([])
        for name, typ in {**_sample_types(), **_review_types()}.items():  # only where present: other runs' files keep theirs
            i = schema.get_field_index(name)
            if i >= 0:
                schema = schema.set(i, pa.field(name, typ))
        for f in self.types:
            i = schema.get_field_index(f.name)
            schema = schema.set(i, f) if i >= 0 else schema.append(f)
        return schema

    def write(self, w, batches: Iterator[list[dict]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self.final()
        with pq.ParquetWriter(_WriterSink(w), schema) as pw:
            for batch in batches:
                pw.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=len(batch))


class _WriterSink(io.RawIOBase):
    """A write-only file over an ``AtomicWriter`` (what pyarrow's ParquetWriter writes into)."""

    def __init__(self, w) -> None:
        self.w = w
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        self.w.write(data)
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos


FILE_SUFFIX = {"jsonl": ".jsonl", "openai_batch": ".jsonl", "parquet": ".parquet", "csv": ".csv"}
