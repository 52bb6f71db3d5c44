"""The scheduler's host work per engine step, without a model: ``schedule`` and ``update_from_output``.

``--requests`` requests with prompts of ``--prompt-len`` to ``--prompt-len + --requests - 1`` tokens
are admitted and prefilled, then every step decodes all of them: the steady state of a full batch,
whose scheduling runs on the host for every step beside the GPU's work (an engine step of a few
milliseconds pays it once). A fake runner gives each request one token per step, as the model
runner would. After ``--warmup`` steps, ``--repeats`` runs of ``--steps`` steps each time the two
calls; the best run's mean per step is reported (the host's other work only adds to a run).

    python benchmarks/scheduler.py
    python benchmarks/scheduler.py --requests 1024 --prefix-caching off
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arguments, load_average, run_facts, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=256, help="running requests (max_num_seqs)")
    p.add_argument("--prompt-len", type=int, default=300, help="tokens of the shortest prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-caching", default="on", choices=["on", "off"])
    p.add_argument("--warmup", type=int, default=50, help="decode steps before the timed ones")
    p.add_argument("--steps", type=int, default=200, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=10, help="timed runs; the best is reported")
    add_output_arguments(p, "scheduler_cpu")
    args = p.parse_args(argv)
    if min(args.requests, args.prompt_len, args.block_size, args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error("--requests, --prompt-len, --block-size, --steps and --repeats must be >= 1, --warmup >= 0")
    return args


def build_scheduler(args: argparse.Namespace):
    """A scheduler whose requests never finish within the run, every one of them admitted and prefilled."""
    from novainfer.core.kv_cache_manager import KVCacheManager
    from novainfer.core.sched.request import Request
    from novainfer.core.sched.scheduler import Scheduler, SchedulerConfig
    from novainfer.sampling_params import SamplingParams

    # Room for every step: the timed ones and those that admit and prefill the prompts (each a
    # decode step for the requests admitted before).
    max_prompt = args.prompt_len + args.requests - 1
    max_tokens = args.warmup + args.steps * args.repeats + args.requests * max_prompt // 8192 + 64
    max_model_len = max_prompt + max_tokens + 1
    num_blocks = args.requests * (-(-max_model_len // args.block_size))
    config = SchedulerConfig(max_num_batched_tokens=max(8192, max_prompt), max_num_seqs=args.requests,
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, args.block_size,
                                                 enable_prefix_caching=args.prefix_caching == "on"))
    for i in range(args.requests):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config([0])
        prompt = [(i * 7 + j) % 30000 + 1 for j in range(args.prompt_len + i)]
        scheduler.add_request(Request(f"r{i}", prompt, params, max_tokens=max_tokens))
    while len(scheduler.running) < args.requests or scheduler.waiting:
        step(scheduler)  # admission and prefill
    return scheduler


def step(scheduler) -> tuple[float, float]:
    """One step with a fake runner (each request whose known tokens are all computed gets token 7);
    returns the seconds of ``schedule`` and of ``update_from_output``."""
    requests = scheduler.requests
    placeholders = {rid: r.num_output_placeholders for rid, r in requests.items()}
    started = time.perf_counter()
    so = scheduler.schedule()
    scheduled = time.perf_counter()
    # Those the step gave a placeholder sample (a prompt chunk that does not end its prompt does not).
    sampled = [rid for rid in so.num_scheduled_tokens if requests[rid].num_output_placeholders > placeholders[rid]]
    tokens = [[7]] * len(sampled)
    applying = time.perf_counter()
    scheduler.update_from_output(sampled, tokens)
    return scheduled - started, time.perf_counter() - applying


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_start = load_average()
    scheduler = build_scheduler(args)
    for _ in range(args.warmup):
        step(scheduler)
    runs = []
    for _ in range(args.repeats):
        times = [step(scheduler) for _ in range(args.steps)]
        runs.append((sum(t[0] for t in times) / args.steps, sum(t[1] for t in times) / args.steps))
    if len(scheduler.running) != args.requests:
        raise SystemExit(f"expected {args.requests} running requests throughout, {len(scheduler.running)} at the end")
    best = min(runs, key=sum)
    figures = {"schedule_us": round(1e6 * best[0], 1), "update_from_output_us": round(1e6 * best[1], 1),
               "step_us": round(1e6 * sum(best), 1), "step_us_per_request": round(1e6 * sum(best) / args.requests, 3),
               "step_us_all_runs": [round(1e6 * sum(r), 1) for r in runs]}
    print(f"{args.requests} decoding requests: schedule {figures['schedule_us']:.0f} us + update_from_output "
          f"{figures['update_from_output_us']:.0f} us = {figures['step_us']:.0f} us per step "
          f"({figures['step_us_per_request']:.2f} us per request; best of {args.repeats} runs)")
    facts = run_facts(None, load_start, argv, __file__)
    facts.pop("gpu")
    report = {"benchmark": "scheduler host work per decode step (schedule + update_from_output)", **facts,
              "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "block_size": args.block_size,
                           "prefix_caching": args.prefix_caching, "warmup": args.warmup, "steps": args.steps,
                           "repeats": args.repeats, "reported": "the best run's mean per step"},
              "results": figures}
    path = write_results(args.output or "scheduler_cpu", report, args.results_dir)
    print(f"wrote {path.name}")
    return report


if __name__ == "__main__":
    main()
