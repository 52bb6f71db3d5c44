"""Server-sent events and disconnect detection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"

# Chunks are plain dicts serialized by msgspec (compact UTF-8 JSON), not pydantic models: a stream
# writes one per request per engine step.
_json_encoder = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json_encoder.encode(payload) + b"\n\n"


class ChunkEvents:
    """The SSE events of one stream's chunks of one choice each: the fields every chunk shares
    (``head``) are encoded once, and each event encodes only its choice. An event's bytes are
    ``sse_event({**head, "choices": [choice]})``'s."""

    def __init__(self, head: dict[str, Any]) -> None:
        # {...,"choices":[]} without its closing "]}"
        self._prefix = b"data: " + _json_encoder.encode({**head, "choices": []})[:-2]

    def event(self, choice: dict[str, Any]) -> bytes:
        return self._prefix + _json_encoder.encode(choice) + b"]}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs ``on_close``, however the stream ends.

    The body is streamed in a task of its own, and one plain asyncio task waits for the client's
    disconnect and cancels it (Starlette's response runs both in an anyio task group, whose set-up
    cost about a tenth of the API process's time per streamed request in a burst). In its own task,
    each wake-up of the body (one per engine step) resumes only the body's coroutines, not the
    request's whole stack of middleware and routing frames beneath it. A disconnect may come before
    the body iterator ever started (then its ``finally`` never runs): ``on_close`` is the guaranteed
    cleanup.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.create_task(self.stream_response(send))
        disconnected = False

        async def cancel_on_disconnect() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            body.cancel()

        watcher = asyncio.create_task(cancel_on_disconnect())
        try:
            # Cancelling this task cancels the body too (it is what this task awaits).
            await body
        except asyncio.CancelledError:
            # Swallowed only when the disconnect alone cancelled the stream (Python < 3.11 cannot
            # tell whether this task was cancelled as well).
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if not disconnected or (cancelling is not None and cancelling()):
                raise
        finally:
            watcher.cancel()
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # cleanup of an already-broken stream must not mask the real end
                    logger.debug("closing an SSE body iterator failed", exc_info=True)


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so only a disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; if the client disconnects first, cancels it and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
