"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status, as the
``openai`` client reads it (``BadRequestError``, ``NotFoundError``, ...)."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request refused as OpenAI refuses it: HTTP ``status`` and the error body's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002 - OpenAI's
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(kind: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No {kind} found with id '{ident}'.", param=param, code=None)
