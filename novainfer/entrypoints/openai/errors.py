"""Every failure as an OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``.

Handlers installed by :func:`install_exception_handlers` turn FastAPI's validation errors (422 by
default) into 400s naming the field, HTTP errors (404 route, 405 method, and the 408/413 of a body
refused while it is read, which carry their own OpenAIError) into the same shape, and
:class:`OpenAIError` raised anywhere in a handler into its status. Unexpected
exceptions are caught by the outermost middleware (see ``middleware.py``), never by these.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

REQUEST_ID_HEADER = "X-Request-Id"


class OpenAIError(Exception):
    """An error meant for the client: its message, HTTP status, and which request field caused it."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})


def request_id_of(request: Request | None) -> str | None:
    if request is None:
        return None
    return getattr(request.state, "request_id", None)


def error_body(err: OpenAIError, request_id: str | None) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code,
                      "request_id": request_id}}


def error_response(err: OpenAIError, request_id: str | None) -> JSONResponse:
    return JSONResponse(error_body(err, request_id), status_code=err.status, headers=err.headers)


# ---- validation errors ------------------------------------------------------------------------------
# pydantic puts the tag of the union member that failed into the location (``str``, ``list[int]``,
# ``function-after[...]``); they are noise in a field path.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|[A-Za-z_-]+\[.*\]|[A-Z]\w*|literal\[.*\])$")


def _field_path(loc: Sequence[Any]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _UNION_TAG.match(str(item)):
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first problem of a RequestValidationError, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    kind, loc, msg = first.get("type", ""), tuple(first.get("loc", ())), first.get("msg", "invalid value")
    where, field_loc = (loc[0], loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else (None, loc)
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", msg)
        return OpenAIError(f"request body is not valid JSON: {detail}", code="invalid_json")
    if where == "body" and not field_loc:
        if kind == "missing":
            return OpenAIError("request body is required (a JSON object)", code="missing_body")
        return OpenAIError("request body must be a JSON object sent with Content-Type: application/json",
                           code="invalid_body")
    if kind == "extra_forbidden":
        unknown = sorted({_field_path(e["loc"][1:] if where else e["loc"]) for e in errors
                          if e.get("type") == "extra_forbidden"})
        names = ", ".join(f"'{u}'" for u in unknown)
        return OpenAIError(f"unknown field(s) {names}: not part of this endpoint's request", param=unknown[0],
                           code="unknown_field")
    if kind == "value_error":  # our validators' own sentences, without pydantic's label
        msg = msg.removeprefix("Value error, ")
    path = _field_path(field_loc) or str(where or "request")
    top = next((str(item) for item in field_loc if not isinstance(item, int)), path)
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return OpenAIError(f"invalid value for '{path}': {msg}{more}", param=top, code="invalid_value")


_LEADING_NAME = re.compile(r"^'?([a-z_][a-z0-9_]*)'?\b")


def param_from_message(message: str, known: Sequence[str]) -> str | None:
    """The field a library error message starts with (``top_p must be in (0, 1]``), if it is a known one."""
    match = _LEADING_NAME.match(message)
    if match and match.group(1) in known:
        return match.group(1)
    return None


# ---- handlers -----------------------------------------------------------------------------------------
def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc, request_id_of(request))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request_id_of(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        carried = getattr(exc, "openai_error", None)  # raised below the app with its own error
        if isinstance(carried, OpenAIError):
            return error_response(carried, request_id_of(request))
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail) if exc.detail else f"HTTP {exc.status_code}"
        err = OpenAIError(message, exc.status_code, headers=exc.headers)
        return error_response(err, request_id_of(request))
