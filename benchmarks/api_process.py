"""The API server process's CPU per streamed token: what bounds a served burst once the engine is fast.

Under a burst the API process's event loop is busy nearly all the time (admitting requests, turning
each engine step's outputs into SSE chunks), so its CPU per streamed token caps the served rate.
This measures it without sockets or clients: it builds the OpenAI app over an engine core in its own
process, as ``novainfer serve`` does, and calls the ASGI app directly with bursts of
``--num-prompts`` streaming completions (EOS ignored). The API process's CPU time
(``time.process_time``: all of this process's threads; the engine core's process is not counted) is
taken for bursts of 1-token streams (admission and one chunk each) and of ``--output-len``-token
streams; their difference over the extra tokens is the streaming cost per token.

    python benchmarks/api_process.py                        # tiny model on CPU
    python benchmarks/api_process.py --num-prompts 500 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_model_arguments, add_output_arguments, load_average, resolve_model_args,
                               run_facts, write_results)
from benchmarks.serve import load_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    load = p.add_argument_group("workload")
    load.add_argument("--dataset", default=None,
                      help="ShareGPT-style JSON (default: the shared first-turns file when present, else random)")
    load.add_argument("--num-prompts", type=int, default=200)
    load.add_argument("--max-input-tokens", type=int, default=200, help="prompts are cut to this many words")
    load.add_argument("--random-input-words", type=int, default=64, help="words per random prompt")
    load.add_argument("--output-len", type=int, default=32, help="tokens of each stream of the long bursts")
    load.add_argument("--repeats", type=int, default=3, help="timed bursts of each length (after one warm-up)")
    load.add_argument("--seed", type=int, default=0)
    add_output_arguments(p, "api_process_<device>_<model>")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 2 or args.repeats < 1:
        p.error("--num-prompts and --repeats must be >= 1 and --output-len >= 2")
    return args


async def _stream(app: Any, body: bytes) -> None:
    """One streaming request through the ASGI app; raises unless it streamed to its end."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}
    request_sent, response_done = False, asyncio.Event()
    received: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await response_done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"the app answered {message['status']}")
        if message["type"] == "http.response.body":
            received.append(message.get("body", b""))
            if not message.get("more_body", False):
                response_done.set()

    await app(scope, receive, send)
    text = b"".join(received)
    # An error event's body starts with its "error" key (generated text may hold the word).
    if not text.endswith(b"data: [DONE]\n\n") or b'data: {"error"' in text:
        raise RuntimeError(f"a stream did not end normally: {text[-300:]!r}")


async def _bursts(model_dir: str, tokenizer: str | None, device: str, prompts: list[str], output_len: int,
                  repeats: int) -> dict[int, list[float]]:
    """API-process CPU seconds of each timed burst, by stream length (1 and ``output_len``)."""
    from novainfer.engine.arg_utils import EngineArgs
    from novainfer.engine.async_llm_engine import AsyncLLMEngine
    from novainfer.entrypoints.openai.api_server import build_app
    from novainfer.entrypoints.openai.served_models import ModelRegistry

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model_dir, tokenizer=tokenizer, device=device))
    try:
        app = build_app(registry=ModelRegistry.from_engines({"model": engine}))
        cpu: dict[int, list[float]] = {1: [], output_len: []}
        for length in cpu:
            bodies = [json.dumps({"model": "model", "prompt": p, "max_tokens": length, "stream": True,
                                  "ignore_eos": True}).encode() for p in prompts]
            for run in range(repeats + 1):  # the first is a warm-up
                started = time.process_time()
                await asyncio.gather(*(_stream(app, b) for b in bodies))
                if run:
                    cpu[length].append(time.process_time() - started)
        return cpu
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from novainfer.config import resolve_device

    args = parse_args(argv)
    load_at_start = load_average()
    device = resolve_device(args.device)
    model_dir, tag, summary = resolve_model_args(args, device)
    prompts, source = load_prompts(args)
    cpu = asyncio.run(_bursts(model_dir, args.tokenizer, str(device), prompts, args.output_len, args.repeats))
    short, long = statistics.median(cpu[1]), statistics.median(cpu[args.output_len])
    extra_tokens = args.num_prompts * (args.output_len - 1)
    figures = {"admission_and_one_token_cpu_s": round(short, 4), "burst_cpu_s": round(long, 4),
               "streaming_us_per_token": round((long - short) / extra_tokens * 1e6, 2),
               "cpu_us_per_token": round(long / (args.num_prompts * args.output_len) * 1e6, 2),
               "runs_cpu_s": {str(k): runs for k, runs in cpu.items()}}
    print(f"API process, {args.num_prompts} streams: admission + 1 token {short:.3f} s CPU, "
          f"{args.output_len} tokens {long:.3f} s CPU; streaming {figures['streaming_us_per_token']} us/token")
    results = {"benchmark": "API-process CPU per streamed token (ASGI app called directly, engine core in its own "
                            "process)",
               **run_facts(device, load_at_start, argv, __file__),
               "model": summary,
               "workload": {"num_prompts": args.num_prompts, "prompts": source, "output_len": args.output_len,
                            "repeats": args.repeats, "cpu": "medians of time.process_time() per burst"},
               "figures": figures}
    name = args.output or f"api_process_{device.type}_{tag}"
    print(f"results: {write_results(name, results, args.results_dir)}")
    return results


if __name__ == "__main__":
    main()
