"""The header deadline on both of uvicorn's HTTP protocols (httptools and h11), in a server of its own
with a trivial app: slow headers get a 408, malformed requests a JSON 400, and a request whose
headers arrived is never cut off however long its handler takes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from novainfer.entrypoints.openai import http_protocol
from novainfer.entrypoints.openai.http_protocol import protocol_with_header_deadline

DEADLINE_S = 0.5
HANDLER_S = 1.5  # longer than the deadline


async def slow_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await asyncio.sleep(HANDLER_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["httptools", "h11"])
def protocol_name(request) -> str:
    return request.param


@pytest.fixture
def port(protocol_name) -> Iterator[int]:
    if protocol_name == "httptools" and http_protocol.HttpToolsProtocol is None:
        pytest.skip("httptools is not installed")
    protocol = protocol_with_header_deadline(DEADLINE_S, use_httptools=protocol_name == "httptools")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(slow_app, host="127.0.0.1", port=free, http=protocol, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(10)


def exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Everything the server sends back until it closes the connection or 10 s pass, and the wait."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
                if received.endswith(b"ok"):
                    break
        except TimeoutError:
            pass
    return received, time.monotonic() - started


def status_and_body(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_slow_headers_get_a_408(port):
    response, waited = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
    status, body = status_and_body(response)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert DEADLINE_S - 0.1 < waited < 5


def test_malformed_request_gets_a_json_400(port):
    status, body = status_and_body(exchange(port, b"NOT HTTP AT ALL\r\n\r\n")[0])
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_http_request"


def test_a_request_whose_headers_arrived_is_answered_however_long_it_takes(port):
    response, waited = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_and_body(response) == (200, b"ok")
    assert waited >= HANDLER_S


def test_endless_headers_are_refused_after_a_bounded_size(port, protocol_name):
    """Headers sent without end (within the deadline) are cut off once they pass the bound, with an
    OpenAI error body: 431 from httptools, h11's own 400 for an oversized event."""
    refused_after = None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(65536):  # 64 MiB at most: far beyond what socket buffers absorb
                sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1024))
        except (ConnectionResetError, BrokenPipeError):
            refused_after = i
        response = sock.recv(65536)
    status, body = status_and_body(response)
    assert status == (431 if protocol_name == "httptools" else 400)
    assert json.loads(body)["error"]["code"] == ("request_header_fields_too_large" if status == 431
                                                 else "bad_http_request")
    assert refused_after is not None
