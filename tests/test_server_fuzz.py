"""Schemathesis fuzzing of a live server against its own OpenAPI schema: no input may cause a 5xx.

The server is the default one (no MODEL: the built-in tiny model) with a 32-token context and at most
8 queued sequences, so that whatever the fuzzer asks for (n, max_tokens, prompt lists), one request
stays cheap: larger asks are 400s.
"""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402 - installed with schemathesis

from tests.test_server_support import serve  # noqa: E402


@pytest.fixture(scope="module")
def server():
    yield from serve(["--max-model-len", "32", "--max-waiting-requests", "8", "--kv-cache-memory-bytes",
                      str(16 << 20), "--disable-log-requests"])


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    response = case.call(base_url=server.base_url, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]
        assert "Traceback" not in response.text


def test_server_still_healthy_after_fuzzing(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    served = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert [m["id"] for m in served] == ["novainfer-tiny"]
    log = server.log()
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]
