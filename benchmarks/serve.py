"""Online serving benchmark in the style of ``vllm bench serve``: streaming requests against a server.

Prompts are the first turns of ShareGPT conversations (``../shared/data/sharegpt_v3_first_turns_500.json``
relative to the repository root, when present) or random words. Requests arrive as a Poisson
process, optionally capped at ``--max-concurrency`` in flight; ``--request-rates`` lists the rates
(requests per second; ``inf``: all at once) measured one after the other against the same server.
Every request streams (``stream_options.include_usage``) with a fixed ``--output-len`` and
``ignore_eos``, so each produces exactly that many tokens. Each rate's prompts start with a tag of
their own (``[0] ``, ``[1] ``, ...): a rate never finds the previous rates' prompts in the server's
prefix cache, so its figures do not depend on the order of the rates.

Reported per rate: request throughput, output and total token throughput, TTFT (time to first
token), TPOT (time per output token after the first), ITL (gap between streamed chunks) and E2E
latency, each as mean / median / p99 in milliseconds, and the CPU time of this client process
(user + system) as a share of the wall time: well under one core means a faster client would not
change the figures. For a server started here, also the CPU seconds of each of its processes (the
started one, and the engine cores and further API servers below it). ``--rounds N`` runs the whole
list of rates N times on the same server, each round with prompts of its own: the first round is
what a fresh server gives, the later ones a warm server.

``--offline-companion``: once the started server has stopped (its device memory is free), the same
prompts go through ``novainfer.LLM.generate`` in this process, with the engine arguments the server
parsed from the same flags (model, device, dtype, tokenizer, ``--server-args``), the same
``max_tokens`` with ``ignore_eos``, and text tokenized as the completions endpoint does (the chat
endpoint: through the model's chat template, as ``LLM.chat``). Reported: the offline output tok/s and,
per rate, served output tok/s over it; at the ``inf`` rate (all requests at once) that ratio is the
cost of serving over HTTP. The offline prompts carry the tag of the ``inf`` rate (else of the first).

    python benchmarks/serve.py                                 # starts a tiny-model server on CPU
    python benchmarks/serve.py --arch qwen2-0.5b --device cuda --tokenizer ../shared/data/qwen2_tokenizer \
        --num-prompts 500 --max-input-tokens 1024 --output-len 256 --request-rates 8,32,128,inf --offline-companion
    python benchmarks/plot_serve.py benchmarks/results/serve_cuda_qwen2-0.5b.json   # the PNG next to it
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model-name my-model --num-prompts 200
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shlex
import signal
import statistics
import math
from collections import Counter
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from novainfer.engine.arg_utils import EngineArgs
from novainfer.entrypoints.openai.server_process import ServerProcess, process_tree_cpu
from benchmarks.common import REPO_ROOT, add_model_arguments, add_output_arguments, host_probe, load_average, \
    resolve_model_args, run_facts, scrub_path, write_results

DEFAULT_DATASET = REPO_ROOT.parent / "shared" / "data" / "sharegpt_v3_first_turns_500.json"
_WORDS = ("the model reads a book about history science music and mathematics then answers questions "
          "politely and briefly while the engine batches requests and streams tokens").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default=None,
                        help="benchmark this running server (default: start `novainfer serve` on a free port)")
    target.add_argument("--tokenizer", default=None,
                        help="tokenizer directory for the started server (default: the model's; an --arch model "
                             "has none of its own)")
    target.add_argument("--model-name", default=None,
                        help="served model name to request (default: the server's first model)")
    target.add_argument("--api-key", default=None)
    target.add_argument("--server-args", default="",
                        help="extra flags for the started server, e.g. '--max-num-seqs 64 --device cuda'")
    target.add_argument("--server-log", default=None, metavar="PATH",
                        help="run the started server at log level DEBUG and write its output here after the "
                             "sweep (the engine core's line per step: batch, prompt and decode tokens, step ms)")
    add_model_arguments(p)
    load = p.add_argument_group("workload")
    load.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    load.add_argument("--dataset", default=None,
                      help="ShareGPT-style JSON (default: the shared first-turns file when present, else random)")
    load.add_argument("--num-prompts", type=int, default=64)
    load.add_argument("--max-input-tokens", type=int, default=256,
                      help="prompts are cut to at most this many words (keeps CPU runs short)")
    load.add_argument("--random-input-words", type=int, default=64, help="words per random prompt")
    load.add_argument("--output-len", type=int, default=32, help="max_tokens of every request (EOS ignored)")
    load.add_argument("--request-rates", "--request-rate", dest="request_rates", type=parse_rates, default="inf",
                      metavar="RATES", help="Poisson arrival rates in requests/s, comma-separated and measured in "
                                            "turn against the same server, e.g. 8,32,128,inf (inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--client-processes", type=int, default=4,
                      help="processes sending the requests (round-robin over one arrival schedule), so that "
                           "parsing the streams is not what limits the measured rate")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--rounds", type=int, default=1,
                      help="times the whole list of rates runs on the same server, each round with prompts of its "
                           "own (no prefix-cache hits across rounds): the first round shows a fresh server, later "
                           "ones a warm one")
    p.add_argument("--save-detailed", action="store_true",
                   help="also record each request's timeline in the results (sent, headers, first token, end, "
                        "in seconds after the rate's start): where a burst's requests wait")
    p.add_argument("--offline-companion", action="store_true",
                   help="after the started server stops, run the same prompts through LLM.generate with the "
                        "server's engine arguments and report served / offline output throughput")
    p.add_argument("--offline-repeats", type=int, default=3,
                   help="runs of the offline companion; its figure is their median")
    add_output_arguments(p, "serve_<device>_<model>")
    p.add_argument("--commit", default=None, help="commit to record (default: asks git)")
    args = p.parse_args(argv)
    if args.offline_repeats < 1:
        p.error(f"--offline-repeats must be >= 1, got {args.offline_repeats}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.num_prompts < 1 or args.output_len < 1:
        p.error("--num-prompts and --output-len must be >= 1")
    if args.client_processes < 1:
        p.error("--client-processes must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.offline_companion and args.base_url:
        p.error("--offline-companion needs the server this benchmark starts (its engine arguments), not --base-url")
    return args


def parse_rates(text: str) -> list[float]:
    """``"8,32,inf"`` -> ``[8.0, 32.0, inf]``: distinct request rates, each > 0."""
    rates = []
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"request rate {item!r} is not a number or inf") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"request rate {item!r} must be > 0 (inf: all at once)")
        if rate in rates:
            raise argparse.ArgumentTypeError(f"request rate {item!r} is listed twice in {text!r}")
        rates.append(rate)
    return rates


def rate_label(rate: float) -> float | str:
    """A rate as JSON holds it: ``"inf"`` (JSON has no infinity) or the number."""
    return "inf" if math.isinf(rate) else rate


# ---- workload ----------------------------------------------------------------------------------------
def load_prompts(args: argparse.Namespace) -> tuple[list[str], str]:
    """``num_prompts`` prompts and a description of where they came from."""
    rng = random.Random(args.seed)
    path = Path(args.dataset) if args.dataset else DEFAULT_DATASET
    if path.is_file():
        data = json.loads(path.read_text())
        texts = [conv["conversations"][0]["value"] for conv in data
                 if conv.get("conversations") and conv["conversations"][0].get("value", "").strip()]
        rng.shuffle(texts)
        prompts = [" ".join(t.split()[: args.max_input_tokens]) for t in texts[: args.num_prompts]]
        while len(prompts) < args.num_prompts:  # small datasets repeat
            prompts.append(prompts[len(prompts) % max(1, len(texts))])
        return prompts, f"sharegpt: {_display_path(path)}"
    if args.dataset:
        raise SystemExit(f"--dataset {args.dataset!r} does not exist")
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(args.random_input_words)) for _ in range(args.num_prompts)]
    return prompts, f"random: {args.random_input_words} words per prompt"


def _display_path(path: Path) -> str:
    """A path for the results file: relative to the repository when near it, never absolute."""
    resolved = path.resolve()
    for base, prefix in ((REPO_ROOT, ""), (REPO_ROOT.parent, "../")):
        try:
            return prefix + str(resolved.relative_to(base))
        except ValueError:
            continue
    scrubbed = scrub_path(str(resolved))
    return scrubbed if not Path(scrubbed).is_absolute() else resolved.name


# ---- one request ----------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    # Until the response's headers: the server sends them once it handed the request to its engine
    # (validated, tokenized, admitted), so TTFT minus this is the engine's part of the wait.
    headers: float | None = None
    e2e: float = 0.0
    sent_at: float = 0.0  # wall-clock time the request was sent (time.time(), comparable across processes)
    itl: list[float] = field(default_factory=list)
    itl_ends: list[float] = field(default_factory=list)  # seconds after sending at which each gap of itl ended


async def send_request(client, args: argparse.Namespace, model: str, prompt: str) -> RequestResult:
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt}
    body.update(model=model, max_tokens=args.output_len, ignore_eos=True, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
    result = RequestResult(sent_at=time.time())
    started = time.perf_counter()
    last = started
    try:
        async with client.stream("POST", path, json=body) as response:
            result.headers = time.perf_counter() - started
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for data in sse_data(response):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(_carries_tokens(c) for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                        result.itl_ends.append(now - started)
                    last = now
    except Exception as exc:  # a failed request is a result, not a crash of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - started
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def sse_data(response: Any) -> AsyncIterator[str]:
    """The data of each server-sent event of a streamed response. A line ends at "\n" only, as the
    server writes them: ``aiter_lines`` also ends one at every Unicode line boundary (U+2028, U+0085,
    ...), which generated text may hold inside a JSON string."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            if line.startswith("data: "):
                yield line[len("data: "):]


def _carries_tokens(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice delivers generated tokens: text, or the finish of a request whose text the
    server held back to the end (tokens that end inside a UTF-8 character stream no text of their own).
    A chat stream's opening role-only chunk carries none."""
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content") or choice.get("finish_reason"))


def run_sweep(args: argparse.Namespace, base_url: str, model: str, prompts: list[str],
              server_pid: int | None = None) -> list[dict[str, Any]]:
    """Every rate of ``--request-rates`` in turn, ``--rounds`` times, from ``--client-processes`` client
    processes (the same ones for every rate, each after one warm-up request): a summary per rate and round.
    With ``server_pid`` (a server started here), each summary has the server processes' CPU time too."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    count = min(args.client_processes, len(prompts))
    context = multiprocessing.get_context("spawn")  # no copy of a parent's threads or event loop
    with ProcessPoolExecutor(count, mp_context=context) as pool:
        list(pool.map(_client_share, [ClientShare(args, base_url, model, ["warm up"], [0.0], time.time())] * count))
        schedule = [(k + 1, rate) for k in range(args.rounds) for rate in args.request_rates]
        runs = []
        for i, (k, rate) in enumerate(schedule):
            cpu_before = process_tree_cpu(server_pid) if server_pid is not None else {}
            probe_before = host_probe()["wall_ms"]
            run = {"round": k, **run_rate(pool, count, args, base_url, model, tag_prompts(prompts, i), rate)}
            # The host's speed around the rate, seen from this process (see benchmarks/common.py).
            run["host_probe_ms"] = [probe_before, host_probe()["wall_ms"]]
            if cpu_before:
                run["server_cpu"] = server_cpu(server_pid, cpu_before, process_tree_cpu(server_pid),
                                               run["duration_s"])
            runs.append(run)
        return runs


def tag_prompts(prompts: list[str], index: int) -> list[str]:
    """The prompts of the ``index``-th rate, each behind that rate's tag: only repeats within a rate (and a
    chat template's shared start) hit the prefix cache, as they would in a server's first run."""
    return [f"[{index}] {prompt}" for prompt in prompts]


def compared_rate_index(rates: list[float]) -> int:
    """The rate whose prompts the offline companion runs: the burst (``inf``) if measured, else the first."""
    return rates.index(math.inf) if math.inf in rates else 0


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of ``rate`` requests/s (the
    same draws for every rate), or all at 0 for ``inf``."""
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for i in range(count):
        if i and not math.isinf(rate):
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


@dataclass
class ClientShare:
    """What one client process sends: its prompts, when (seconds after ``start_at``, a ``time.time()``)."""

    args: argparse.Namespace
    base_url: str
    model: str
    prompts: list[str]
    offsets: list[float]
    start_at: float
    max_concurrency: int | None = None


def run_rate(pool, count: int, args: argparse.Namespace, base_url: str, model: str, prompts: list[str],
             rate: float) -> dict[str, Any]:
    """All prompts on one Poisson schedule, dealt round-robin to ``count`` client processes that start
    together; ``--max-concurrency`` is split between them."""
    offsets = arrival_offsets(len(prompts), rate, args.seed)
    limit = -(-args.max_concurrency // count) if args.max_concurrency else None
    start_at = time.time() + 0.5  # every process is waiting by then
    shares = [ClientShare(args, base_url, model, prompts[k::count], offsets[k::count], start_at, limit)
              for k in range(count)]
    outcomes = list(pool.map(_client_share, shares))
    duration = max(end for _, end, _ in outcomes) - start_at
    results = [r for share_results, _, _ in outcomes for r in share_results]
    cpu = [c for _, _, c in outcomes]
    summary = {"request_rate": rate_label(rate), **summarize(results, duration), **timeline(results, start_at),
               "itl_long_gaps": long_itl_gaps(results, start_at), "client_cpu": client_cpu(cpu, duration)}
    if args.save_detailed:
        # The rate's start as a Unix time, to set the requests' moments against a server log's timestamps.
        summary["start_at_unix"] = round(start_at, 4)
        summary["requests"] = [request_timeline(r, start_at) for r in sorted(results, key=lambda r: r.sent_at)]
    return summary


def _client_share(share: ClientShare) -> tuple[list[RequestResult], float, float]:
    """One client process's part of a rate: (results, when its last request ended, its CPU seconds)."""
    # The previous rate's objects, collected now rather than by a full pass in the middle of this rate:
    # on a small machine that pass took CPU from the server (every second round of a burst lost 10%).
    gc.collect()
    cpu_start = time.process_time()
    results, ended = asyncio.run(_send_share(share))
    return results, ended, time.process_time() - cpu_start


async def _send_share(share: ClientShare) -> tuple[list[RequestResult], float]:
    import httpx

    args = share.args
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(share.max_concurrency) if share.max_concurrency else None
    async with httpx.AsyncClient(base_url=share.base_url, headers=headers, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:
        async def send_at(prompt: str, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, share.start_at + offset - time.time()))
            if semaphore is None:
                return await send_request(client, args, share.model, prompt)
            async with semaphore:
                return await send_request(client, args, share.model, prompt)

        results = await asyncio.gather(*(send_at(p, o) for p, o in zip(share.prompts, share.offsets)))
    return list(results), time.time()


def client_cpu(seconds: list[float], wall: float) -> dict[str, Any]:
    """The client processes' CPU seconds (the server's are its own processes') and their share of the wall
    time: 1.0 is one core busy throughout. Each client process is one thread, so a process near 1.0 would
    be the limit; the busiest one is reported."""
    return {"processes": len(seconds), "total_s": round(sum(seconds), 3),
            "fraction_of_wall": round(sum(seconds) / wall, 4),
            "busiest_process_fraction_of_wall": round(max(seconds) / wall, 4)}


def server_cpu(root: int, before: dict[int, float], after: dict[int, float], wall: float) -> dict[str, Any]:
    """The server's processes' CPU seconds over a rate: the started process ``root`` (the API server, or
    the supervisor of several) and, busiest first, the processes below it (engine cores, their workers,
    more API servers). A process near the wall time (one core, for a one-thread loop) is a limit. A process
    that ended during the rate counts nothing."""
    spent = {p: after.get(p, before.get(p, 0.0)) - before.get(p, 0.0) for p in before.keys() | after.keys()}
    children = sorted((s for p, s in spent.items() if p != root), reverse=True)
    return {"started_process_s": round(spent.get(root, 0.0), 3), "children_s": [round(s, 3) for s in children],
            "total_s": round(sum(spent.values()), 3), "fraction_of_wall": round(sum(spent.values()) / wall, 4)}


# ---- statistics -----------------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": round(1e3 * statistics.fmean(values), 3), "median": round(1e3 * statistics.median(values), 3),
            "p99": round(1e3 * _percentile(values, 99), 3)}


def timeline(results: list[RequestResult], start_at: float) -> dict[str, float | None]:
    """When, after the rate's start, the last request was sent and the first and last tokens came: a
    burst's duration is the server's admission, its steps and the delivery of the last tokens."""
    ok = [r for r in results if r.ok]
    if not ok:
        return {"last_request_sent_s": None, "first_token_s": None, "last_token_s": None}
    return {"last_request_sent_s": round(max(r.sent_at for r in results) - start_at, 3),
            "first_token_s": round(min(r.sent_at + r.ttft for r in ok) - start_at, 3),
            "last_token_s": round(max(r.sent_at + r.e2e for r in ok) - start_at, 3)}


def long_itl_gaps(results: list[RequestResult], start_at: float, window_s: float = 0.01,
                  top: int = 5) -> dict[str, Any]:
    """Where the inter-token gaps at or above the p99 end, to tell what makes the p99: gaps that end
    before the last request's first token (streams waiting while others are admitted and prefilled),
    gaps that end together in one ``window_s`` window (a stall of the server that held many streams
    at once: a long step, a long turn of the API process's event loop) or scattered ones (single streams:
    a client's or a connection's delay). Times in seconds after the rate's start."""
    ok = [r for r in results if r.ok]
    gaps = [(gap, r.sent_at + end - start_at) for r in ok for gap, end in zip(r.itl, r.itl_ends)]
    if not gaps:
        return {"threshold_ms": None, "count": 0}
    threshold = _percentile([gap for gap, _ in gaps], 99)
    ends = [at for gap, at in gaps if gap >= threshold]
    last_first_token = max(r.sent_at + r.ttft for r in ok) - start_at
    windows = Counter(int(at // window_s) for at in ends)
    return {"threshold_ms": round(1e3 * threshold, 3), "count": len(ends),
            "last_first_token_s": round(last_first_token, 3),
            "ending_before_last_first_token": sum(at <= last_first_token for at in ends),
            "in_windows_of_10_or_more": sum(n for n in windows.values() if n >= 10), "window_ms": 1e3 * window_s,
            "top_windows": [{"ends_s": round(w * window_s, 3), "gaps": n} for w, n in windows.most_common(top)]}


def request_timeline(result: RequestResult, start_at: float) -> dict[str, Any]:
    """One request's moments in seconds after the rate's start (None where it never got there)."""
    sent = result.sent_at - start_at

    def after(seconds: float | None) -> float | None:
        return None if seconds is None else round(sent + seconds, 4)

    return {"sent_s": round(sent, 4), "headers_s": after(result.headers), "first_token_s": after(result.ttft),
            "end_s": after(result.e2e if result.ok else None), "output_tokens": result.output_tokens,
            "error": result.error}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    errors = sorted({r.error for r in results if r.error})
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
        "duration_s": round(duration, 3),
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput_per_s": round(len(ok) / duration, 3),
        "output_throughput_tok_per_s": round(output_tokens / duration, 2),
        "total_token_throughput_tok_per_s": round((prompt_tokens + output_tokens) / duration, 2),
        "ttft_ms": _summary_ms([r.ttft for r in ok if r.ttft is not None]),
        "time_to_headers_ms": _summary_ms([r.headers for r in ok if r.headers is not None]),
        "tpot_ms": _summary_ms(tpot),
        "itl_ms": _summary_ms([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": _summary_ms([r.e2e for r in ok]),
    }


# ---- the server under test -------------------------------------------------------------------------------
def server_flags(args: argparse.Namespace, device: str) -> list[str]:
    """The started server's flags: the model options given here, then ``--server-args``."""
    flags = ["--device", device]
    if args.dtype != "auto":
        flags += ["--dtype", args.dtype]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    return flags + shlex.split(args.server_args)


def start_server(model_dir: str, server_args: list[str], api_key: str | None,
                 log_level: str | None = None) -> tuple[ServerProcess, list[str]]:
    """The server and its command line as recorded in the results (paths scrubbed, no port)."""
    argv = [model_dir, *server_args, "--disable-log-requests"] + (["--api-key", api_key] if api_key else [])
    public_argv = ["serve", scrub_path(model_dir), *server_args, "--disable-log-requests"]
    return ServerProcess(argv, startup_timeout=600, cwd=REPO_ROOT, log_level=log_level), public_argv


def served_engine_args(model_dir: str, server_args: list[str]) -> EngineArgs:
    """The engine arguments ``novainfer serve MODEL_DIR SERVER_ARGS`` builds, parsed by the server's own
    command line (so unknown or bad flags fail here, before the server starts)."""
    from novainfer.entrypoints.cli.main import build_parser
    from novainfer.entrypoints.cli.serve import server_config_from

    return server_config_from(build_parser().parse_args(["serve", model_dir, *server_args])).models[0].engine_args


# ---- the offline companion --------------------------------------------------------------------------------
def run_offline(engine_args: EngineArgs, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """The prompts through ``LLM.generate`` (``LLM.chat`` for the chat endpoint) after one warm-up request,
    with the requests' sampling: greedy, ``--output-len`` tokens, EOS ignored, text detokenized as streamed.
    ``--offline-repeats`` runs of the whole set; the figure is their median (a burst lasts seconds, so one
    run is at the mercy of whatever else the machine does)."""
    from novainfer import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(**vars(engine_args))
    try:
        if args.endpoint == "chat":
            prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        llm.generate(prompts[:1], params, use_tqdm=False)
        durations, probes = [], []
        for _ in range(args.offline_repeats):
            probe_before = host_probe()["wall_ms"]
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            durations.append(time.perf_counter() - started)
            probes.append([probe_before, host_probe()["wall_ms"]])
    finally:
        llm.shutdown()
    duration = statistics.median(durations)
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"engine": "novainfer.LLM.generate",
            "engine_args": {k: scrub_path(v) if isinstance(v, str) else v for k, v in vars(engine_args).items()},
            "num_prompts": len(outputs), "duration_s": round(duration, 3),
            "durations_s_of_each_run": [round(d, 3) for d in durations], "host_probe_ms_of_each_run": probes,
            "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "request_throughput_per_s": round(len(outputs) / duration, 3),
            "output_throughput_tok_per_s": round(output_tokens / duration, 2),
            "ratio_definition": "per rate, output_throughput_vs_offline = served output tok/s / offline output tok/s"}


def first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


@dataclass
class Measurement:
    """What one invocation measured, and on what."""

    device: str
    tag: str  # the model's short name in the results file's name
    runs: list[dict[str, Any]]  # one summary per rate
    model_info: dict[str, Any] | None = None
    server_command: str | None = None
    offline: dict[str, Any] | None = None


def measure_remote(args: argparse.Namespace, prompts: list[str]) -> Measurement:
    base_url = args.base_url.rstrip("/")
    model = args.model_name or first_model(base_url, args.api_key)
    runs = run_sweep(args, base_url, model, prompts)
    return Measurement(args.device if args.device != "auto" else "unknown", "remote", runs)


def measure_started_server(args: argparse.Namespace, prompts: list[str]) -> Measurement:
    """The sweep against a server started here, then (``--offline-companion``) the offline run once it stopped."""
    from novainfer.config import resolve_device

    resolved = resolve_device(args.device)
    model_dir, tag, model_info = resolve_model_args(args, resolved)
    flags = server_flags(args, resolved.type)
    engine_args = served_engine_args(model_dir, flags)
    server_process, public_argv = start_server(model_dir, flags, args.api_key,
                                               log_level="DEBUG" if args.server_log else None)
    with server_process as server:
        model = args.model_name or first_model(server.base_url, args.api_key)
        runs = run_sweep(args, server.base_url, model, prompts, server.proc.pid)
        if args.server_log:
            Path(args.server_log).write_text(server.log())
    measured = Measurement(resolved.type, tag, runs, model_info, shlex.join(["novainfer", *public_argv]))
    if args.offline_companion:
        reference = compared_rate_index(args.request_rates)
        measured.offline = {"prompts_of_rate": rate_label(args.request_rates[reference]),
                            **run_offline(engine_args, args, tag_prompts(prompts, reference))}
        for run in runs:
            run["output_throughput_vs_offline"] = round(
                run["output_throughput_tok_per_s"] / measured.offline["output_throughput_tok_per_s"], 4)
    return measured


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompts, source = load_prompts(args)
    load_start = load_average()
    measured = measure_remote(args, prompts) if args.base_url else measure_started_server(args, prompts)
    facts = run_facts(measured.device, load_start, argv, __file__)
    report = {
        "benchmark": "serve (online, vllm bench serve shape)",
        "gpu": facts.pop("gpu"),
        **facts,
        "commit": args.commit or facts["commit"],
        "server_command": measured.server_command,
        "model": measured.model_info,
        "workload": {"endpoint": args.endpoint, "prompts": source, "num_prompts": args.num_prompts,
                     "max_input_words": args.max_input_tokens, "output_len": args.output_len, "ignore_eos": True,
                     "request_rates": [rate_label(r) for r in args.request_rates],
                     "max_concurrency": args.max_concurrency, "seed": args.seed, "stream": True,
                     "rounds": args.rounds},
        "results": measured.runs,
        "offline_companion": measured.offline,
    }
    path = write_results(args.output or f"serve_{measured.device}_{measured.tag}", report, args.results_dir)
    print_table(measured.runs, measured.offline)
    print(f"wrote {scrub_path(str(path))}")
    return report


def print_table(runs: list[dict[str, Any]], offline: dict[str, Any] | None) -> None:
    """One line per rate: throughput, TTFT and ITL percentiles, the client's CPU share; then the offline run."""
    print(f"{'round':>5} {'rate/s':>7} {'done':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p99 ms':>19} "
          f"{'ITL p50/p99 ms':>17} {'client CPU':>11}")
    for run in runs:
        ttft, itl = run["ttft_ms"], run["itl_ms"]
        print(f"{run['round']:>5} {run['request_rate']!s:>7} {run['completed']:>5} "
              f"{run['request_throughput_per_s']:>7.2f} {run['output_throughput_tok_per_s']:>10.1f} "
              f"{_pair(ttft):>19} {_pair(itl):>17} "
              f"{run['client_cpu']['busiest_process_fraction_of_wall']:>10.0%}")
        if run["failed"]:
            print(f"        {run['failed']} failed: {run['errors']}")
        if "server_cpu" in run:
            cpu = run["server_cpu"]
            print(f"        server CPU over {run['duration_s']} s: {cpu['started_process_s']} s in the started "
                  f"process, {', '.join(map(str, cpu['children_s']))} s in the processes below it")
        gaps = run["itl_long_gaps"]
        if gaps["count"]:
            print(f"        ITL gaps >= p99: {gaps['count']}, {gaps['ending_before_last_first_token']} ending before the "
                  f"last first token ({gaps['last_first_token_s']} s), {gaps['in_windows_of_10_or_more']} in "
                  f"{gaps['window_ms']:g} ms windows of 10 or more; most at {gaps['top_windows'][0]['ends_s']} s "
                  f"({gaps['top_windows'][0]['gaps']})")
    print("client CPU: the busiest client process's CPU time over the wall time (100% = its one core busy)")
    if offline is not None:
        ratios = ", ".join(f"{run['output_throughput_vs_offline']:.3f} at rate {run['request_rate']} (round "
                           f"{run['round']})" for run in runs)
        print(f"offline LLM.generate: {offline['output_throughput_tok_per_s']:.1f} output tok/s; "
              f"served / offline output throughput: {ratios}")


def _pair(summary: dict[str, float | None]) -> str:
    return "-" if summary["median"] is None else f"{summary['median']:.1f} / {summary['p99']:.1f}"


if __name__ == "__main__":
    # SIGTERM (a timeout, a job scheduler) unwinds like Ctrl-C, so the started server and the client
    # processes are stopped instead of left running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
