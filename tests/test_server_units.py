"""In-process tests of the server's parts: AsyncLLMEngine, the app on injected engines, sessions,
admission control and the ``serve`` command line. No subprocess, no sockets."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import pytest

from novainfer import LLM, SamplingParams
from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, StreamGroup
from novainfer.entrypoints.cli.main import build_parser
from novainfer.entrypoints.cli.serve import server_config_from
from novainfer.entrypoints.openai.admission import AdmissionController, AdmissionLimits
from novainfer.entrypoints.openai.api_server import build_app
from novainfer.entrypoints.openai.errors import OpenAIError
from novainfer.entrypoints.openai.served_models import INLINE_TOKENIZER_SIZE, ModelRegistry, ServedModel
from novainfer.entrypoints.openai.sessions import SessionStore
from novainfer.entrypoints.openai.streaming import ChunkEvents, sse_event
from novainfer.sampling_params import RequestOutputKind
from tests.test_server_support import metric_value
from tests.utils import tiny_model

KV_BYTES = 8 << 20


def make_engine(name: str = "tiny") -> AsyncLLMEngine:
    """An engine whose core runs in a thread of this process, where a test can break its steps."""
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model()), kv_cache_memory_bytes=KV_BYTES),
                                           name=name, multiprocess=False)


def assert_deltas_add_up(deltas, expected) -> None:
    """Delta outputs (CompletionOutput) of one sequence concatenate to its whole output ``expected``."""
    assert "".join(c.text for c in deltas) == expected.text
    assert [t for c in deltas for t in c.token_ids] == expected.token_ids
    assert [p for c in deltas for p in c.logprobs] == list(expected.logprobs)


def run_and_shut_down(engine: AsyncLLMEngine, main):
    """``asyncio.run(main())``'s result; the engine is shut down whatever happens."""
    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def assert_aborted_and_freed(stats, num_aborted: int) -> None:
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0
    assert stats.finished_requests_total["abort"] == num_aborted


async def stats_once_idle(engine: AsyncLLMEngine):
    """The engine's stats once nothing runs and no KV block is used (or after about 2 s)."""
    for _ in range(200):
        stats = engine.get_stats()
        if stats.num_running_reqs == 0 and stats.kv_cache_usage == 0:
            break
        await asyncio.sleep(0.01)
    return engine.get_stats()


@pytest.fixture(scope="module")
def offline():
    return LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)


# ---- AsyncLLMEngine ---------------------------------------------------------------------------------------
def test_async_engine_concurrent_generate_matches_offline(offline):
    prompts = [f"Hello number {i}, how are you" for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(6)]
    expected = [o.outputs[0] for o in offline.generate(prompts, params, use_tqdm=False)]
    engine = make_engine()

    async def run_one(i: int) -> tuple[str, list[int]]:
        deltas, final = [], None
        async for output in engine.generate(prompts[i], params[i], request_id=f"r{i}"):
            deltas.append(output.outputs[0].delta_text)
            final = output
        return "".join(deltas), final.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(run_one(i) for i in range(6)))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (text, ids), exp in zip(results, expected):
        assert text == exp.text and ids == exp.token_ids


def test_async_engine_reader_behind_gets_the_missed_steps_in_one_output(offline):
    """A reader that falls behind the engine is handed everything since its last read in one delta
    output (text, token ids and logprobs), which concatenates to the offline output."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    expected = offline.generate(["Tell me about ducks"], params, use_tqdm=False)[0].outputs[0]
    engine = make_engine()

    async def main():
        stream = await engine.add_request("slow", "Tell me about ducks", params)
        outputs = []
        async for output in stream:
            outputs.append(output)
            if len(outputs) == 1:  # fall behind until the core has made every token
                while engine.output_processor.children["slow"][1].finish_reason is None:
                    await asyncio.sleep(0.01)
        return outputs

    try:
        outputs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(outputs) == 2 and outputs[-1].finished
    assert_deltas_add_up([o.outputs[0] for o in outputs], expected)


def test_async_engine_validation_error_and_abort_frees_blocks():
    engine = make_engine()

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await engine.add_request("bad", {"prompt_token_ids": []}, SamplingParams(max_tokens=2))
        stream = await engine.add_request("long", "Hello", SamplingParams(max_tokens=1000, ignore_eos=True))
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break  # leaving the iteration aborts the request
        return await stats_once_idle(engine)

    assert_aborted_and_freed(run_and_shut_down(engine, main), 1)


def test_stream_group_gives_one_reader_every_stream_with_news_per_wake_up(offline):
    """The streams of a group are read by one reader: each wake-up yields every stream that moved
    (at most once each), the deltas of each stream concatenate to its offline output, and what came
    before the group existed is not lost."""
    prompts = ["Tell me about ducks", "Hello number 3", "The weather today is"]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=1,
                             output_kind=RequestOutputKind.DELTA) for i in range(3)]
    expected = [o.outputs[0] for o in offline.generate(prompts, params, use_tqdm=False)]
    engine = make_engine()

    async def main():
        streams = [await engine.add_request(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        while not all(s.has_news() for s in streams):  # outputs that come before the group exists
            await asyncio.sleep(0.005)

        async def read():
            return [batch async for batch in StreamGroup(streams).batches()]

        return await asyncio.wait_for(read(), 60)  # a lost wake-up fails instead of hanging

    try:
        batches = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(batches[0]) == 3  # the news of all three, in one wake-up
    assert all(len({index for index, _ in batch}) == len(batch) for batch in batches)
    for index, exp in enumerate(expected):
        assert_deltas_add_up([output.outputs[0] for batch in batches for i, output in batch if i == index], exp)


def test_leaving_a_stream_group_early_aborts_its_unfinished_streams():
    engine = make_engine()

    async def main():
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        streams = [await engine.add_request(f"long{i}", "Hello", params) for i in range(3)]
        async for _ in StreamGroup(streams).batches():
            break
        return await stats_once_idle(engine)

    assert_aborted_and_freed(run_and_shut_down(engine, main), 3)


def test_a_stream_group_ends_once_its_streams_are_aborted_elsewhere():
    """Streams aborted while their group's reader waits (e.g. by their request's clean-up) end the
    reading instead of leaving it waiting for outputs that will never come."""
    engine = make_engine()

    async def main():
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        streams = [await engine.add_request(f"x{i}", "Hello", params) for i in range(2)]

        async def read():
            return [batch async for batch in StreamGroup(streams).batches()]

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        for stream in streams:
            stream.abort()
        await asyncio.wait_for(reader, 30)
        return await stats_once_idle(engine)

    assert_aborted_and_freed(run_and_shut_down(engine, main), 2)


def _break_after(engine: AsyncLLMEngine, num_steps: int) -> None:
    real_step = engine.engine_core.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > num_steps:
            raise RuntimeError("simulated device failure")
        return real_step()

    engine.engine_core.step = step


def test_async_engine_death_fails_in_flight_and_new_requests():
    engine = make_engine()
    _break_after(engine, 3)

    async def main():
        stream = await engine.add_request("a", "Hello", SamplingParams(max_tokens=100, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "Hello", SamplingParams(max_tokens=2))

    try:
        asyncio.run(main())
        assert not engine.is_healthy
    finally:
        engine.shutdown()


@pytest.mark.parametrize("choice", [
    {"index": 0, "text": "caf\u00e9 \"quoted\" \\ \n\U0001f600", "logprobs": None, "finish_reason": None,
     "stop_reason": None},
    {"index": 3, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
    {"index": 1, "delta": {}, "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]}, "finish_reason": "stop",
     "stop_reason": 7},
])
def test_chunk_events_are_the_whole_chunk_encoded(choice):
    head = {"id": "cmpl-abc", "object": "text_completion", "created": 1700000000, "model": "m\"od\u00e9l"}
    event = ChunkEvents(head).event(choice)
    assert event == sse_event({**head, "choices": [choice]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: "):-2]) == {**head, "choices": [choice]}


# ---- the app on injected engines ----------------------------------------------------------------------------
def test_app_engine_death_gives_500_then_health_503():
    engine = make_engine()
    app = build_app(registry=ModelRegistry.from_engines({"tiny": engine}))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            assert (await client.get("/health")).status_code == 200
            assert metric_value((await client.get("/metrics")).text, "novainfer:engine_alive", model_name="tiny") == 1
            ok = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200
            _break_after(engine, 2)
            failed = await client.post("/v1/completions",
                                       json={"prompt": "Hi", "max_tokens": 50, "ignore_eos": True})
            assert failed.status_code == 500
            error = failed.json()["error"]
            assert error["type"] == "server_error" and "Traceback" not in failed.text
            health = await client.get("/health")
            assert health.status_code == 503 and "simulated device failure" in health.json()["error"]["message"]
            assert metric_value((await client.get("/metrics")).text, "novainfer:engine_alive", model_name="tiny") == 0
            refused = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503
            stream = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "stream": True})
            assert stream.status_code == 503

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_app_engine_death_mid_stream_ends_the_stream_with_an_error_event():
    engine = make_engine()
    app = build_app(registry=ModelRegistry.from_engines({"tiny": engine}))
    _break_after(engine, 3)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50, "ignore_eos": True,
                "stream": True})
            assert response.status_code == 200  # the failure came after the stream started
            events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "server_error" and "simulated device failure" in error["message"]
            assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
            assert (await client.get("/health")).status_code == 503

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_app_unexpected_error_is_a_generic_500(monkeypatch):
    engine = make_engine()
    app = build_app(registry=ModelRegistry.from_engines({"tiny": engine}))
    from novainfer.entrypoints.openai import serving_completion

    def explode(*args, **kwargs):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(serving_completion, "tokenize_prompts", explode)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            response = await client.post("/v1/completions", json={"prompt": "Hi"}, headers={"X-Request-Id": "r-1"})
            assert response.status_code == 500
            assert response.headers["X-Request-Id"] == "r-1"
            error = response.json()["error"]
            assert error["request_id"] == "r-1" and "secret" not in response.text and "Traceback" not in response.text

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


# ---- sessions -------------------------------------------------------------------------------------------------
def test_session_store_lru_and_ttl():
    now = [0.0]
    store = SessionStore(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    store.save("p", "a", "m", [{"role": "user", "content": "1"}])
    store.save("p", "b", "m", [])
    assert store.get("p", "a") is not None  # reading does not count as use: a turn that completes saves
    store.save("p", "c", "m", [])  # evicts the least recently saved: a
    assert [s.id for s in store.list("p")] == ["c", "b"]
    now[0] = 5.0
    store.save("p", "b", "m", [{"role": "user", "content": "2"}])
    now[0] = 12.0  # c idle for 12 s > ttl; b for 7 s
    assert store.get("p", "c") is None and store.get("p", "b") is not None
    assert store.delete("p", "b") and not store.delete("p", "b") and len(store) == 0
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)


def test_session_store_owners_are_separate():
    store = SessionStore(max_sessions=3)
    mine = store.create("alice", "m")
    assert len(mine.id) == 32 and int(mine.id, 16) >= 0 and store.create("alice", "m").id != mine.id
    store.save("bob", mine.id, "m", [{"role": "user", "content": "bob's"}])  # same id, other namespace
    assert store.get("alice", mine.id).messages == []
    for i in range(10):  # bob fills and overflows his own quota only
        store.save("bob", f"s{i}", "m", [])
    assert len(store.list("bob")) == 3 and store.get("alice", mine.id) is not None
    assert store.delete("alice", mine.id) and store.get("alice", mine.id) is None
    assert [s.id for s in store.list("carol")] == []


# ---- admission ------------------------------------------------------------------------------------------------
class _FakeEngine:
    def __init__(self, waiting: int = 0, tokens: int = 0) -> None:
        from novainfer.engine.async_llm_engine import EngineLoad

        self.load = EngineLoad(0, waiting, tokens)

    def get_load(self):
        return self.load


def test_admission_bounds_reservations_and_clients():
    controller = AdmissionController(AdmissionLimits(max_waiting_requests=4, max_queued_prompt_tokens=100,
                                                     max_concurrent_per_client=2, retry_after_s=3))
    engine = _FakeEngine(waiting=1)
    first = controller.admit("m", engine, "ip:1", num_seqs=2, num_prompt_tokens=10)
    with pytest.raises(OpenAIError) as info:  # 1 waiting + 2 reserved + 2 > 4
        controller.admit("m", engine, "ip:2", num_seqs=2, num_prompt_tokens=10)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "3"
    first.submitted(2, 10)  # the engine now counts them (here: it does not, so room appears)
    second = controller.admit("m", engine, "ip:1", num_seqs=1, num_prompt_tokens=10)
    with pytest.raises(OpenAIError) as info:
        controller.admit("m", engine, "ip:1", num_seqs=1, num_prompt_tokens=10)
    assert info.value.code == "client_concurrency_limit"
    with pytest.raises(OpenAIError) as info:
        controller.admit("m", engine, "ip:3", num_seqs=5, num_prompt_tokens=1)
    assert info.value.status == 400
    with pytest.raises(OpenAIError) as info:
        controller.admit("m", _FakeEngine(tokens=95), "ip:3", num_seqs=1, num_prompt_tokens=10)
    assert info.value.status == 429 and "prompt tokens" in info.value.message
    first.release()
    second.release()
    second.release()  # idempotent
    assert controller.admit("m", engine, "ip:1", 1, 1) is not None


# ---- command line ---------------------------------------------------------------------------------------------
def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_serve_command_line():
    config = server_config_from(_parse())
    assert [s.name for s in config.models] == ["SmolLM2-135M-Instruct"] and config.models[0].engine_args.model is None
    assert [s.name for s in server_config_from(_parse("tiny")).models] == ["novainfer-tiny"]
    assert (config.host, config.port, config.api_keys) == ("127.0.0.1", 8000, [])

    config = server_config_from(_parse("dirA", "--model", "dirB", "--served-model-name", "a", "--port", "9001",
                                       "--api-key", "k", "--max-num-seqs", "8", "--max-waiting-requests", "3",
                                       "--session-ttl", "60", "--api-key", "k2", "--api-key", "k"))
    assert [(s.name, s.engine_args.model) for s in config.models] == [("a", "dirA"), ("dirB", "dirB")]
    assert all(s.engine_args.max_num_seqs == 8 for s in config.models)
    assert config.limits.max_waiting_requests == 3 and config.session_ttl_s == 60
    assert config.api_keys == ["k", "k2"]

    with pytest.raises(ValueError, match="served-model-name"):
        server_config_from(_parse("dirA", "--served-model-name", "a", "--served-model-name", "b"))
    with pytest.raises(ValueError, match="unique"):
        ModelRegistry(server_config_from(_parse("d", "--model", "d")).models)


# ---- start-up ---------------------------------------------------------------------------------------------------
def test_health_is_503_while_loading():
    from novainfer.entrypoints.openai.served_models import ModelSpec

    app = build_app(registry=ModelRegistry([ModelSpec("m", EngineArgs())]))  # never loaded

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            health = await client.get("/health")
            assert health.status_code == 503 and "loading" in health.json()["error"]["message"]
            busy = await client.post("/v1/completions", json={"prompt": "x"})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "not_ready"
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "m"

    asyncio.run(main())


@pytest.mark.parametrize("api_server_count", [1, 2])
def test_serve_exits_nonzero_when_a_model_cannot_load(tmp_path, api_server_count):
    import subprocess
    import sys

    from tests.test_server_support import REPO_ROOT, free_port

    proc = subprocess.run([sys.executable, "-m", "novainfer.entrypoints.cli.main", "serve", str(tmp_path / "missing"),
                           "--port", str(free_port()), "--api-server-count", str(api_server_count)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr.split("loading the models failed")[0]
    if api_server_count == 1:  # the model loads after the server listens
        assert proc.returncode == 1, proc.stderr


class RecordingTokenizer:
    """A tokenizer whose batch calls are recorded; the first one waits for ``release`` (so that
    later requests queue up behind it). A text holding "bad" cannot be encoded."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()

    def __call__(self, texts: list[str], add_special_tokens: bool, return_attention_mask: bool) -> dict:
        assert add_special_tokens is False and return_attention_mask is False
        self.batches.append(list(texts))
        if len(self.batches) == 1:
            assert self.release.wait(10)
        if any("bad" in t for t in texts):
            raise ValueError("cannot encode")
        return {"input_ids": [[len(t), ord(t[0])] for t in texts]}


def test_texts_waiting_for_the_tokenizer_thread_are_encoded_in_one_batch_call():
    """Oracle: each request's ids are its own texts' (the batch is split back in order), requests
    that arrive while the thread is busy share its next call, and a text the tokenizer refuses
    fails only its own request."""
    tokenizer = RecordingTokenizer()
    model = ServedModel("m", engine=None, tokenizer=tokenizer, max_model_len=8, vocab_size=8)

    async def main():
        first = asyncio.ensure_future(model.encode(["a"]))
        await asyncio.sleep(0.05)  # the thread is now inside the first call
        later = [asyncio.ensure_future(model.encode(texts)) for texts in (["bb", "ccc"], ["d"], ["e", "ffff"])]
        await asyncio.sleep(0.05)
        tokenizer.release.set()
        results = await asyncio.gather(first, *later)
        # A refused text: the batch fails, then each request is encoded alone.
        bad, good = model.encode(["bad"]), model.encode(["g"])
        return results, await asyncio.gather(bad, good, return_exceptions=True), await model.encode([])

    try:
        results, (bad, good), empty = asyncio.run(main())
    finally:
        model.tokenizer_thread.shutdown()
    assert results == [[[1, ord("a")]], [[2, ord("b")], [3, ord("c")]], [[1, ord("d")]], [[1, ord("e")], [4, ord("f")]]]
    assert [len(batch) for batch in tokenizer.batches[:2]] == [1, 5]  # three requests, one call
    assert isinstance(bad, ValueError) and good == [[1, ord("g")]] and empty == []


def test_batched_encoding_gives_the_ids_of_encode():
    """Oracle: the Qwen2 tokenizer's own ``encode`` of each text (special-token text parsed as
    special tokens, none added), against the batch call the tokenizer thread makes."""
    from tests._tokenizers import load_qwen2_tokenizer

    tokenizer = load_qwen2_tokenizer()
    model = ServedModel("m", engine=None, tokenizer=tokenizer, max_model_len=8, vocab_size=8)
    texts = ["Hello, world!", "<|im_start|>user\nnaïve café 東京 🙂<|im_end|>", " leading space",
             "x " * INLINE_TOKENIZER_SIZE, "line\n\n\ttab " * 700]

    async def main():
        return await asyncio.gather(model.encode(texts[:3]), model.encode(texts[3:]))

    try:
        short, long = asyncio.run(main())
    finally:
        model.tokenizer_thread.shutdown()
    assert short + long == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in short[1]


def test_small_tokenizer_work_runs_on_the_loop_and_long_work_on_the_tokenizer_thread():
    """A short prompt is encoded at once (a hand-off to a thread waits for the GIL behind the busy
    loop); a long one goes to the tokenizer thread so that the loop keeps serving streams."""
    model = ServedModel("m", engine=None, tokenizer=None, max_model_len=8, vocab_size=8)

    async def threads_used() -> tuple[str, str]:
        def where(text: str) -> str:
            return f"{threading.current_thread().name}:{len(text)}"
        small, large = "x" * INLINE_TOKENIZER_SIZE, "x" * (INLINE_TOKENIZER_SIZE + 1)
        return (await model.run_tokenizer(where, small, size=len(small)),
                await model.run_tokenizer(where, large, size=len(large)))

    try:
        small, large = asyncio.run(threads_used())
    finally:
        model.tokenizer_thread.shutdown()
    assert small == f"{threading.main_thread().name}:{INLINE_TOKENIZER_SIZE}"
    assert large.startswith("novainfer-tokenizer") and large.endswith(f":{INLINE_TOKENIZER_SIZE + 1}")


def test_latency_histogram_exposes_what_prometheus_reads_back():
    """Observations of several values at once, as Prometheus' own text parser reads them from the
    exposition, against counting each value by hand (a value on a bound falls in that bucket)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from novainfer.entrypoints.openai.metrics import LatencyHistogram

    bounds = (0.01, 0.1, 1.0)
    histogram = LatencyHistogram("gap_seconds", "Gaps.", bounds)
    registry = CollectorRegistry()
    registry.register(histogram)
    observed = {"a": [(0.005, 3), (0.01, 1), (0.5, 2), (7.0, 1)], "b": [(0.1, 4)]}
    for model, values in observed.items():
        for value, count in values:
            histogram.observe(model, value, count)
    [family] = text_string_to_metric_families(generate_latest(registry).decode())
    samples = {(s.name, s.labels["model_name"], s.labels.get("le")): s.value for s in family.samples}
    for model, values in observed.items():
        flat = [v for v, count in values for _ in range(count)]
        for bound in bounds:
            assert samples[("novainfer:gap_seconds_bucket", model, str(bound))] == sum(v <= bound for v in flat)
        assert samples[("novainfer:gap_seconds_bucket", model, "+Inf")] == len(flat)
        assert samples[("novainfer:gap_seconds_count", model, None)] == len(flat)
        assert samples[("novainfer:gap_seconds_sum", model, None)] == pytest.approx(sum(flat))
    with pytest.raises(ValueError, match="ascend"):
        LatencyHistogram("bad_seconds", "Bad.", (1.0, 0.5))


# ---- SSE responses ----------------------------------------------------------------------------------------
class _SSEClient:
    """The ASGI side of one streamed response: records what is sent; disconnects when told to."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def _run_sse(client: _SSEClient, chunks: int, disconnect_after: int | None):
    """Streams ``chunks`` events (the client leaves after ``disconnect_after`` of them); returns the
    response's task and what was closed."""
    from novainfer.entrypoints.openai.streaming import SSEResponse

    closed: list[str] = []

    async def body():
        try:
            for i in range(chunks):
                if i == disconnect_after:
                    client.gone.set()
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)
        finally:
            closed.append("body")

    response = SSEResponse(body(), on_close=lambda: closed.append("on_close"))
    task = asyncio.create_task(response({"type": "http", "asgi": {"version": "3.0"}}, client.receive, client.send))
    return task, closed


def test_sse_response_streams_every_event_and_closes():
    async def main():
        client = _SSEClient()
        task, closed = await _run_sse(client, 3, None)
        await asyncio.wait_for(task, 5)
        assert client.bodies() == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        assert client.sent[0]["type"] == "http.response.start" and closed == ["body", "on_close"]
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

    asyncio.run(main())


def test_sse_response_ends_quietly_when_the_client_disconnects():
    """A disconnect stops the stream where it is (no further event), runs the cleanups and ends the
    response without an error, as Starlette's own streaming response does."""
    async def main():
        client = _SSEClient()
        task, closed = await _run_sse(client, 1000, 2)
        await asyncio.wait_for(task, 5)
        assert len(client.bodies()) <= 4 and client.bodies()[-1] != b""  # never finished the body
        assert sorted(closed) == ["body", "on_close"] and not task.cancelled()

    asyncio.run(main())


def test_sse_response_task_cancelled_from_outside_stays_cancelled():
    async def main():
        client = _SSEClient()
        task, closed = await _run_sse(client, 1000, None)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(closed) == ["body", "on_close"]

    asyncio.run(main())


def test_api_server_processes_are_ready_only_together(tmp_path):
    """One of several API server processes that has attached to its engine core still reports
    'loading' until every other one has too (they share the listening socket, so a client may reach
    any of them), and then turns ready."""
    from novainfer.engine.core_client import CoreHandle
    from novainfer.engine.core_proc import start_core_process
    from novainfer.entrypoints.openai.served_models import LoadState, ModelSpec, ReadyBarrier

    args = EngineArgs(model=str(tiny_model()), kv_cache_memory_bytes=8 << 20)
    config = args.create_engine_config()
    channel = (f"ipc://{tmp_path / 'in'}", f"ipc://{tmp_path / 'out'}")
    process = start_core_process(config, [channel], "tiny", log_stats_interval=5.0)
    ready_dir = tmp_path / "ready"
    ready_dir.mkdir()
    registry = ModelRegistry([ModelSpec("tiny", args)], cores={"tiny": CoreHandle(config, channel, process.pid)},
                             ready_barrier=ReadyBarrier(str(ready_dir), 0, 2))
    try:
        registry.load_in_background()
        deadline = time.monotonic() + 60
        while not (ready_dir / "0").exists():  # attached: it marked itself ready
            assert time.monotonic() < deadline, "the registry never attached to its core"
            time.sleep(0.02)
        time.sleep(0.3)
        assert registry.state == LoadState.LOADING
        assert registry.health() == (False, "the server is loading its model(s)")
        ReadyBarrier(str(ready_dir), 1, 2).arrive()  # the other API server process has its models
        while registry.state != LoadState.READY:
            assert time.monotonic() < deadline, "the registry never turned ready"
            time.sleep(0.02)
        assert registry.health() == (True, "ok")
    finally:
        registry.shutdown()
        process.kill()
        process.join()
