"""The server's process layouts, live: one API server process and its engine-core process, and two
API server processes (``--api-server-count 2``) sharing the port and the engine core.

For each layout, one server of the tiny model serves the equality tests (many concurrent streams, a
mixed batch, each against an offline ``LLM`` as the oracle) and is then stopped with SIGTERM, which
must leave no child process behind. A second server, with paced steps so that its streams are still
running, has its engine-core process killed with SIGKILL mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from novainfer import LLM, SamplingParams
from novainfer.entrypoints.openai.server_process import process_tree_cpu
from tests.test_server_support import PACED_STEPS, REPO_ROOT, ServerProcess, metric_value, serve
from tests.utils import tiny_model

KV_BYTES = 16 << 20


SERVER_ARGS = [str(tiny_model()), "--served-model-name", "tiny", "--kv-cache-memory-bytes", str(KV_BYTES)]


@pytest.fixture(scope="module", params=[1, 2], ids=["one_api_server", "two_api_servers"])
def api_server_count(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def server(api_server_count):
    yield from serve([*SERVER_ARGS, "--api-server-count", str(api_server_count)])


@pytest.fixture(scope="module")
def offline():
    llm = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)
    yield llm
    llm.shutdown()


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    return set(process_tree_cpu(pid)) - {pid}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def engine_core_pid(server) -> int:
    """The engine-core process: below one API server process, its spawned child (not
    multiprocessing's resource tracker); below several, the one their supervisor names."""
    if "--api-server-count 1" not in " ".join(server.args):
        cores = [int(pid) for pid in re.findall(r"engine core of model 'tiny' started \(pid (\d+)\)", server.log())]
        assert len(cores) == 1, f"expected the supervisor to name one engine core, got {cores}:\n{server.log()}"
        return cores[0]
    cores = [pid for pid in descendants(server.proc.pid)
             if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
             and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(cores) == 1, f"expected one engine-core process below {server.proc.pid}, found {cores}"
    return cores[0]


def test_the_engine_core_runs_in_a_process_of_its_own(server):
    core = engine_core_pid(server)
    assert core != server.proc.pid and core in descendants(server.proc.pid) and alive(core)


def test_64_concurrent_streams_each_equal_their_offline_output(server, offline):
    prompts = [f"stream {i} of the burst: {'abcdefgh'[i % 8] * (1 + i % 5)}" for i in range(64)]
    limits = [4 + (i * 7) % 13 for i in range(64)]
    expected = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                          for m in limits], use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str, limit: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=limit,
                                                 stream=True, extra_body={"ignore_eos": True})
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, limits)))

    results = asyncio.run(burst())
    for i, ((text, finish), exp) in enumerate(zip(results, expected)):
        assert (text, finish) == (exp.outputs[0].text, "length"), f"stream {i}"


async def _streamed_completion(client, **kwargs) -> list[dict]:
    """A streamed completion's choices put together from its chunks' deltas, in index order:
    text, finish and stop reasons, and the sampled tokens' logprobs."""
    choices: dict[int, dict] = {}
    async for chunk in await client.completions.create(stream=True, **kwargs):
        for delta in chunk.choices:
            choice = choices.setdefault(delta.index, {"text": "", "finish_reason": None, "stop_reason": None,
                                                      "token_logprobs": []})
            choice["text"] += delta.text
            if delta.logprobs is not None:
                choice["token_logprobs"] += delta.logprobs.token_logprobs
            if delta.finish_reason is not None:
                choice["finish_reason"] = delta.finish_reason
                choice["stop_reason"] = getattr(delta, "stop_reason", None)
    return [choices[i] for i in sorted(choices)]


@pytest.mark.parametrize("stream", [False, True])
def test_mixed_batch_served_equals_offline_byte_for_byte(server, offline, stream):
    stop_source = offline.generate("Stop strings come from here", SamplingParams(temperature=0, max_tokens=16,
                                                                                 ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].text
    stop = stop_source[4:7]
    assert stop, "the greedy text is too short to take a stop string from"
    cases = [  # (prompt, fields of the request, which are also SamplingParams')
        ("Greedy decoding", dict(temperature=0, max_tokens=12)),
        ("Seeded sampling", dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12)),
        ("Stop strings come from here", dict(temperature=0, max_tokens=16, stop=[stop])),
        ("Logprobs of each token", dict(temperature=0, max_tokens=6, logprobs=3)),
        ("Two seeded choices", dict(temperature=1.0, seed=7, n=2, max_tokens=10)),
    ]
    params = [SamplingParams(**fields, ignore_eos=True) for _, fields in cases]
    expected = offline.generate([p for p, _ in cases], params, use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str, fields: dict) -> list[dict]:
        kwargs = dict(model="tiny", prompt=prompt, extra_body={"ignore_eos": True}, **fields)
        if stream:
            return await _streamed_completion(client, **kwargs)
        response = await client.completions.create(**kwargs)
        return [{"text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                 "token_logprobs": c.logprobs.token_logprobs if c.logprobs is not None else []}
                for c in sorted(response.choices, key=lambda c: c.index)]

    async def batch():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p, f) for p, f in cases))

    for (prompt, fields), choices, exp in zip(cases, asyncio.run(batch()), expected):
        assert len(choices) == len(exp.outputs), prompt
        for choice, out in zip(choices, exp.outputs):
            assert choice["text"].encode() == out.text.encode(), prompt
            assert (choice["finish_reason"], choice["stop_reason"]) == (out.finish_reason, out.stop_reason), prompt
            if "logprobs" in fields:
                offline_values = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
                # The same tokens; their values may differ in the last bits, as the batch they ran
                # in (and so the shapes of the matrix products) differs from the offline run's.
                assert choice["token_logprobs"] == pytest.approx(offline_values, abs=1e-4)
    assert expected[2].outputs[0].finish_reason == "stop"  # the stop string did end it


def test_a_client_disconnect_frees_its_kv_blocks_within_a_second(server):
    base = server.base_url
    body = {"model": "tiny", "prompt": "Leaving early", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 4:
                busy = httpx.get(f"{base}/metrics", timeout=10).text
                assert metric_value(busy, "novainfer:num_requests_running", model_name="tiny") == 1
                assert metric_value(busy, "novainfer:kv_cache_usage_perc", model_name="tiny") > 0
                break  # leaving the lines closes the connection
    left = time.monotonic()
    while True:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        if metric_value(text, "novainfer:kv_cache_usage_perc", model_name="tiny") == 0:
            break
        assert time.monotonic() - left < 1.0, "the request's KV blocks were not freed within a second"
        time.sleep(0.02)
    assert metric_value(text, "novainfer:num_requests_running", model_name="tiny") == 0


def test_sessions_and_metrics_are_the_same_whichever_process_answers(server):
    """Each request on a new connection, which any API server process may accept: a session's turns
    all see its history, and a scrape counts every request."""
    base = server.base_url

    def counts() -> tuple[float, float]:
        """Requests with a first token, and sequences finished (by any reason but abort)."""
        text = httpx.get(f"{base}/metrics", timeout=10).text
        finished = sum(metric_value(text, "novainfer:request_success_total", model_name="tiny",
                                    finished_reason=reason) for reason in ("stop", "length"))
        return metric_value(text, "novainfer:time_to_first_token_seconds_count", model_name="tiny") or 0.0, finished

    before = counts()
    session = httpx.post(f"{base}/v1/sessions", json={"model": "tiny"}, timeout=10).json()["id"]
    turns = 6
    for turn in range(turns):
        response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "session_id": session, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": f"turn {turn}"}]})
        assert response.status_code == 200, response.text
    messages = httpx.get(f"{base}/v1/sessions/{session}", timeout=10).json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == [f"turn {t}" for t in range(turns)]
    assert len(messages) == 2 * turns
    assert [now - then for now, then in zip(counts(), before)] == [turns, turns]


def test_sigterm_of_the_server_leaves_no_child_process(server):
    children = descendants(server.proc.pid)
    assert children, "the server has no engine-core process"
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (server.proc.poll() is None or any(alive(p) for p in children)):
        time.sleep(0.1)
    assert server.proc.poll() is not None, "the server did not exit after SIGTERM"
    assert not [p for p in children if alive(p)], f"children left running: {children}"


# ---- the engine core killed mid-stream --------------------------------------------------------------------
@pytest.fixture(scope="module")
def paced_server(api_server_count):
    yield from serve([*SERVER_ARGS, "--api-server-count", str(api_server_count)], env=PACED_STEPS)


class Stream(threading.Thread):
    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.first = threading.Event()
        self.payloads: list[str] = []

    def run(self) -> None:
        body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.payloads.append(line[len("data: "):])
                    self.first.set()


def test_killed_engine_core_fails_requests_and_the_server_stays_up(paced_server):
    base = paced_server.base_url
    streams = [Stream(base) for _ in range(2)]
    for stream in streams:
        stream.start()
    plain: dict = {}
    blocking = threading.Thread(target=lambda: plain.update(response=httpx.post(
        f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 1500, "ignore_eos": True}, timeout=60)),
        daemon=True)
    blocking.start()
    assert all(s.first.wait(60) for s in streams)
    # The plain request too must be running in the core when it dies (not merely sent).
    deadline = time.monotonic() + 30
    while metric_value(httpx.get(f"{base}/metrics", timeout=10).text, "novainfer:num_requests_running",
                       model_name="tiny") < 3:
        assert time.monotonic() < deadline, "the three requests never ran together"
        time.sleep(0.05)
    os.kill(engine_core_pid(paced_server), signal.SIGKILL)
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive(), "a stream hangs after its engine core died"
        assert stream.payloads[-1] == "[DONE]"
        error = httpx.Response(200, content=stream.payloads[-2]).json()["error"]
        assert error["type"] == "server_error" and "engine" in error["message"]
    blocking.join(30)
    response = plain["response"]
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    for _ in range(4):  # each on a new connection: with several API server processes, each says so
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "'tiny'" in health.json()["error"]["message"]
    # The server itself still answers at once, and refuses new work for the dead model.
    assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 200
    assert metric_value(httpx.get(f"{base}/metrics", timeout=10).text, "novainfer:engine_alive",
                        model_name="tiny") == 0
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_an_api_server_process_that_dies_stops_the_whole_server():
    """With several API server processes, one killed (SIGKILL) ends the server: the supervisor exits
    with an error and leaves no process behind (its clients would otherwise be served by fewer
    processes than configured, without anyone noticing)."""
    with ServerProcess([*SERVER_ARGS, "--api-server-count", "2"], cwd=REPO_ROOT) as server:
        core = engine_core_pid(server)
        children = descendants(server.proc.pid)
        api_servers = [pid for pid in children if pid != core
                       and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
                       and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(api_servers) == 2, (api_servers, children)
        os.kill(api_servers[0], signal.SIGKILL)
        assert server.proc.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in children):
            time.sleep(0.1)
        assert not [p for p in children if alive(p)], f"children left running: {children}"


@pytest.mark.parametrize("count", [1, 2])
def test_a_killed_server_leaves_no_process_behind(count):
    """SIGKILL of the started process (no chance to stop anything): its engine core and, with several,
    its API server processes notice their parent is gone and end."""
    with ServerProcess([*SERVER_ARGS, "--api-server-count", str(count)], cwd=REPO_ROOT) as server:
        children = descendants(server.proc.pid)
        assert len(children) >= count + 1, children  # the engine core, and the API servers below a supervisor
        server.proc.kill()
        server.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in children):
            time.sleep(0.1)
        assert not [p for p in children if alive(p)], f"children left running: {children}"
