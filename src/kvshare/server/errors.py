"""OpenAI-style errors: one exception type carrying status, message, type, param and code.

Invariant: every error message is one line of at most MAX_MESSAGE_CHARS characters (`APIError`
folds whitespace and cuts longer ones), so no error reply echoes a large input back — a parser
error quoting a 100,000-group regex, say.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from kvshare.server.replies import ErrorInfo, ErrorResponse

# status -> OpenAI error `type`
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


MAX_MESSAGE_CHARS = 200


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` on one line (runs of whitespace folded), cut to `limit` characters with "..."."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class APIError(Exception):
    """An error reply: `status` plus the fields of OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = one_line(message)
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param if param is None else one_line(param, 100)
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        """The JSON reply with this error's status."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event, for a stream whose 200 header is already sent."""
        return f"data: {json.dumps(self.body())}\n\n"


def from_validation_error(e: ValidationError) -> APIError:
    """A 400 naming the first invalid parameter (dotted path) and why."""
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    named = re.match(r"([A-Za-z_][\w.]*): ", msg)
    if not loc and named:  # a model-level check about one field (request_checks.FieldError)
        loc = named.group(1)
        msg = msg[named.end():]
    kind = first.get("type", "")
    code = "missing_parameter" if kind == "missing" else "invalid_value"
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None, code=code)


def internal_error(e: BaseException) -> APIError:
    """A 500 for an unexpected failure while serving one request."""
    return APIError(500, f"internal error: {type(e).__name__}: {one_line(str(e), 120)}", code="internal_error")
