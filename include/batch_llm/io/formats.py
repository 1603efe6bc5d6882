"""Row readers and writers, per format, in one place; and the rule that turns a row into a chat.

Readers never raise on a bad row, in any format: they yield ``RawRow`` objects carrying either the parsed
record or the reason it could not be parsed (bad bytes, a malformed line, a value Python cannot hold, text
UTF-8 cannot hold, a line longer than ``input.max_line_bytes``, skipped without being held), so the planner can
report it and go on. A UTF-8 byte order mark opening a text file is no data. A file none of whose rows can be read
(a corrupt Parquet file, a table without a prompt column) and a local input that is not a regular file (a FIFO, a
device, a socket) raise ``InputFileError`` naming the file.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import stat
import string
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from upath import UPath

from batch_llm.config import InputConfig
from batch_llm.config.model import MAX_LINE_BYTES, token_ids_problem
from batch_llm.io.storage import (
    atomic_writer,
    is_local,
    iter_jsonl,
    json_bytes,
    list_files,
    utf8_safe,
    write_jsonl,
)
from batch_llm.output_schema import OutputSchema, column_value
from batch_llm.rows.params import RowParams

ROLES = ("system", "user", "assistant", "tool", "developer")
SUFFIX_FORMAT = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}

# The largest CSV cell read, in characters (csv's default is 128 KiB): far past any context window, and
# bounded, so a runaway quote that swallows the rest of a file cannot take the memory with it.
CSV_FIELD_LIMIT = 16 << 20


class InputFileError(ValueError):
    """An input file none of whose rows can be read or be valid: corrupt, or lacking the columns a row needs."""


@dataclass
class RawRow:
    line: int                     # 1-based position in the input (line or record number)
    record: dict | None           # None when the row could not be parsed
    error: str | None = None
    source: str = ""
    salvaged: dict | None = None  # a row that could not be used: its top-level ids and strings that read cleanly,
                                  # so that its error names it (an OpenAI Batch line's custom_id)


@dataclass
class PromptRow:
    """A validated row: its id, its place in the input, the chat to send, and the reference if any."""

    id: str
    idx: int
    messages: list[dict]
    reference: str | None = None
    prompt_token_ids: list[int] | None = None   # a pre-tokenized prompt, sent to the engine as is
    params: RowParams | None = None             # the row's own sampling parameters (rows/params.py)
    text: str | None = None                     # a completion prompt (``/v1/completions``): no chat template
    images: list[dict] | None = None            # the checked images of its image parts, in order (io/images.py)


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


def read_rows(path: UPath, fmt: str) -> Iterator[RawRow]:
    """Every row of a file or of a folder's data files (in name order), streamed; ``source`` names the file."""
    for f in input_files(path):
        yield from read_file_rows(f, fmt)


def read_file_rows(f: UPath, fmt: str, cfg: InputConfig | None = None) -> Iterator[RawRow]:
    """The rows of one file, streamed. With ``cfg``, a table (CSV, Parquet) whose columns cannot make one valid
    row is refused before its first row: ``InputFileError`` names the file and the columns it has."""
    kind = detect_format(f, fmt) if fmt == "auto" else fmt
    if kind == "csv":
        rows = _read_csv(f, cfg)
    elif kind == "parquet":
        rows = _read_parquet(f, cfg)
    else:
        rows = _read_jsonl(f, cfg.max_line_bytes if cfg is not None else MAX_LINE_BYTES)
    for raw in rows:
        raw.source = f.name
        yield raw


def sniff_openai_batch(path: UPath, max_line_bytes: int = MAX_LINE_BYTES) -> str | None:
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
                obj = _json_value(text)
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


def _json_value(text: str) -> Any:
    """``json.loads`` of a row's text; nesting deeper than Python's recursion limit is a ValueError (the row's
    fault, like malformed JSON), not a RecursionError that would stop the file."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {sys.getrecursionlimit()} levels") from None


def _salvaged(text: str) -> dict | None:
    """What of a line that is not UTF-8 still reads (its bytes kept as lone surrogates, which ``_clean_scalars``
    leaves out): its clean top-level values, None where it is not a JSON object even so."""
    try:
        obj = _json_value(text)
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


def _read_parquet(path: UPath, cfg: InputConfig | None) -> Iterator[RawRow]:
    """Record batches, one at a time; ``line`` is the 1-based row number in the file."""
    import pyarrow.parquet as pq

    with path.open("rb") as fh:
        try:
            pf = pq.ParquetFile(fh)
        except _parquet_faults() as e:
            raise InputFileError(f"{path}: not a readable Parquet file ({e})") from e
        if cfg is not None:
            _require_columns(path, pf.schema_arrow.names, cfg)
        n = 0
        # image bytes in a column (input.image_columns): small batches, so a batch holds a few images, not thousands
        size = PARQUET_IMAGE_BATCH_ROWS if cfg is not None and cfg.image_columns else PARQUET_BATCH_ROWS
        for batch in _parquet_batches(pf, path, size):
            yield from _batch_rows(batch, n)
            n += batch.num_rows


def _parquet_faults() -> tuple[type[Exception], ...]:
    import pyarrow as pa

    return pa.ArrowException, OSError  # OSError: a page that does not decompress (ArrowIOError is one)


PARQUET_BATCH_ROWS = 4096
PARQUET_IMAGE_BATCH_ROWS = 32


def _parquet_batches(pf, path: UPath, batch_size: int = PARQUET_BATCH_ROWS) -> Iterator:
    """The file's record batches; a damaged page past the footer stops the file with the row it stopped at
    (what follows cannot be counted, so the file fails as a whole rather than dropping rows unseen)."""
    batches = pf.iter_batches(batch_size=batch_size)
    done = 0
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


def _read_csv(path: UPath, cfg: InputConfig | None) -> Iterator[RawRow]:
    """Records with ``line``, the file's line (1: the header) where each starts. Bytes are decoded line by
    line, leniently, so a line that is not UTF-8 fails its record alone."""
    csv.field_size_limit(CSV_FIELD_LIMIT)
    with path.open("rb") as fh:
        # utf-8-sig: a byte order mark (Excel's "CSV UTF-8") is not part of the first column's name.
        text = io.TextIOWrapper(fh, encoding="utf-8-sig", errors="surrogateescape", newline="")
        lines = _CountedLines(text, cfg.max_line_bytes if cfg is not None else MAX_LINE_BYTES)
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


def _require_columns(path: UPath, columns: list[str], cfg: InputConfig) -> None:
    """Refuses a table none of whose rows could be valid: one error naming the file and its columns, rather
    than the same row error once per row."""
    have = set(columns)
    lacks = []
    if cfg.id_column not in have:
        lacks.append(f"the id column {cfg.id_column!r}")
    if "prompt_token_ids" in have:  # pre-tokenized rows need no text columns
        pass
    elif cfg.template:
        needed = sorted(_template_columns(cfg.template) - have)
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


def _template_columns(template: str) -> set[str]:
    """The columns a template reads: ``{lang}``, ``{meta.lang}`` and ``{langs[0]}`` all read ``lang(s)``."""
    names = (re.split(r"[.\[]", field)[0] for _, field, _, _ in string.Formatter().parse(template) if field)
    return {n for n in names if n and not n.isdigit()}


def _render_template(template: str, record: dict) -> str:
    try:
        return template.format_map(record)
    except KeyError as e:
        raise ValueError(f"template needs column {e.args[0]!r}, which this row lacks") from None


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, list):
            content = _content_parts(content, f"messages[{i}].content")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts, got "
                             f"{type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(_has_prompt(m["content"]) for m in out if m["role"] == "user"):
        raise ValueError("empty prompt: no user message has text")
    return out


def _has_prompt(content: str | list) -> bool:
    """A user message that asks something: text, or an image (a caption row may carry no text)."""
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == IMAGE_URL or p["text"].strip() for p in content)


IMAGE_URL = "image_url"   # an OpenAI chat content part naming an image (checked by the planner: io/images.py)
IMAGE_BYTES = "image_bytes"  # a table cell's image bytes (input.image_columns), carried until the planner checks them


def _content_parts(parts: list, where: str) -> str | list[dict]:
    """OpenAI chat content parts: ``text`` and ``image_url`` (its ``url`` a data: URL, a storage URL or a path).
    Text parts alone are one string (joined by newlines, as vLLM joins them); with images, the parts in order:
    ``{"type": "text", "text": ...}`` and ``{"type": "image_url", "image_url": {"url": ...}}``."""
    if not parts:
        raise ValueError(f"{where} is an empty list of content parts")
    out: list[dict] = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == IMAGE_URL:
            image = part.get(IMAGE_URL)
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url.strip():
                raise ValueError(f"{where}[{k}]: an image_url part needs image_url.url, a data: URL, a storage URL "
                                 "or a path")
            out.append({"type": IMAGE_URL, IMAGE_URL: {"url": url}})
        elif kind == "text":
            raise ValueError(f"{where}[{k}]: a text part needs a string 'text'")
        else:
            shown = repr(kind) if kind is not None else f"a {type(part).__name__}"
            raise ValueError(f"{where}[{k}]: content part {shown} is not read (text and image_url parts are)")
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out)
    return out


def _with_column_images(messages: list[dict], rec: dict, cfg: InputConfig) -> list[dict]:
    """``input.image_columns``: the row's images (a path or URL, a list of them, bytes, or a ``{bytes, path}``
    struct as Hugging Face datasets store images in Parquet) put before the text of its last user message; a null
    or empty cell adds none."""
    parts: list[dict] = []
    for col in cfg.image_columns:
        value = rec.get(col)
        if isinstance(value, str) and value.strip().startswith("["):  # a CSV cell holding a JSON list
            try:
                value = _json_value(value)
            except json.JSONDecodeError:
                raise ValueError(f"column {col!r} starts like a JSON list but is not one") from None
        for item in value if isinstance(value, list) else [value]:
            if item is None or item == "":
                continue
            if isinstance(item, dict) and isinstance(item.get("bytes"), (bytes, bytearray)):
                parts.append({"type": IMAGE_BYTES, "bytes": bytes(item["bytes"]), "name": str(item.get("path") or "")})
            elif isinstance(item, dict) and isinstance(item.get("path"), str):
                parts.append({"type": IMAGE_URL, IMAGE_URL: {"url": item["path"]}})
            elif isinstance(item, (bytes, bytearray)):
                parts.append({"type": IMAGE_BYTES, "bytes": bytes(item), "name": ""})
            elif isinstance(item, str):
                parts.append({"type": IMAGE_URL, IMAGE_URL: {"url": item}})
            else:
                raise ValueError(f"column {col!r}: an image is a path or URL, bytes, or a {{bytes, path}} struct, "
                                 f"got {type(item).__name__}")
    if not parts:
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("the row's images (input.image_columns) need a user message to go in")
    i = users[-1]
    content = messages[i]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return [*messages[:i], {**messages[i], "content": [*parts, *text]}, *messages[i + 1:]]


OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


def to_prompt_row(raw: RawRow, idx: int, cfg: InputConfig, fmt: str) -> PromptRow:
    """Validates one parsed record; raises ValueError with the reason when it is not usable."""
    if fmt == "openai_batch":
        return _openai_row(raw.record or {}, idx, cfg)
    rec = raw.record or {}
    rid = _row_id(rec, cfg.id_column)
    params = RowParams.from_columns(_typed_cells(rec, cfg.sampling_columns), cfg.sampling_columns)
    tokens = rec.get("prompt_token_ids")
    if tokens is not None:
        with_images = [c for c in cfg.image_columns if rec.get(c) not in (None, "", [])]
        if with_images:
            raise ValueError(f"a pre-tokenized row (prompt_token_ids) takes no images, and this one has "
                             f"{', '.join(with_images)}")
        return PromptRow(id=rid, idx=idx, messages=[], prompt_token_ids=_check_token_ids(tokens), params=params)
    messages, prompt = rec.get(cfg.messages_column), rec.get(cfg.prompt_column)
    if fmt == "csv" and messages == "":  # an empty cell is CSV's null: the row's prompt may be in the other column
        messages = None
    if cfg.template:
        text = _render_template(cfg.template, rec)
        if not text.strip():
            raise ValueError("empty prompt after rendering the template")
        messages = [{"role": "user", "content": text}]
    elif messages is not None:
        if isinstance(messages, str) and fmt in ("csv", "parquet"):  # columns holding JSON text
            try:
                messages = _json_value(messages)
            except json.JSONDecodeError:
                raise ValueError(f"column {cfg.messages_column!r} is text but not JSON") from None
        messages = _check_messages(messages)
    elif prompt is not None:
        messages = [{"role": "user", "content": _check_prompt(prompt)}]
    else:
        raise ValueError(_no_prompt_reason(rec, cfg))
    if cfg.image_columns:
        messages = _with_column_images(messages, rec, cfg)
    ref = rec.get(cfg.reference_column)
    return PromptRow(id=rid, idx=idx, messages=_with_system(messages, cfg), params=params,
                     reference=ref if isinstance(ref, str) and ref.strip() else None)


def _no_prompt_reason(rec: dict, cfg: InputConfig) -> str:
    """Why a row has no prompt: its prompt columns are null (a table's row has them), or absent (a JSON line)."""
    nulls = [repr(c) for c in (cfg.messages_column, cfg.prompt_column) if c in rec]
    if nulls:
        return f"no prompt: {' and '.join(nulls)} {'is' if len(nulls) == 1 else 'are'} null"
    return f"no prompt: the row has neither {cfg.messages_column!r} nor {cfg.prompt_column!r}"


def _openai_row(rec: dict, idx: int, cfg: InputConfig) -> PromptRow:
    """One OpenAI Batch request line: a chat body (``messages``) or a completions body (``prompt``)."""
    rid = _row_id(rec, "custom_id")
    body, url = rec.get("body"), rec.get("url", "/v1/chat/completions")
    if not isinstance(body, dict):
        raise ValueError("OpenAI batch line without a 'body' object")
    if url not in OPENAI_URLS:
        raise ValueError(f"url {url!r} is not supported (only {', '.join(OPENAI_URLS)})")
    if rec.get("method", "POST") != "POST":
        raise ValueError(f"method {rec['method']!r}: batch requests are POST")
    params = RowParams.from_openai_body(body, completions=url == "/v1/completions")
    if url == "/v1/chat/completions":
        return PromptRow(id=rid, idx=idx, messages=_with_system(_check_messages(body.get("messages")), cfg),
                         params=params)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list; several would be several completions
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptRow(id=rid, idx=idx, messages=[], prompt_token_ids=_check_token_ids(prompt), params=params)
    if not isinstance(prompt, str):
        raise ValueError("a /v1/completions body needs 'prompt': one string or one list of token ids")
    return PromptRow(id=rid, idx=idx, messages=[], text=_check_prompt(prompt), params=params)


def _row_id(rec: dict, column: str) -> str:
    rid = rec.get(column)
    if rid is None or (isinstance(rid, str) and not rid.strip()):
        raise ValueError(f"missing id (column {column!r})")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ValueError(f"id must be a string or an integer, got {type(rid).__name__}")
    return str(rid)


def _check_token_ids(tokens: Any) -> list[int]:
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) and t >= 0 for t in tokens)):
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    if problem := token_ids_problem(tokens, "prompt_token_ids", most=None):  # its length: the context's to say
        raise ValueError(problem)
    return tokens


def _check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("empty prompt")
    return prompt


def _with_system(messages: list[dict], cfg: InputConfig) -> list[dict]:
    if cfg.system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": cfg.system_prompt}, *messages]
    return messages


def _typed_cells(rec: dict, columns: Sequence[str]) -> dict:
    """The parameter cells of a row; CSV cells are text, so numbers are read from it (a stop cell may hold a
    JSON list; stop_token_ids a JSON list, chat_template_kwargs a JSON object, include_stop_str_in_output
    true or false; thinking and reasoning_effort words)."""
    out = {}
    for c in columns:
        v = rec.get(c)
        if isinstance(v, str) and v.strip():
            text = v.strip()
            if c == "stop":
                v = _json_value(text) if text.startswith("[") else v
            elif c in ("stop_token_ids", "chat_template_kwargs"):
                try:
                    v = json.loads(text)
                except (ValueError, RecursionError):
                    raise ValueError(f"{c} must be JSON ({'a list' if c == 'stop_token_ids' else 'an object'}), "
                                     f"got {v!r}") from None
            elif c == "include_stop_str_in_output":
                v = {"true": True, "false": False}.get(text.lower(), v)  # anything else: refused as it is
            elif c in ("thinking", "reasoning_effort"):  # words (on / off / auto, low / high ...): checked as they are
                v = text
            else:
                try:
                    v = int(text) if text.lstrip("-").isdigit() else float(text)
                except ValueError:
                    raise ValueError(f"{c} must be a number, got {v!r}") from None
        out[c] = v
    return out


# ---------------------------------------------------------------------------------------------- writing
def joined_outputs(records: Iterator[dict], outputs: Iterator[dict]) -> Iterator[tuple[dict, dict]]:
    """(input record, output row) pairs by position: both streams are in input order (``idx`` ascending);
    a record without an output (an error, a dropped row) is skipped."""
    out = next(outputs, None)
    for rec in records:
        while out is not None and out["idx"] < rec["idx"]:
            out = next(outputs, None)
        if out is None:
            return
        if out["idx"] == rec["idx"]:
            yield rec, out


def output_record(record: dict, result: dict, fmt: str, *, model: str = "", schema: OutputSchema | None = None,
                  run_id: str = "") -> dict:
    """The published row: the input's columns plus the generated ones (OpenAI Batch output lines, as OpenAI
    documents them, for OpenAI Batch input; ``model`` names the model that served them, ``run_id`` the run whose
    line ids they are: ``openai_line_ids``)."""
    if fmt == "openai_batch":
        where = f"row {result['idx']}"
        if result.get("error"):
            return openai_error_line(record.get("custom_id"), result["error"], code="row_error", run_id=run_id,
                                     where=where)
        line_id, request_id = openai_line_ids(run_id, where)
        usage = {"prompt_tokens": result.get("prompt_tokens", 0),
                 "completion_tokens": result.get("completion_tokens", 0),
                 "total_tokens": result.get("prompt_tokens", 0) + result.get("completion_tokens", 0),
                 "prompt_tokens_details": {"cached_tokens": result.get("cached_prompt_tokens", 0)}}
        if "reasoning_tokens" in result:  # a reasoning parser parted the thinking: its share, as OpenAI counts it
            usage["completion_tokens_details"] = {"reasoning_tokens": result["reasoning_tokens"]}
        completions = record.get("url") == "/v1/completions"
        if completions:
            body = {"id": f"cmpl-{result['id']}", "object": "text_completion", "created": int(time.time()),
                    "model": model, "choices": [{"index": i, "text": text, "logprobs": _completion_logprobs(lp),
                                                 "finish_reason": reason, "stop_reason": stop}
                                                for i, (text, reason, lp, stop) in enumerate(_choices(result))],
                    "usage": usage}
        else:
            body = {"id": f"chatcmpl-{result['id']}", "object": "chat.completion", "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": i, "finish_reason": reason, "stop_reason": stop,
                                 "logprobs": _chat_logprobs(lp),
                                 "message": {"role": "assistant", "content": text, **thinking}}
                                for i, ((text, reason, lp, stop), thinking) in enumerate(zip(_choices(result),
                                                                                       _reasoning_of(result)))],
                    "usage": usage}
        return {"id": line_id, "custom_id": record.get("custom_id"),
                "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
    out = dict(record)
    for k in _GENERATED:
        if k in result:
            out[k] = result[k]
        elif k in _SAMPLE_COLUMNS and k in record:  # an input column of that name (the n/logprobs cell): one type
            out[k] = None
    if schema is not None and isinstance(result.get("output"), str):
        _add_structured(out, record, result["output"], fmt, schema)
    if "scores" in out:
        _add_class_scores(out, record, out.pop("scores"))
    return out


def _add_class_scores(out: dict, record: dict, scores: dict) -> None:
    """engine.task classify: one ``score_<class>`` column per class beside ``label`` (the top class), in every
    format (named ``output_<name>`` where the input has a column of that name, e.g. a gold ``label``)."""
    if "label" in out and (column := class_label_column(record)) != "label":
        out[column], out["label"] = out["label"], record["label"]  # the input's own column (a gold label) stays
    for name, p in scores.items():
        out[structured_column(class_score_column(name), record)] = p


def class_label_column(record: dict) -> str:
    """Where a classify row's top class is published: ``label``, or ``output_label`` beside an input ``label``."""
    return "output_label" if "label" in record else "label"


def class_score_column(label: str) -> str:
    return f"score_{label}"


def _choices(result: dict) -> list[tuple[str, str | None, list | None, str | int | None]]:
    """(text, finish reason, token logprobs, stop reason) of every sample of a result row: ``outputs`` where it
    has several (n > 1), else ``output`` alone. The stop reason is vLLM's: the stop string or stop token id that
    ended the sample, None where EOS or the length did (and where the engine does not say)."""
    if result.get("outputs"):
        n = len(result["outputs"])
        lps = result.get("outputs_logprobs") or [None] * n
        return list(zip(result["outputs"], result.get("finish_reasons") or [result.get("finish_reason")] * n, lps,
                        result.get("stop_reasons") or [result.get("stop_reason")] + [None] * (n - 1)))
    return [(result.get("output", ""), result.get("finish_reason"), result.get("logprobs"), result.get("stop_reason"))]


def _reasoning_of(result: dict) -> list[dict]:
    """Each sample's thinking as its chat message's ``reasoning_content`` (vLLM's server's field), where a
    reasoning parser parted it from the answer; nothing where none did."""
    if "reasoning" not in result:
        return [{}] * max(1, len(result.get("outputs") or ()))
    every = result.get("outputs_reasoning") or [result["reasoning"]]
    return [{"reasoning_content": r} for r in every]


def _chat_logprobs(tokens: list | None) -> dict | None:
    """A chat choice's ``logprobs`` as OpenAI writes it: ``content``, one entry per token with its UTF-8 bytes
    and its ``top_logprobs``."""
    if tokens is None:
        return None

    def entry(t: dict) -> dict:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode("utf-8"))}

    return {"content": [{**entry(t), "top_logprobs": [entry(c) for c in t["top"]]} for t in tokens],
            "refusal": None}


def _completion_logprobs(tokens: list | None) -> dict | None:
    """A completions choice's ``logprobs`` in OpenAI's legacy shape: parallel lists, offsets into the text."""
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{c["token"]: c["logprob"] for c in t["top"]} for t in tokens], "text_offset": offsets}


def _add_structured(out: dict, record: dict, text: str, fmt: str, schema: OutputSchema) -> None:
    """A schema-checked output as data: the object itself in JSONL, one typed column per top-level property
    in Parquet and CSV (named ``output_<name>`` where the input has a column of that name)."""
    try:
        value = json.loads(text)  # checked when generated; the content filter's masks keep it JSON
    except json.JSONDecodeError:
        return
    if fmt == "jsonl":
        out["output"] = value
        return
    for f in schema.arrow_fields():
        name = structured_column(f.name, record)
        out[name] = column_value(value.get(f.name) if isinstance(value, dict) else None, f.type)


def structured_column(name: str, record: dict) -> str:
    return f"output_{name}" if name in record or name in _GENERATED else name


_GENERATED = ("output", "finish_reason", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "filter_hits",
              "error", "outputs", "finish_reasons", "logprobs", "outputs_logprobs", "embedding", "label", "scores",
              "review_verdict", "review_categories", "review_error",
              "reasoning", "reasoning_tokens", "thinking_ended", "max_thinking_tokens", "outputs_reasoning")

_SAMPLE_COLUMNS = ("outputs", "finish_reasons", "logprobs", "outputs_logprobs")  # infer.results.SAMPLE_FIELDS


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


def openai_line_ids(run_id: str, where: str) -> tuple[str, str]:
    """(id, request_id) of one OpenAI Batch output or error line: unique per request as OpenAI's are (a custom_id
    is the caller's, not unique across runs or files), derived from the run and the request's place in its input
    (``where``: ``row <idx>``, or ``<file> line <n>`` for a line the planner refused), so a publish retried or
    resumed in the same run writes the same ids, and another run other ones."""
    digest = hashlib.sha256(f"{run_id}\0{where}".encode()).hexdigest()
    return f"batch_req_{digest[:24]}", f"req_{digest[24:48]}"


def openai_error_line(custom_id: str | int | None, message: str, *, code: str, run_id: str, where: str) -> dict:
    """A failed request as a line of an OpenAI Batch error file: the HTTP-style error body OpenAI returns for
    a request it refused (status 400), with the pipeline's reason as the message; ids as ``openai_line_ids``."""
    line_id, request_id = openai_line_ids(run_id, where)
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": request_id,
                         "body": {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                            "code": code}}},
            "error": None}


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
