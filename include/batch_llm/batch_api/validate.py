"""A batch's input file checked as a whole before it runs (the batch's ``validating``), streamed line by line.

What fails the whole batch, as OpenAI fails it (``errors`` of the Batch object, each with its line):

- the file is gone (deleted) or changed while it was read: ``file_not_found`` / ``file_changed``
- more bytes than ``openai_batch.max_file_bytes``: ``file_too_large``
- more request lines than ``openai_batch.max_requests_per_file``: ``too_many_requests``
- a line whose ``body.model`` is not the batch's model (one model per file): ``mismatched_model``
- no line is a JSON object (the file is not JSONL, or empty): ``invalid_json_line`` / ``empty_file``

Every other problem of a line (invalid JSON among valid lines, a duplicate ``custom_id``, another ``url`` than the
batch's endpoint, a body field refused) is that line's error in the batch's error file: the planner reads the
lines (``rows/prompt.py``) and the rest of the batch goes on.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batch_llm.config.openai_batch import OpenAIBatchConfig

#: Errors listed in the Batch object at most (OpenAI lists each failing line; a file of 50,000 bad lines would
#: make a Batch object of megabytes). The count says how many there were.
MAX_LISTED_ERRORS = 100


@dataclass
class Validation:
    lines: int = 0                # non-empty lines: the batch's request_counts.total
    json_objects: int = 0
    bytes_read: int = 0
    errors: list[dict] = field(default_factory=list)
    error_count: int = 0
    checked_at: int = 0

    def fail(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "bytes_read": self.bytes_read, "errors": self.errors,
                "error_count": self.error_count, "checked_at": self.checked_at}


def _request_model(line: bytes | None) -> tuple[bool, Any]:
    """Whether a request line is a JSON object, and its ``body.model`` (None where it has none). Read leniently,
    not as ``rows.openai_batch.RequestLine``: a line the planner refuses is that line's error, yet its model still
    decides the batch's (``mismatched_model``)."""
    try:
        rec = json.loads(line) if line is not None else None
    except (ValueError, UnicodeDecodeError):
        return False, None
    if not isinstance(rec, dict):
        return False, None
    body = rec.get("body")
    return True, body.get("model") if isinstance(body, dict) else None


def line_model(line: bytes) -> str | None:
    """``body.model`` of one request line; None where the line is not such an object."""
    model = _request_model(line)[1]
    return model if isinstance(model, str) else None


def first_line(f, max_line_bytes: int) -> bytes | None:
    """The first non-empty line of an open input file (what POST /v1/batches routes by); None where there is none
    or it is longer than ``max_line_bytes`` (not held)."""
    while line := f.readline(max_line_bytes + 1):
        if line.strip():
            return line if len(line) <= max_line_bytes else None
    return None


def _lines(f, max_line_bytes: int, v: Validation) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of each non-empty line (None for one past ``max_line_bytes``, skipped unheld),
    counting lines and bytes into ``v``."""
    n = 0
    while line := f.readline(max_line_bytes + 1):
        v.bytes_read += len(line)
        n += 1
        if not line.strip():
            continue
        v.lines += 1
        if len(line) > max_line_bytes:
            while line and not line.endswith(b"\n"):  # the rest of the long line, not held
                line = f.readline(max_line_bytes + 1)
                v.bytes_read += len(line)
            yield n, None
            continue
        yield n, line


def _whole_file(v: Validation, expected_bytes: int | None, section: OpenAIBatchConfig) -> None:
    if expected_bytes is not None and v.bytes_read != expected_bytes:
        v.fail("file_changed", f"The input file changed while the batch read it ({v.bytes_read} bytes read, "
                               f"{expected_bytes} uploaded): it was deleted or replaced.", param="input_file_id")
    if v.bytes_read > section.max_file_bytes:
        v.fail("file_too_large", f"The input file has {v.bytes_read} bytes, more than the {section.max_file_bytes} "
                                 "a batch of this model may read.", param="input_file_id")
    if v.lines > section.max_requests_per_file:
        v.fail("too_many_requests", f"The input file has {v.lines} requests, more than the "
                                    f"{section.max_requests_per_file} a batch of this model may have.",
               param="input_file_id")
    if v.lines == 0:
        v.fail("empty_file", "The input file has no requests.", param="input_file_id")
    elif v.json_objects == 0:
        v.fail("invalid_json_line", "The input file is not JSONL: no line is a JSON object.", line=1,
               param="input_file_id")


def check_input(open_file, *, expected_bytes: int | None, model: str, section: OpenAIBatchConfig,
                max_line_bytes: int) -> Validation:
    """Streams the file ``open_file()`` opens (FileNotFoundError: gone) and checks it as the module says."""
    v = Validation()
    try:
        f = open_file()
    except FileNotFoundError:
        v.fail("file_not_found", "The input file was deleted before the batch read it.", param="input_file_id")
        v.checked_at = int(time.time())
        return v
    with f:
        for n, line in _lines(f, max_line_bytes, v):
            is_object, got = _request_model(line)
            if not is_object:
                continue
            v.json_objects += 1
            if got is not None and got != model:
                v.fail("mismatched_model", f"The model {str(got)[:200]!r} of this line is not the batch's model "
                                           f"{model!r}: a batch's lines all name one model.", line=n,
                       param="body.model")
    _whole_file(v, expected_bytes, section)
    v.checked_at = int(time.time())
    return v
