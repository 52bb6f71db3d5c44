"""A chat-completion stream that the test holds open and feeds itself.

A browser test that must act while an answer is still streaming cannot rely on the live server
being slow enough: on a busy machine the answer may end before the test's next click. Routing the
page's request here (``route.continue_(url=held.url)``) gives an answer that sends exactly the
pieces the test pushes, and ends only when the test finishes it or the browser closes the
connection (what the UI's Stop button does), which the test can wait for.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_FINISH = object()
_KEEPALIVE_S = 0.05  # how often an idle stream is written to, which is how a disconnect is noticed


class HeldStream:
    """One streamed chat completion at a time, fed by ``push`` and ended by ``finish`` or the client."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests: list[dict] = []
        self.sent: list[str] = []
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self._pieces: queue.Queue = queue.Queue()
        self._written = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/chat/completions"

    def __enter__(self) -> HeldStream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._pieces.put(_FINISH)
        self._server.shutdown()
        self._server.server_close()

    def push(self, text: str, timeout: float = 30.0) -> None:
        """Sends one content delta and waits until it has been written to the connection."""
        with self._written:
            count = len(self.sent)
            self._pieces.put(text)
            if not self._written.wait_for(lambda: len(self.sent) > count or self.disconnected.is_set(), timeout):
                raise TimeoutError(f"the piece {text!r} was not written within {timeout}s")
        if self.disconnected.is_set():
            raise ConnectionError(f"the client closed the stream before {text!r} was sent")

    def finish(self) -> None:
        self._pieces.put(_FINISH)

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        chunk = {"id": "chatcmpl-held", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length", 0))
        self.requests.append(json.loads(handler.rfile.read(length)))
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.end_headers()
        out = handler.wfile
        try:
            out.write(self._chunk({"role": "assistant", "content": ""}))
            out.flush()
            self.connected.set()
            while True:
                try:
                    piece = self._pieces.get(timeout=_KEEPALIVE_S)
                except queue.Empty:
                    out.write(b": keep-alive\n\n")
                    out.flush()
                    continue
                if piece is _FINISH:
                    out.write(self._chunk({}, "stop") + b"data: [DONE]\n\n")
                    out.flush()
                    return
                out.write(self._chunk({"content": piece}))
                out.flush()
                with self._written:
                    self.sent.append(piece)
                    self._written.notify_all()
        except (BrokenPipeError, ConnectionResetError):
            with self._written:
                self.disconnected.set()
                self._written.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        held = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server hook's name)
                held._serve(self)

            def log_message(self, *args) -> None:
                pass

        return Handler
