"""uvicorn's connection protocols (httptools where installed, else h11) with a deadline on request
headers, and OpenAI-shaped bodies for the errors they answer themselves.

uvicorn's HTTP server waits for a request's headers as long as the client likes (its keep-alive
timer stops at the first byte), so a client that trickles them in holds a connection forever.
Here every connection must deliver each request's headers within the deadline, counted from the
connection's start or the previous response's end, else it gets a 408 and is closed. (The body's
deadline is :class:`~novainfer.entrypoints.openai.middleware.BodyLimitMiddleware`'s.) Malformed
requests get a 400 with an OpenAI error body instead of uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # httptools parses in C: a streamed response's chunks cost less than through h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None

from novainfer.entrypoints.openai.errors import REQUEST_ID_HEADER, OpenAIError, error_body

logger = logging.getLogger(__name__)


def raw_error_response(err: OpenAIError) -> bytes:
    """A complete HTTP/1.1 response (connection: close) carrying ``err`` and a fresh request id."""
    request_id = uuid.uuid4().hex
    body = json.dumps(error_body(err, request_id)).encode()
    head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{REQUEST_ID_HEADER.lower()}: {request_id}\r\n\r\n")
    return head.encode() + body


class HeaderDeadline:
    """The deadline, mixed into either uvicorn protocol. Both make a request's cycle once its headers
    are in, so the timer, armed when the connection opens and after each response, does nothing if it
    fires while a request is being served."""

    header_timeout_s: float = 30.0  # set by :func:`protocol_with_header_deadline`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._in_request() or self.transport.is_closing():
            return
        logger.info("request headers from %s did not arrive within %g s: 408", self.client, self.header_timeout_s)
        err = OpenAIError(f"the request headers did not arrive within {self.header_timeout_s:g} s", 408,
                          code="request_timeout")
        self.transport.write(raw_error_response(err))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(raw_error_response(OpenAIError(f"malformed HTTP request: {msg}", 400,
                                                            code="bad_http_request")))
        self.transport.close()


class H11HeaderDeadlineProtocol(HeaderDeadline, H11Protocol):
    pass


# The most bytes of request line and headers a request may send: h11's own bound (its default
# maximum incomplete event), which httptools does not have (it would buffer headers without end).
MAX_HEADER_BYTES = 16 * 1024


if HttpToolsProtocol is not None:
    class HttpToolsHeaderDeadlineProtocol(HeaderDeadline, HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_bytes = 0
            self._headers_too_large = False
            super().connection_made(transport)

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value))
            super().on_header(name, value)

        def _count_header_bytes(self, count: int) -> None:
            self._header_bytes += count
            if self._header_bytes > MAX_HEADER_BYTES:
                self._headers_too_large = True
                raise ValueError("request headers too large")  # stops the parser: send_400_response

        def send_400_response(self, msg: str) -> None:
            if not self._headers_too_large:
                super().send_400_response(msg)
                return
            self._disarm()
            err = OpenAIError(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes", 431,
                              code="request_header_fields_too_large")
            self.transport.write(raw_error_response(err))
            self.transport.close()


def protocol_with_header_deadline(timeout_s: float, use_httptools: bool | None = None) -> type[HeaderDeadline]:
    """The protocol class for uvicorn's ``http`` setting, with this header deadline: httptools's
    unless ``use_httptools`` is False or it is not installed."""
    if use_httptools and HttpToolsProtocol is None:
        raise ValueError("httptools is not installed")
    base = HttpToolsHeaderDeadlineProtocol if HttpToolsProtocol is not None and use_httptools is not False \
        else H11HeaderDeadlineProtocol
    return type(base.__name__, (base,), {"header_timeout_s": timeout_s})
