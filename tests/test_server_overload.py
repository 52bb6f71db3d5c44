"""Backpressure and responsiveness of a live server.

The queue-bound tests share a server of the ``tiny`` model (cheap decode steps) that runs at most 2
sequences with at most 2 waiting. The ``/health`` test has a server of its own: ``big`` (a wider,
deeper random Qwen2) whose 2000-token prefill step is paced to last at least a second, to show
that ``/health`` never waits for a model step.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from novainfer.tiny_model import write_random_qwen2
from novainfer.engine.async_llm_engine import MIN_STEP_S_ENV
from tests.test_server_support import REPO_ROOT, ServerProcess, metric_value, serve
from tests.utils import tiny_model

BIG_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32)


# Each simulated client has an API key of its own: the key, not anything in the body, is the client.
CLIENTS = ("observer", "runner-0", "runner-1", "q-0", "q-1", "extra-0", "extra-1", "extra-2", "alice", "bob")


def auth(client: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-of-{client}"}


@pytest.fixture(scope="module")
def server():
    keys = [arg for client in CLIENTS for arg in ("--api-key", f"key-of-{client}")]
    yield from serve([str(tiny_model()), "--served-model-name", "tiny", "--max-num-seqs", "2",
                      "--max-waiting-requests", "2", "--max-concurrent-requests-per-client", "3", "--retry-after", "2",
                      "--kv-cache-memory-bytes", str(32 << 20), *keys])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120, headers=auth("observer")) as c:
        yield c


def _gauge(http: httpx.Client, name: str, model: str = "tiny") -> float:
    return metric_value(http.get("/metrics").text, f"novainfer:{name}", model_name=model)


def _wait_until(predicate, timeout: float = 30.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


class OpenStream:
    """A streaming completion read in a thread; ``first_chunk`` is set once it runs, ``close()`` hangs up."""

    def __init__(self, base_url: str, body: dict, client: str) -> None:
        self.first_chunk = threading.Event()
        self._hang_up = threading.Event()
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(base_url, body, auth(client)), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict, headers: dict[str, str]) -> None:
        try:
            with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, headers=headers,
                              timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line)
                        self.first_chunk.set()
                    if self._hang_up.is_set():
                        break
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc
        finally:
            self.first_chunk.set()

    def close(self) -> None:
        self._hang_up.set()
        self.join()

    def join(self, timeout: float = 120.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "stream did not finish"
        assert self.error is None, self.error


def test_overload_gets_429_while_admitted_requests_complete(server, http):
    long_body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                 "temperature": 0}
    running = [OpenStream(server.base_url, long_body, f"runner-{i}") for i in range(2)]
    for stream in running:
        assert stream.first_chunk.wait(60) and stream.status == 200
    assert _gauge(http, "num_requests_running") == 2

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        queued = [pool.submit(http.post, "/v1/completions", headers=auth(f"q-{i}"), json={
            "model": "tiny", "prompt": f"queued {i}", "max_tokens": 4, "ignore_eos": True}) for i in range(2)]
        assert _wait_until(lambda: _gauge(http, "num_requests_waiting") == 2), "the two requests never queued"

        for i in range(3):
            refused = http.post("/v1/completions", headers=auth(f"extra-{i}"),
                                json={"model": "tiny", "prompt": "one more", "max_tokens": 4})
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "2"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert "limit 2" in error["message"]
        # A request that could never fit is a 400, not a 429: retrying would not help.
        too_big = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 3, "max_tokens": 2})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n"

        # /health stays open under overload.
        assert http.get("/health").status_code == 200
        # The running requests keep streaming meanwhile; hanging up makes room for the queued ones.
        for stream in running:
            assert stream.status == 200 and stream.lines[-1] != "data: [DONE]"  # still streaming
            stream.close()
        for future in queued:
            response = future.result(timeout=120)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    rejected = metric_value(http.get("/metrics").text, "novainfer:requests_rejected_total", model_name="tiny",
                            reason="queue_full")
    assert rejected == 3


def test_per_client_concurrency_limit(server, http):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
    long_streams = [OpenStream(server.base_url, body, "alice") for _ in range(2)]
    for stream in long_streams:
        assert stream.first_chunk.wait(60) and stream.status == 200
    third = OpenStream(server.base_url, {**body, "max_tokens": 4}, "alice")  # waits in the queue: admitted
    assert _wait_until(lambda: _gauge(http, "num_requests_waiting") == 1)

    # Naming another user in the body changes nothing: the key is the client.
    refused = http.post("/v1/completions", headers=auth("alice"), json={**body, "max_tokens": 4, "user": "carol"})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "client_concurrency_limit" and "Retry-After" in refused.headers

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bob = pool.submit(http.post, "/v1/completions", headers=auth("bob"), json={**body, "max_tokens": 2})
        assert _wait_until(lambda: _gauge(http, "num_requests_waiting") == 2)
        # Hanging up aborts alice's long requests, which lets the queued ones run.
        for stream in long_streams:
            stream.close()
        third.join()
        assert third.lines[-1] == "data: [DONE]"
        assert bob.result(timeout=60).status_code == 200
    assert _wait_until(lambda: _gauge(http, "num_requests_running") == 0, timeout=30)
    assert http.post("/v1/completions", headers=auth("alice"), json={**body, "max_tokens": 2}).status_code == 200


def test_health_answers_fast_during_long_prefill(tmp_path):
    # The prefill computes for real (the GIL and the CPU are contended as in use), and the engine's
    # steps last at least a second however fast the machine: /health is polled during the step.
    big_dir = write_random_qwen2(tmp_path / "big-qwen2", **BIG_CONFIG)
    paced = ServerProcess([str(big_dir), "--served-model-name", "big", "--kv-cache-memory-bytes", str(32 << 20)],
                          cwd=REPO_ROOT, env={MIN_STEP_S_ENV: "1.0"})
    prompt = [(i * 7) % 700 for i in range(2000)]
    result: dict = {}
    with paced, httpx.Client(base_url=paced.base_url, timeout=120) as http:
        def long_request() -> None:
            started = time.monotonic()
            result["response"] = http.post("/v1/completions", timeout=300,
                                           json={"model": "big", "prompt": prompt, "max_tokens": 1})
            result["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=long_request)
        worker.start()
        latencies = []
        while worker.is_alive():
            started = time.monotonic()
            response = http.get("/health", timeout=5)
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200
            time.sleep(0.02)
        worker.join()
    assert result["response"].status_code == 200, result["response"].text
    assert result["response"].json()["usage"]["prompt_tokens"] == 2000
    assert len(latencies) >= 3, f"the {result['seconds']:.2f}s request left no time to poll /health"
    assert max(latencies) < 0.5, f"/health took {max(latencies):.3f}s during a {result['seconds']:.2f}s prefill"
