"""Time of one ``Sampler.forward`` call per sampling setting and batch size, against the sorting path.

Logits are random normal times ``--scale`` over ``--vocab-size`` entries in ``--dtype``; each
setting's rows have 300 output and 500 prompt tokens of history (for the penalties). For each
(setting, batch size) the sampler is called ``--warmup`` times, then ``--calls`` times, and the
mean wall time per call (device synchronised at the end) is recorded, with the same rows through
the sorting path: the torch stages over the whole vocabulary (penalties, temperature, top-k / top-p
masks on the sorted row, min-p, the exponential race, and logprobs from a log-softmax where asked),
which the CUDA kernels replace.

    python benchmarks/sampler.py                                # CPU, a small vocabulary
    python benchmarks/sampler.py --device cuda --vocab-size 151936 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arguments, load_average, run_facts, write_results

# Each setting: the SamplingParams of every row, or of alternating rows where a list of two is given.
SETTINGS: dict[str, dict[str, Any] | list[dict[str, Any]]] = {
    "greedy": dict(temperature=0.0),
    "temp0.6": dict(temperature=0.6),
    "topk50-topp0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "topp0.95": dict(temperature=0.8, top_p=0.95),
    "topp0.5": dict(temperature=0.8, top_p=0.5),
    "minp0.1": dict(temperature=1.0, min_p=0.1),
    "topp0.95-rep1.1": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
    "half-topk50-half-topp0.95": [dict(temperature=0.8, top_k=50), dict(temperature=0.8, top_p=0.95)],
    "greedy-logprobs5": dict(temperature=0.0, logprobs=5),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--scale", type=float, default=3.0, help="standard deviation of the logits")
    p.add_argument("--batch-sizes", default="1,16,256", help="comma-separated")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--sorting-calls", type=int, default=5, help="timed calls of the sorting path")
    add_output_arguments(p, "sampler_<device>_v<vocab-size>")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.settings = args.settings.split(",")
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown --settings {unknown}; known: {list(SETTINGS)}")
    return args


def mean_call_ms(fn: Callable[[], Any], warmup: int, calls: int, synchronize: Callable[[], None]) -> float:
    for _ in range(warmup):
        fn()
    synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    return (time.perf_counter() - started) / calls * 1e3


def sorting_path(logits, metadata):
    """The torch stages over the whole vocabulary (what the CUDA kernels replace): the tokens, and
    where the rows ask for logprobs, also (the sampled tokens' and the top alternatives' logprobs,
    the sampled tokens' ranks) from a [B, V] log-softmax."""
    import torch

    from novainfer.sample.sampler import (apply_penalties_and_min_tokens, exponential_draws, random_sample,
                                          sampling_probs)

    probs = sampling_probs(apply_penalties_and_min_tokens(logits, metadata).float(), metadata)
    drawn = random_sample(probs, exponential_draws(probs, torch.arange(logits.shape[-1], device=logits.device),
                                                   metadata))
    tokens = torch.where(metadata.is_greedy, logits.argmax(dim=-1), drawn)
    if metadata.max_num_logprobs is None:
        return tokens
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sampled = logprobs.gather(-1, tokens.unsqueeze(1))
    top = logprobs.topk(metadata.max_num_logprobs, dim=-1).values
    return tokens, torch.cat([sampled, top], dim=1), (logprobs > sampled).sum(dim=-1) + 1


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from novainfer.sample import Sampler, SamplingMetadata
    from novainfer.sampling_params import SamplingParams

    args = parse_args(argv)
    load_start = load_average()
    device = torch.device(args.device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    largest = max(args.batch_sizes)
    logits = (torch.randn(largest, args.vocab_size, generator=generator) * args.scale).to(getattr(torch, args.dtype))
    logits = logits.to(device)
    prompts = [torch.randint(0, args.vocab_size, (500,), generator=generator).tolist() for _ in range(largest)]
    outputs = [torch.randint(0, args.vocab_size, (300,), generator=generator).tolist() for _ in range(largest)]
    Sampler.warm_up(args.vocab_size, logits.dtype, device)
    sampler = Sampler()
    rows = []
    for name in args.settings:
        setting = SETTINGS[name]
        kinds = setting if isinstance(setting, list) else [setting]
        for batch in args.batch_sizes:
            params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(batch)]
            metadata = SamplingMetadata.from_requests(params, outputs[:batch], prompts[:batch], device,
                                                      args.vocab_size)
            part = logits[:batch]
            sampler_ms = mean_call_ms(lambda: sampler(part, metadata), args.warmup, args.calls, synchronize)
            sorting_ms = mean_call_ms(lambda: sorting_path(part, metadata), 1, args.sorting_calls, synchronize)
            rows.append({"setting": name, "batch_size": batch, "sampler_ms": round(sampler_ms, 4),
                         "sorting_path_ms": round(sorting_ms, 4)})
            print(f"{name:28s} B={batch:4d}: sampler {sampler_ms:8.3f} ms, sorting path {sorting_ms:8.3f} ms")
    facts = run_facts(device, load_start, argv, __file__)
    report = {"benchmark": "sampler (one Sampler.forward call)", "gpu": facts.pop("gpu"), **facts,
              "workload": {"vocab_size": args.vocab_size, "dtype": args.dtype, "logits_scale": args.scale,
                           "history": {"prompt_tokens": 500, "output_tokens": 300}, "warmup": args.warmup,
                           "calls": args.calls, "sorting_calls": args.sorting_calls},
              "results": rows}
    path = write_results(args.output or f"sampler_{device.type}_v{args.vocab_size}", report, args.results_dir)
    print(f"wrote {path.name}")
    return report


if __name__ == "__main__":
    main()
