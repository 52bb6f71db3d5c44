"""The OpenAI-compatible server, live, through the official ``openai`` client and raw HTTP.

One server (two served names of the tiny model, API key on) is started for the module; an
offline ``LLM`` on the same model directory is the oracle for greedy outputs.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from novainfer import LLM, SamplingParams
from tests.test_server_support import metric_value, serve, sse_payloads

API_KEY = "test-key-123"
MODEL = "tiny"
MODEL_B = "tiny-b"
KV_BYTES = str(16 << 20)


@pytest.fixture(scope="module")
def server(model_dir):
    yield from serve([str(model_dir), "--model", str(model_dir), "--served-model-name", MODEL,
                      "--served-model-name", MODEL_B, "--api-key", API_KEY, "--kv-cache-memory-bytes", KV_BYTES,
                      "--max-sessions", "4", "--session-ttl", "600"])


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:
        yield c


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def chat_prompt_len(offline: LLM, messages: list[dict[str, str]]) -> int:
    text = offline.apply_chat_template(messages)
    return len(offline.get_tokenizer().encode(text, add_special_tokens=False))


# ---- basic endpoints ---------------------------------------------------------------------------------
def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL, MODEL_B]


def test_health_version_metrics_open_without_key(server):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert metric_value(metrics, "novainfer:num_requests_running", model_name=MODEL) is not None


# ---- chat ----------------------------------------------------------------------------------------------
def test_chat_matches_offline_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Hello, how are you today?"}]
    expected = offline.chat(messages, greedy(24), use_tqdm=False)[0].outputs[0]

    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    choice = response.choices[0]
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    prompt_len = chat_prompt_len(offline, messages)
    assert response.usage.prompt_tokens == prompt_len
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == prompt_len + len(expected.token_ids)
    assert response.usage.prompt_tokens_details.cached_tokens >= 0

    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == prompt_len
    # The second identical prompt hit the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_chat_n_and_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1 2 3"}],
                                              temperature=0, max_tokens=6, n=2, logprobs=True, top_logprobs=3)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content == response.choices[1].message.content  # greedy siblings
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) >= 1
        for entry in content:
            assert len(entry.top_logprobs) == 3
            # Greedy: the chosen token is the most likely one.
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert response.usage.completion_tokens == sum(len(c.logprobs.content) for c in response.choices)


def test_chat_stream_with_n_and_logprobs_puts_together_the_full_response(client):
    """A stream's deltas (two choices, each token's logprobs, the usage at the end) add up to the
    non-streamed response of the same greedy request."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count: 1 2 3"}], temperature=0, max_tokens=7,
                  n=2, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    text, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                tokens[choice.index] += [(e.token, e.logprob, [t.token for t in e.top_logprobs])
                                         for e in choice.logprobs.content]
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    for choice in full.choices:
        assert text[choice.index] == choice.message.content
        assert finish[choice.index] == choice.finish_reason == "length"
        expected = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in choice.logprobs.content]
        assert [(t, pytest.approx(lp, abs=1e-4), top) for t, lp, top in expected] == tokens[choice.index]
    assert usage.completion_tokens == full.usage.completion_tokens == 14


# ---- completions ---------------------------------------------------------------------------------------
def test_completion_matches_offline_streamed_and_not(client, offline):
    prompt = "Once upon a time there was"
    expected = offline.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt, add_special_tokens=False))
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_completion_token_prompts_and_vllm_extras(client, offline):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], greedy(5, ignore_eos=True),
                                use_tqdm=False)
    response = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5, n=2,
                                         extra_body={"ignore_eos": True, "top_k": 5})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [expected[0].outputs[0].text] * 2 + [expected[1].outputs[0].text] * 2
    assert response.usage.prompt_tokens == 7 and response.usage.completion_tokens == 20
    single = client.completions.create(model=MODEL, prompt=prompts[0], temperature=0, max_tokens=5,
                                       logprobs=2, extra_body={"ignore_eos": True})
    logprobs = single.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == single.choices[0].text


def test_concurrent_streams_each_get_their_own_tokens(server, offline):
    words = ["apple", "river", "music", "science", "history", "model", "token", "cache", "batch", "stream",
             "Hello", "world", "quick", "brown", "lazy", "dog"]
    prompts = [f"{words[i % 16]} {words[(i * 7) % 16]} number {i}" for i in range(32)]
    max_tokens = [3 + (i * 5) % 17 for i in range(32)]
    expected = offline.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str, limit: int) -> tuple[str, int, list[str]]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=limit,
                                                 stream=True, stream_options={"include_usage": True})
        pieces, usage, finishes = [], None, []
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                if chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(pieces), usage, finishes

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, max_tokens)))

    results = asyncio.run(all_of_them())
    for i, ((text, usage, finishes), exp) in enumerate(zip(results, expected)):
        assert text == exp.outputs[0].text, f"request {i} got someone else's or reordered tokens"
        assert usage == len(exp.outputs[0].token_ids)
        assert finishes == [exp.outputs[0].finish_reason]


# ---- routing and auth ------------------------------------------------------------------------------------
def test_multi_model_routing(client):
    response = client.completions.create(model=MODEL_B, prompt="Hello", temperature=0, max_tokens=3)
    assert response.model == MODEL_B
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=3)
    message = info.value.body["message"]
    assert "no-such-model" in message and MODEL in message and MODEL_B in message
    assert info.value.body["param"] == "model"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": "Basic " + API_KEY}])
def test_auth_required_on_v1(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/sessions")):
        response = httpx.request(method, server.base_url + path, headers=headers, json={"prompt": "x"})
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and "API key" in error["message"]
        assert response.headers["X-Request-Id"] == error["request_id"]


def test_auth_with_openai_client(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---- errors ----------------------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
TOO_LONG = "hello world " * 1500

BAD_INPUTS = [
    # (name, endpoint, body (dict or raw bytes), status, param)
    ("invalid json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages"),
    ("temperature type", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("temperature range", "/v1/chat/completions", {**CHAT, "temperature": 3.5}, 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("n zero", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("max_tokens negative", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens as string", "/v1/chat/completions", {**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("stream as int", "/v1/chat/completions", {**CHAT, "stream": 1}, 400, "stream"),
    ("seed overflow", "/v1/chat/completions", {**CHAT, "seed": 2**70}, 400, "seed"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("unknown field", "/v1/chat/completions", {**CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("tool_choice", "/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("functions", "/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("response_format json", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("logit_bias", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("stream_options without stream", "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs too many", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 99}, 400,
     "top_logprobs"),
    ("min_tokens > max_tokens", "/v1/chat/completions", {**CHAT, "min_tokens": 9}, 400, "min_tokens"),
    ("too-long chat prompt", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {**COMP, "prompt": [1, "a"]}, 400, "prompt"),
    ("prompt empty list", "/v1/completions", {**COMP, "prompt": []}, 400, "prompt"),
    ("prompt empty string", "/v1/completions", {**COMP, "prompt": ""}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {**COMP, "prompt": [10**6]}, 400, "prompt"),
    ("negative token id in a batch", "/v1/completions", {**COMP, "prompt": [[1, 2], [3, -4]]}, 400, "prompt"),
    ("too-long prompt", "/v1/completions", {**COMP, "prompt": TOO_LONG}, 400, "prompt"),
    ("prompt + max_tokens too long", "/v1/completions", {**COMP, "max_tokens": 4000}, 400, "max_tokens"),
    ("echo", "/v1/completions", {**COMP, "echo": True}, 400, "echo"),
    ("suffix", "/v1/completions", {**COMP, "suffix": "end"}, 400, "suffix"),
    ("best_of", "/v1/completions", {**COMP, "best_of": 3}, 400, "best_of"),
    ("stop wrong type", "/v1/completions", {**COMP, "stop": 5}, 400, "stop"),
    ("logprobs range", "/v1/completions", {**COMP, "logprobs": 50}, 400, "logprobs"),
    ("presence_penalty range", "/v1/completions", {**COMP, "presence_penalty": 3}, 400, "presence_penalty"),
    ("detokenize bad id", "/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("unknown endpoint", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs(http, name, path, body, status, param):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if param is not None:
        assert param in error["message"] or name.startswith("too-long"), error
    assert "Traceback" not in response.text
    assert response.headers["X-Request-Id"] == error["request_id"]


def test_too_long_prompt_names_both_lengths(http, offline):
    n = len(offline.get_tokenizer().encode(TOO_LONG, add_special_tokens=False))
    error = http.post("/v1/completions", json={**COMP, "prompt": TOO_LONG}).json()["error"]
    assert "2048" in error["message"] and str(n) in error["message"]


def test_server_keeps_serving_after_bad_inputs(http):
    for _, path, body, _, _ in BAD_INPUTS[:5]:
        http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json=COMP)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_request_id_echoed_or_generated(http):
    response = http.get("/v1/models", headers={"X-Request-Id": "my-trace-42"})
    assert response.headers["X-Request-Id"] == "my-trace-42"
    generated = http.get("/v1/models").headers["X-Request-Id"]
    assert generated and generated != "my-trace-42"
    error = http.post("/v1/completions", json={"prompt": 5}, headers={"X-Request-Id": "trace-err"})
    assert error.headers["X-Request-Id"] == "trace-err" and error.json()["error"]["request_id"] == "trace-err"


# ---- tokenizer endpoints ------------------------------------------------------------------------------------
def test_tokenize_detokenize(http, offline):
    tokenizer = offline.get_tokenizer()
    body = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello, world!"}).json()
    assert body["tokens"] == tokenizer.encode("Hello, world!", add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json() == {
        "prompt": "Hello, world!"}
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["count"] == chat_prompt_len(offline, messages)


# ---- sessions ------------------------------------------------------------------------------------------------
def test_session_second_turn_equals_full_history(client, http):
    first = {"role": "user", "content": "Tell me a long story about a small model that wanted to learn to speak."}
    second = {"role": "user", "content": "And then what happened?"}
    turn1 = client.chat.completions.create(model=MODEL, messages=[first], temperature=0, max_tokens=12,
                                           extra_body={"session_id": "conv-1"})
    reply1 = turn1.choices[0].message.content
    turn2 = client.chat.completions.create(model=MODEL, messages=[second], temperature=0, max_tokens=12,
                                           extra_body={"session_id": "conv-1"})
    full = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                          messages=[first, {"role": "assistant", "content": reply1}, second])
    assert turn2.choices[0].message.content == full.choices[0].message.content
    assert turn2.usage.prompt_tokens == full.usage.prompt_tokens
    assert turn2.usage.prompt_tokens_details.cached_tokens > 0

    listed = {s["id"]: s for s in http.get("/v1/sessions").json()["data"]}
    assert listed["conv-1"]["num_messages"] == 4 and listed["conv-1"]["model"] == MODEL
    detail = http.get("/v1/sessions/conv-1").json()
    assert detail["messages"][-1] == {"role": "assistant", "content": turn2.choices[0].message.content}
    assert http.delete("/v1/sessions/conv-1").json()["deleted"] is True
    missing = http.delete("/v1/sessions/conv-1")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "session_id"


def test_session_streaming_and_lru_bound(http):
    replies = []
    for i in range(6):  # the server keeps at most 4
        with http.stream("POST", "/v1/chat/completions", json={
                **CHAT, "stream": True, "session_id": f"lru-{i}", "max_tokens": 12,
                "messages": [{"role": "user", "content": f"turn {i}"}]}) as response:
            assert response.status_code == 200
            payloads = sse_payloads(response.iter_lines())
            assert payloads[-1] == "[DONE]"
        replies.append("".join(json.loads(p)["choices"][0]["delta"].get("content") or ""
                               for p in payloads[:-1] if json.loads(p)["choices"]))
    ids = [s["id"] for s in http.get("/v1/sessions").json()["data"]]
    assert len(ids) == 4 and ids[0] == "lru-5" and "lru-0" not in ids and "lru-1" not in ids
    messages = http.get("/v1/sessions/lru-5").json()["messages"]
    # The session keeps the whole streamed reply, not the stream's last piece.
    assert messages == [{"role": "user", "content": "turn 5"}, {"role": "assistant", "content": replies[5]}]
    assert len(replies[5]) > 0


# ---- cancellation ---------------------------------------------------------------------------------------------
def _wait_for_idle(http, aborted_before: float, timeout: float = 1.0) -> tuple[float, float, float]:
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        running = metric_value(text, "novainfer:num_requests_running", model_name=MODEL)
        usage = metric_value(text, "novainfer:kv_cache_usage_perc", model_name=MODEL)
        aborted = metric_value(text, "novainfer:request_success_total", model_name=MODEL, finished_reason="abort")
        if (running == 0 and usage == 0 and aborted > aborted_before) or time.monotonic() > deadline:
            return running, usage, aborted
        time.sleep(0.05)


def _aborted(http) -> float:
    return metric_value(http.get("/metrics").text, "novainfer:request_success_total", model_name=MODEL,
                        finished_reason="abort")


def test_streaming_client_disconnect_aborts(server, http):
    before = _aborted(http)
    body = {**CHAT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            received = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 4:
                    break
    running, usage, aborted = _wait_for_idle(http, before)
    assert (running, usage) == (0, 0) and aborted == before + 1


def test_nonstreaming_client_disconnect_aborts(server, http):
    before = _aborted(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={**COMP, "max_tokens": 1500, "ignore_eos": True}, timeout=0.5)
    running, usage, aborted = _wait_for_idle(http, before)
    assert (running, usage) == (0, 0) and aborted == before + 1


# ---- latency histograms -------------------------------------------------------------------------------
def _histogram_counts(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {name: metric_value(text, f"novainfer:{name}_seconds_count", model_name=MODEL) or 0.0
            for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency")}


@pytest.mark.parametrize("stream", [True, False])
def test_latency_histograms_count_each_request_and_each_gap_between_tokens(http, stream):
    """One TTFT and one end-to-end latency per request, and one inter-token gap per token after the
    first, whether the tokens came one per output or many (a stream's reader behind, a full response)."""
    before = _histogram_counts(http)
    body = {"model": MODEL, "prompt": "histograms", "max_tokens": 9, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    if stream:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert sse_payloads(response.iter_lines())[-1] == "[DONE]"
    else:
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 9
    after = _histogram_counts(http)
    assert {k: after[k] - before[k] for k in after} == {"time_to_first_token": 1, "inter_token_latency": 8,
                                                         "e2e_request_latency": 1}
