"""The lines of OpenAI's Batch API, typed: a request line (the input), an output line and an error line (the
answers, as OpenAI's output and error files hold them, and as ``vllm run-batch`` writes them).

msgspec structs, not pydantic models: one is built for every row published. ``line_dict`` gives a line as the
writers write it, its keys in the order OpenAI's files have them."""
from __future__ import annotations

from typing import Any

import msgspec


class RequestLine(msgspec.Struct, frozen=True):
    """One request of an input file, its fields checked (rows/prompt.py's ``to_prompt_row`` refuses the rest)."""

    custom_id: str | int
    body: dict
    url: str = "/v1/chat/completions"
    method: str = "POST"


class OutputResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: dict  # a chat.completion or text_completion object


class OutputLine(msgspec.Struct):
    """An answered request: a line of the output file."""

    id: str
    custom_id: str | int | None
    response: OutputResponse
    error: None = None


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: None
    code: str


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ErrorResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: ErrorBody


class ErrorLine(msgspec.Struct):
    """A refused request: a line of the error file, the HTTP-style error body OpenAI returns (status 400)."""

    id: str
    custom_id: str | int | None
    response: ErrorResponse
    error: None = None


def line_dict(line: OutputLine | ErrorLine) -> dict[str, Any]:
    """A line as plain data, its fields in order (``error: null`` included, as OpenAI writes it)."""
    return msgspec.to_builtins(line)


def answer_line(data: dict) -> OutputLine | ErrorLine:
    """An answer line read back (a published output or error file): an error line where its status is not 200."""
    if data["response"]["status_code"] == 200:
        return msgspec.convert(data, OutputLine)
    return msgspec.convert(data, ErrorLine)
