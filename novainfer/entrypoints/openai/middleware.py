"""ASGI middleware: request ids and error logging, the Host allow-list, body size and arrival
deadline, and API keys (which also name the request's principal).

They are plain ASGI (not ``BaseHTTPMiddleware``) so that streaming responses pass through
untouched and client disconnects still reach the endpoint. Every refusal made here is an
OpenAI-shaped error body, like the app's own.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Iterable

from fastapi.exceptions import HTTPException
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from novainfer.entrypoints.openai.errors import REQUEST_ID_HEADER, OpenAIError, error_body

logger = logging.getLogger(__name__)

# A client-sent request id is echoed only if it is printable and short (it ends up in logs).
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
# Loopback names a browser can reach without DNS, allowed by default on a loopback-bound server.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


def _state(scope: Scope) -> dict:
    return scope.setdefault("state", {})


async def send_error(send: Send, err: OpenAIError, request_id: str | None) -> None:
    body = json.dumps(error_body(err, request_id)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Outermost layer: gives every request an id, logs one line per error response, and turns any
    escaped exception into a 500.

    The id is the client's ``X-Request-Id`` when it sent a sane one (at most 128 characters of
    letters, digits and ``_.:-``), else a fresh one; it is put in ``request.state.request_id`` and
    on every response. Client errors (4xx) are logged as one line with the id and the principal;
    only an unexpected exception logs a traceback, and none ever reaches the client.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = sent if sent and _VALID_REQUEST_ID.match(sent) else uuid.uuid4().hex
        state = _state(scope)
        state["request_id"] = request_id
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"),
                             request_id)
            if status is None:
                err = OpenAIError("internal server error; the server logged the details under this request id",
                                  500)
                await send_error(send_with_id, err, request_id)
            return
        if status is not None and status >= 400 and status != 499:
            logger.info("%s %s -> %d (request id %s, client %s)", scope.get("method"), scope.get("path"), status,
                        request_id, state.get("principal", "-"))


def _host_name(host_header: str) -> str:
    """The host of a Host header, without its port; IPv6 literals lose their brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def default_allowed_hosts(bound_host: str) -> list[str] | None:
    """None (any Host) on a wildcard address, else the loopback names plus the bound address."""
    if bound_host in WILDCARD_ADDRESSES:
        return None
    return list(dict.fromkeys([*LOOPBACK_HOSTS, bound_host.lower()]))


class HostCheckMiddleware:
    """Refuses (400) a request whose Host header is not allowed: a page of another site that
    rebinds its DNS name to this server's address still sends its own name as Host."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str]) -> None:
        self.app = app
        self._allowed = {h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _host_name(Headers(scope=scope).get("host", ""))
        if host not in self._allowed:
            err = OpenAIError(f"Host '{host[:100]}' is not allowed by this server (see --allowed-hosts)", 400,
                              param="Host", code="host_not_allowed")
            await send_error(send, err, _state(scope).get("request_id"))
            return
        await self.app(scope, receive, send)


class _BodyRefused(HTTPException):
    """Raised by the wrapped ``receive``: an HTTPException, so that FastAPI's body reading passes it
    on unchanged to the app's handler, which answers with ``openai_error``."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.status, error.message)
        self.openai_error = error


class BodyLimitMiddleware:
    """Bounds a request body in size (413) and in arrival time (408, counted from the request's
    start), so that neither a huge body nor a client that trickles one in holds the server.

    A declared ``Content-Length`` over the limit is refused before anything is read; otherwise
    ``receive`` is wrapped and counts. The refusal is sent here, as long as no response started.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"the request body exceeds this server's limit of {self.max_bytes} bytes", 413,
                           param="body", code="body_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _state(scope).get("request_id")
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, self._too_large(), request_id)
            return
        deadline = time.monotonic() + self.timeout_s
        received = 0
        body_done = False
        started = False

        async def bounded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise _BodyRefused(OpenAIError(f"the request body did not arrive within {self.timeout_s:g} s",
                                               408, param="body", code="request_timeout")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyRefused(self._too_large())
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _BodyRefused as refused:  # read outside FastAPI's handlers
            if not started:
                await send_error(tracking_send, refused.openai_error, request_id)


def key_digest(key: str) -> str:
    """A stable, non-reversible name for an API key: what logs and principals show."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class AuthMiddleware:
    """Names each request's principal and, with API keys configured, requires one of them.

    The principal is ``key:<digest of the key>`` when keys are configured, else ``ip:<address>``;
    it is put in ``scope["state"]["principal"]`` for admission limits, sessions and logs. With
    keys, every path needs ``Authorization: Bearer <key>`` except those in ``open_paths`` and under
    ``open_prefixes``. Keys are compared through their SHA-256 digests with
    ``hmac.compare_digest``, against every key, so timing tells nothing about any of them.
    """

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], open_paths: Iterable[str] = (),
                 open_prefixes: Iterable[str] = ()) -> None:
        self.app = app
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_digest(k)) for k in api_keys]
        self._open_paths = frozenset(open_paths)
        self._open_prefixes = tuple(open_prefixes)

    def _principal_of_token(self, token: str) -> str | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for expected, name in self._digests:
            if hmac.compare_digest(digest, expected):
                found = name
        return f"key:{found}" if found is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = _state(scope)
        client = scope.get("client")
        address = f"ip:{client[0] if client else 'unknown'}"
        if not self._digests:
            state["principal"] = address
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        principal = self._principal_of_token(token.strip()) if scheme.lower() == "bearer" else None
        path = scope.get("path", "")
        is_open = path in self._open_paths or path.startswith(self._open_prefixes)
        if principal is None and not is_open and scope.get("method") != "OPTIONS":
            state["principal"] = address
            reason = "missing" if not auth else "invalid"
            err = OpenAIError(f"{reason} API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            await send_error(send, err, state.get("request_id"))
            return
        state["principal"] = principal or address
        await self.app(scope, receive, send)
