"""uvicorn's h11 connection protocol with a deadline on request headers, and OpenAI-shaped bodies
for the errors it answers itself.

uvicorn's h11 server waits for a request's headers as long as the client likes (its keep-alive
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

from novainfer.entrypoints.openai.errors import REQUEST_ID_HEADER, OpenAIError, error_body

logger = logging.getLogger(__name__)


def raw_error_response(err: OpenAIError) -> bytes:
    """A complete HTTP/1.1 response (connection: close) carrying ``err`` and a fresh request id."""
    request_id = uuid.uuid4().hex
    body = json.dumps(error_body(err, request_id)).encode()
    head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{REQUEST_ID_HEADER.lower()}: {request_id}\r\n\r\n")
    return head.encode() + body


class HeaderDeadlineProtocol(H11Protocol):
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

    def handle_events(self) -> None:
        super().handle_events()
        if self._in_request():  # a request's headers arrived
            self._disarm()

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


def protocol_with_header_deadline(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``http`` setting, with this header deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s})
