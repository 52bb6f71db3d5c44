"""``LLM(..., multiprocess=True)``: the engine core in a process of its own under the offline API
gives the same outputs as the in-process engine (the default), empties its prefix cache when
asked, and its process ends with ``shutdown`` or, for a script that never calls it, when the
script exits. One engine-core process also serves several front-ends at once."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap

import pytest

from novainfer import LLM, SamplingParams
from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.async_llm_engine import AsyncLLMEngine
from novainfer.engine.core import EngineCore
from novainfer.engine.core_client import CoreClient, CoreHandle, EngineDeadError
from novainfer.engine.core_proc import start_core_process
from tests.utils import tiny_model

KV_BYTES = 8 << 20


def test_multiprocess_llm_equals_in_process():
    prompts = ["Hello there", "A seeded sample", "Logprobs too"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    long_params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    local = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)
    try:
        assert not local.llm_engine.multiprocess and isinstance(local.llm_engine.engine_core, EngineCore)
        expected = local.generate(prompts, params, use_tqdm=False)
        expected_long = local.generate(prompts[0], long_params, use_tqdm=False)[0].outputs[0].token_ids
        check_prefix_cache_reset(local, long_params, expected_long)
    finally:
        local.shutdown()
    remote = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES, multiprocess=True)
    core = remote.llm_engine.engine_core
    try:
        assert core.pid is not None and core.is_alive()
        got = remote.generate(prompts, params, use_tqdm=False)
        streamed = "".join(o.outputs[0].delta_text for o in remote.generate_stream(prompts[0], params[0]))
        check_prefix_cache_reset(remote, long_params, expected_long)
    finally:
        remote.shutdown()
    assert not core.is_alive()
    for g, e in zip(got, expected):
        assert [(c.text, c.token_ids, c.finish_reason) for c in g.outputs] == \
            [(c.text, c.token_ids, c.finish_reason) for c in e.outputs]
    # Equal up to float32 rounding: the core's process may batch and thread its matmuls differently.
    assert [lp[t].logprob for t, lp in zip(got[2].outputs[0].token_ids, got[2].outputs[0].logprobs)] == \
        pytest.approx([lp[t].logprob for t, lp in zip(expected[2].outputs[0].token_ids,
                                                        expected[2].outputs[0].logprobs)], abs=1e-4)
    assert streamed == expected[0].outputs[0].text


def check_prefix_cache_reset(llm: LLM, long_params: SamplingParams, expected_long: list[int]) -> None:
    """A repeated prompt hits the core's prefix cache, and no longer after a reset; a reset while a
    request holds blocks does nothing, and the stream's outputs that came before its answer still
    arrive, in order."""
    def hits() -> int:
        return llm.llm_engine.get_stats().prefix_cache_hits_total

    prompt = {"prompt_token_ids": list(range(3, 67))}  # four blocks of 16
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt, short, use_tqdm=False)
    before = hits()
    llm.generate(prompt, short, use_tqdm=False)
    assert hits() > before
    assert llm.reset_prefix_cache() is True
    before = hits()
    llm.generate(prompt, short, use_tqdm=False)
    assert hits() == before
    stream = llm.generate_stream("Hello there", long_params)
    first = next(stream).outputs[0].delta_token_ids
    assert llm.reset_prefix_cache() is False  # 300 tokens still to go: the request holds its blocks
    assert first + [t for o in stream for t in o.outputs[0].delta_token_ids] == expected_long


def test_script_without_shutdown_exits(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        from novainfer import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM({str(tiny_model())!r}, kv_cache_memory_bytes={KV_BYTES}, multiprocess=True)
            out = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
            print(llm.llm_engine.engine_core.pid, len(out[0].outputs[0].token_ids), flush=True)
    """))
    # Without the exit handler this never returns: multiprocessing waits for the core, the core for us.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    core_pid, num_tokens = map(int, done.stdout.split())
    assert num_tokens == 3
    with pytest.raises(ProcessLookupError):  # the core process is gone (and reaped) as well
        os.kill(core_pid, 0)


def test_dropped_llm_stops_its_core_process():
    llm = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES, multiprocess=True)
    process = llm.llm_engine.engine_core._process
    assert process.is_alive()
    del llm
    gc.collect()
    process.join(30)
    assert not process.is_alive()


def test_one_engine_core_serves_several_front_ends(tmp_path):
    """Two front-ends attached to one engine-core process (as ``--api-server-count 2`` runs it):
    each gets exactly its own requests' outputs, equal to the in-process engine's; an abort on
    one leaves the other's requests running; once the core dies both fail promptly."""
    prompts = [f"front-end {i % 2}, request {i}: {'xyz' * (1 + i % 3)}" for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(8)]
    local = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)
    try:
        expected = [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)]
    finally:
        local.shutdown()
    config = EngineArgs(model=str(tiny_model()), kv_cache_memory_bytes=KV_BYTES).create_engine_config()
    channels = [(f"ipc://{tmp_path / f'in{i}'}", f"ipc://{tmp_path / f'out{i}'}") for i in range(2)]
    process = start_core_process(config, channels, "shared", log_stats_interval=5.0)

    async def collect(engine: AsyncLLMEngine, prompt: str, p: SamplingParams) -> list[int]:
        tokens = []
        async for output in engine.generate(prompt, p):
            tokens += output.outputs[0].delta_token_ids
        return tokens

    received: list[set[str]] = [set(), set()]  # the request ids in the messages each front-end got

    def record(step_outputs, ids: set[str]):
        def recording(message):
            outputs = step_outputs(message)
            ids.update(outputs.request_ids)
            return outputs
        return recording

    async def serve_both() -> tuple[list[list[int]], list[bool]]:
        engines = [AsyncLLMEngine.attach(CoreHandle(config, channel, process.pid), f"front-end {i}")
                   for i, channel in enumerate(channels)]
        for engine, ids in zip(engines, received):
            engine.core._step_outputs = record(engine.core._step_outputs, ids)
        aborted = await engines[0].add_request("aborted", "Aborted early",
                                               SamplingParams(max_tokens=500, ignore_eos=True))
        got = asyncio.gather(*(collect(engines[i % 2], prompt, p)
                               for i, (prompt, p) in enumerate(zip(prompts, params))))
        await aborted.__aiter__().__anext__()
        aborted.abort()
        results = await got
        process.kill()
        process.join()  # reaped, as the supervisor does: the pid is gone
        failures = []
        for engine in engines:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(collect(engine, "after the core died", params[0]), timeout=5)
            failures.append(engine.is_healthy)
            engine.shutdown()
        return results, failures

    try:
        results, healthy = asyncio.run(serve_both())
    finally:
        process.kill()
        process.join()
    assert results == expected
    assert healthy == [False, False]
    assert "aborted" in received[0] and len(received[0]) == 5 and len(received[1]) == 4
    assert not received[0] & received[1]


def test_a_burst_reaches_the_core_in_parts_while_it_is_admitted():
    """Requests added in one turn of the event loop go to the core in messages of a bounded size as
    they are added, not in one message once the whole burst is in; every output still equals the
    in-process engine's."""
    prompts = [f"burst request {i}: {'ab' * (i % 5)}" for i in range(70)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    args = EngineArgs(model=str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)
    local = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)
    try:
        expected = [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)]
    finally:
        local.shutdown()
    added = [0]  # add_request calls returned so far
    sent: list[tuple[int, int]] = []  # per message to the core: (requests in it, add_request calls returned by then)

    async def burst() -> list[list[int]]:
        engine = AsyncLLMEngine.from_engine_args(args)
        send = engine.core.add_requests

        def recording(requests):
            sent.append((len(requests), added[0]))
            send(requests)

        engine.core.add_requests = recording
        try:
            streams = []
            for i, prompt in enumerate(prompts):  # one turn of the loop: add_request never suspends
                streams.append(await engine.add_request(f"r{i}", prompt, params))
                added[0] += 1

            async def tokens(stream) -> list[int]:
                return [t async for output in stream for t in output.outputs[0].delta_token_ids]

            return await asyncio.gather(*(tokens(s) for s in streams))
        finally:
            engine.shutdown()

    assert asyncio.run(burst()) == expected
    assert sum(n for n, _ in sent) == len(prompts)
    assert len(sent) >= 3 and max(n for n, _ in sent) <= 32
    assert sent[0][1] < 32  # the first message left before the 32nd add_request returned


def test_a_core_that_stops_reading_fails_sends_instead_of_blocking(tmp_path):
    """A core that closed its end of the requests' socket while its process still runs (as it does
    when it stops): a send to it raises EngineDeadError after a short grace instead of blocking the
    caller (the API server's event loop) for good."""
    import threading
    import time

    import zmq

    from novainfer.engine.core import EngineCoreInfo
    from novainfer.engine.serial import CoreReady, core_message_encoder

    config = EngineArgs(model=str(tiny_model()), kv_cache_memory_bytes=KV_BYTES).create_engine_config()
    channel = (f"ipc://{tmp_path / 'in'}", f"ipc://{tmp_path / 'out'}")
    context = zmq.Context()
    requests, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock in (requests, outputs):
        sock.setsockopt(zmq.LINGER, 0)
    requests.connect(channel[0])
    outputs.connect(channel[1])
    outputs.send(core_message_encoder.encode(CoreReady(EngineCoreInfo(num_blocks=64, block_size=16))))
    # This process stands for the core, so it stays alive throughout.
    client = CoreClient(config, name="stopped", attached=CoreHandle(config, channel, os.getpid()))
    client.abort_requests(["while it reads"])
    assert requests.recv()  # the core got it
    requests.close()
    raised: list[BaseException] = []

    def send() -> None:
        # The sends right after the close may still go into the pipe being torn down (lost with it).
        deadline = time.monotonic() + 5
        try:
            while time.monotonic() < deadline:
                client.abort_requests(["after it stopped reading"])
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            raised.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(timeout=10)
    if sender.is_alive():  # no clean-up: it would wait for the blocked send's lock
        pytest.fail("the send blocked")
    try:
        assert len(raised) == 1 and isinstance(raised[0], EngineDeadError), raised
        assert "stopped reading requests" in str(raised[0])
        assert not client.is_alive()
        with pytest.raises(EngineDeadError):
            client.add_requests([])
    finally:
        client.shutdown()
        outputs.close()
        context.term()
