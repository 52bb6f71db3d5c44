"""ASGI middleware: request ids, the catch-all for unexpected errors, and API-key auth.

They are plain ASGI (not ``BaseHTTPMiddleware``) so that streaming responses pass through
untouched and client disconnects still reach the endpoint.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from novainfer.entrypoints.openai.errors import REQUEST_ID_HEADER, OpenAIError, error_body

logger = logging.getLogger(__name__)

# A client-sent request id is echoed only if it is printable and short (it ends up in logs).
_VALID_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


async def _send_error(send: Send, err: OpenAIError, request_id: str | None) -> None:
    body = json.dumps(error_body(err, request_id)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Outermost layer: gives every request an id and turns any escaped exception into a 500.

    The id is the client's ``X-Request-Id`` when it sent a sane one, else a fresh one; it is put in
    ``request.state.request_id`` and on every response. No traceback ever reaches the client: it
    is logged here with the request id.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = sent if sent and _VALID_REQUEST_ID.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"),
                             request_id)
            if not started:
                err = OpenAIError("internal server error; the server logged the details under this request id",
                                  500)
                await _send_error(send_with_id, err, request_id)


class ApiKeyMiddleware:
    """With an API key configured, every ``/v1`` request needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str, protected_prefix: str = "/v1") -> None:
        self.app = app
        self._key = api_key.encode()
        self._prefix = protected_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not (
                path == self._prefix or path.startswith(self._prefix + "/")):
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self._key):
            reason = "missing" if not auth else "invalid"
            err = OpenAIError(f"{reason} API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            await _send_error(send, err, scope.get("state", {}).get("request_id"))
            return
        await self.app(scope, receive, send)
