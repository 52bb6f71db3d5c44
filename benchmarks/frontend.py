"""The front-end's host work per engine step, without a model: the output processor and the output text.

Two measurements, on synthetic core outputs (no engine, no GPU), of what runs on the host for every
engine step, beside the step on a GPU (or between steps, in one process):

* ``steps``: ``OutputProcessor.process_outputs`` for ``--requests`` requests that each get one
  token per step for ``--steps`` steps, with and without text and with and without ``--logprobs``
  (one step block of logprob rows per step, as the model runner sends), for outputs only at the end
  (``LLM.generate``: their texts decoded together once all finished, included in the time) and for a
  delta every step (a streamed request). Mean ms per step, the best of ``--repeats`` runs.
* ``text``: ``OutputTextState`` (incremental detokenization, stop strings, streaming deltas) per
  token at successive positions of one ``--text-tokens``-token output, streamed or read at the end,
  with and without a stop string: whether the cost per token grows with the output.
* ``logprobs_format``: the server's OpenAI logprobs object (chat and completions) of one streamed
  token with ``--logprobs`` alternatives, as a chunk serializes it: us per token.

    python benchmarks/frontend.py --tokenizer ../shared/data/qwen2_tokenizer
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arguments, load_average, run_facts, scrub_path, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the tiny model's)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=600, help="decode steps of the per-step measurement")
    p.add_argument("--logprobs", type=int, default=5, help="top logprobs per token where asked")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case; the best is reported")
    p.add_argument("--text-tokens", type=int, default=16000, help="tokens of the output-text measurement")
    p.add_argument("--text-buckets", type=int, default=4, help="position ranges reported per text case")
    p.add_argument("--seed", type=int, default=0)
    add_output_arguments(p, "frontend_cpu")
    args = p.parse_args(argv)
    if min(args.requests, args.steps, args.repeats, args.text_buckets) < 1 or args.logprobs < 0:
        p.error("--requests, --steps, --repeats and --text-buckets must be >= 1, --logprobs >= 0")
    if args.text_tokens < args.text_buckets:
        p.error("--text-tokens must be at least --text-buckets")
    return args


def step_messages(args: argparse.Namespace, with_logprobs: bool) -> list[Any]:
    """The core's outputs of ``--steps`` steps: every request one random token per step, the first
    step starting them all and the last finishing them all."""
    from novainfer.core.messages import EngineCoreOutputs
    from novainfer.outputs import StepLogprobs

    rng = random.Random(args.seed)
    n, width = args.requests, args.logprobs + 1
    ids = [f"r{i}" for i in range(n)]
    messages = []
    for step in range(args.steps):
        columns: dict[str, Any] = {}
        if step == 0:
            columns.update(started=list(range(n)), num_cached_tokens=[0] * n, first_scheduled_times=[0.0] * n)
        if step == args.steps - 1:
            columns.update(finished=list(range(n)), finish_reasons=["length"] * n, stop_reasons=[None] * n)
        if with_logprobs:
            block = StepLogprobs.of(width, [rng.randrange(300, 20000) for _ in range(n * width)],
                                    [-rng.random() * 5 for _ in range(n * width)], [1] * n)
            columns.update(with_logprobs=list(range(n)), logprobs_blocks=[block], logprobs_block_index=[0] * n,
                           logprobs_rows=list(range(n)))
        messages.append(EngineCoreOutputs(request_ids=ids, num_new_tokens=[1] * n,
                                          token_ids=[rng.randrange(300, 20000) for _ in range(n)],
                                          timestamp=float(step), **columns))
    return messages


def time_steps(tokenizer, messages: list[Any], args: argparse.Namespace, text: bool, logprobs: bool,
               streamed: bool) -> float:
    """Mean ms per step of OutputProcessor.process_outputs over ``messages`` for fresh requests."""
    from novainfer.core.messages import EngineCoreRequest
    from novainfer.engine.output_processor import OutputProcessor
    from novainfer.sampling_params import RequestOutputKind, SamplingParams

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True, detokenize=text,
                            logprobs=args.logprobs if logprobs else None)
    kind = RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY
    for i in range(args.requests):
        request = EngineCoreRequest(f"r{i}", [5, 6, 7], params, args.steps, 0.0)
        processor.add_request(f"r{i}", None, [5, 6, 7], kind, [request])
    started = time.perf_counter()
    if not streamed:  # as LLM.generate does: final texts decoded together at the end (timed here too)
        processor.batch_final_texts()
    for message in messages:
        processor.process_outputs(message)
    processor.decode_final_texts()
    return (time.perf_counter() - started) / len(messages) * 1e3


def time_text(tokenizer, args: argparse.Namespace, stop: tuple[str, ...], streamed: bool) -> list[float]:
    """Mean us per token of OutputTextState in each of ``--text-buckets`` position ranges."""
    from novainfer.engine.output_text import OutputTextState

    rng = random.Random(args.seed)
    ids = [rng.randrange(300, 20000) for _ in range(args.text_tokens)]
    state = OutputTextState(tokenizer, [5, 6, 7], stop=stop)
    size = args.text_tokens // args.text_buckets
    means = []
    for bucket in range(args.text_buckets):
        started = time.perf_counter()
        for token in ids[bucket * size:(bucket + 1) * size]:
            state.append_tokens([token])
            if streamed:
                state.take_delta(finished=False)
        means.append((time.perf_counter() - started) / size * 1e6)
    state.take_delta(finished=True)
    return means


def time_logprobs_format(args: argparse.Namespace, calls: int = 20000) -> dict[str, float]:
    """Mean us per streamed token of the chat and completions logprobs objects (plain data)."""
    from novainfer.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
    from novainfer.outputs import Logprob

    entry = {7: Logprob(-0.5, 1, " the")}
    for rank in range(1, args.logprobs + 1):
        entry.setdefault(100 + rank, Logprob(-0.5 * rank, rank, f" t{rank}"))
    means = {}
    for name, format_one in (("chat", chat_logprobs), ("completion", completion_logprobs)):
        started = time.perf_counter()
        for _ in range(calls):
            format_one([7], [entry], args.logprobs, None)
        means[name] = (time.perf_counter() - started) / calls * 1e6
    return means


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from novainfer.tiny_model import get_tiny_model_dir

    args = parse_args(argv)
    load_start = load_average()
    tokenizer_dir = args.tokenizer or get_tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    steps = []
    for logprobs in (False, True):
        messages = step_messages(args, logprobs)
        for streamed in (False, True):
            for text in (False, True):
                ms = min(time_steps(tokenizer, messages, args, text, logprobs, streamed) for _ in range(args.repeats))
                steps.append({"outputs": "delta every step" if streamed else "at the end", "text": text,
                              "logprobs": args.logprobs if logprobs else None, "ms_per_step": round(ms, 4),
                              "us_per_request_step": round(ms * 1e3 / args.requests, 3)})
                print(f"outputs {steps[-1]['outputs']:16s} text {text!s:5s} logprobs {logprobs!s:5s}: "
                      f"{ms:7.3f} ms per step")
    text_rows = []
    for stop in ((), ("zzqq",)):
        for streamed in (True, False):
            means = min((time_text(tokenizer, args, stop, streamed) for _ in range(args.repeats)), key=sum)
            text_rows.append({"stop": list(stop), "streamed": streamed,
                              "us_per_token_by_position": [round(m, 3) for m in means]})
            print(f"text stop={list(stop)!s:10s} streamed={streamed!s:5s}: us per token by position "
                  f"{[round(m, 2) for m in means]}")
    formats = {name: round(min(runs), 3) for name, runs in
               zip(("chat", "completion"), zip(*(time_logprobs_format(args).values() for _ in range(args.repeats))))}
    print(f"logprobs object of one streamed token, us: {formats}")
    facts = run_facts(None, load_start, argv, __file__)
    facts.pop("gpu")
    report = {"benchmark": "front-end host work per engine step (output processor, output text)", **facts,
              "workload": {"tokenizer": scrub_path(str(tokenizer_dir)), "requests": args.requests,
                           "steps": args.steps, "logprobs": args.logprobs, "repeats": args.repeats,
                           "text_tokens": args.text_tokens, "text_buckets": args.text_buckets,
                           "reported": "the best of the repeats"},
              "steps": steps, "text": text_rows, "logprobs_format_us_per_token": formats}
    path = write_results(args.output or "frontend_cpu", report, args.results_dir)
    print(f"wrote {path.name}")
    return report


if __name__ == "__main__":
    main()
