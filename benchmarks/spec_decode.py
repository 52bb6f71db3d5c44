"""Speculative decoding: decode time per token and offline throughput, with and without it.

Every figure comes with the acceptance measured in the run that gave it (never assumed): the
acceptance rate (accepted / draft tokens), the mean accepted length (tokens a request gets from a
step with drafts: its accepted drafts and one more) and the acceptance rate at each draft position,
from the engine's counters over the timed runs only.

* ``decode``: for each ``--batch-sizes`` B, B requests of ``--input-len`` prompt tokens generate
  ``--output-len`` tokens each (greedy, EOS ignored). A prompt is a random passage of
  ``--passage-len`` tokens repeated to its length (``--prompt-kind repeated``: text that n-gram
  lookup can copy; the presets' random weights make greedy outputs cycle as well) or random tokens
  (``--prompt-kind random``). Decode ms per token = (median time of the whole generate - median
  time of the same requests generating one token, i.e. the prefill) / (output_len - 1): the
  time of one decode step of the batch (every request gets one token per plain step). Drafts are
  proposed at every batch size here (``disable_by_batch_size`` None unless the configuration names
  it), so that each figure shows what speculation does at that size. Where the time goes, from the
  engine's counters over the timed runs: engine steps, tokens per step, ms per step and the
  executor's share (forward, sampling, verification and, with a draft model, its forwards); with
  ``--profile`` (CUDA) also the device's busy time per step (the union of the kernels' intervals
  under torch.profiler, one more run of one more engine per side, after every timed round) and its
  top kernels. Each of ``--rounds`` engines per side measures every batch; the round with the
  median ms per token gives the figure.
* ``throughput``: benchmarks/throughput.py's runner on its nano-vllm workload (random prompts,
  uniform lengths, token ids only; its flags keep throughput.py's names, with nano-vllm's lengths),
  speculation on (the configuration's ``disable_by_batch_size`` as given, else its default)
  against off; ``--rounds`` engines per side, alternating which side starts, and the median of
  their runs (``--repeats`` each).

Both sides run the same engine arguments; the one with speculation adds ``--speculative-config``
(default: n-gram, 4 tokens). Greedy outputs are compared between the sides (they should be equal:
the figure of a run whose outputs differ is reported with that flag). The engines run one after
the other, alternating which side starts a round (see ``side_order``); each is shut down and its
memory released before the next one starts.

    python benchmarks/spec_decode.py                       # tiny model on CPU
    python benchmarks/spec_decode.py --arch qwen2-0.5b     # a real architecture on the GPU
    python benchmarks/spec_decode.py --arch qwen2-0.5b --speculative-config \\
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import throughput
from benchmarks.common import STEADY_HOST_MARGIN, add_engine_arguments, add_model_arguments, add_output_arguments, \
    engine_kwargs, greedy_params, host_probe, load_average, make_workload, release_device_memory, resolve_model_args, \
    run_facts, scrub_path, steady_host, write_results

DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
MODES = ("decode", "throughput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(speculative_config=DEFAULT_SPECULATIVE_CONFIG)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="what to measure")
    d = p.add_argument_group("decode")
    d.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="requests decoding together")
    d.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    d.add_argument("--output-len", type=int, default=256, help="new tokens per request (EOS ignored)")
    d.add_argument("--prompt-kind", default="repeated", choices=["repeated", "random"],
                   help="repeated: a random passage repeated to the prompt's length; random: random tokens")
    d.add_argument("--passage-len", type=int, default=32, help="--prompt-kind repeated: tokens of the passage")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs of each decode measurement first (throughput: a warm-up run if > 0)")
    t = p.add_argument_group("throughput (benchmarks/throughput.py's workload)")
    t.add_argument("--num-seqs", type=int, default=256)
    t.add_argument("--min-input", type=int, default=100)
    t.add_argument("--max-input", type=int, default=1024)
    t.add_argument("--min-output", type=int, default=100)
    t.add_argument("--max-output", type=int, default=1024)
    t.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs compared between the sides)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' random draws")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; medians are reported")
    p.add_argument("--rounds", type=int, default=2,
                   help="engines per side, alternating which side starts; each measures every figure "
                        "(decode: the median round's is reported; throughput: the median of all runs)")
    p.add_argument("--profile", action="store_true",
                   help="decode: also the device's busy time per engine step and its top kernels (CUDA)")
    add_output_arguments(p, "spec_decode_<device>_<model>")
    args = p.parse_args(argv)
    if max(args.batch_sizes) > args.max_num_seqs:
        p.error(f"--batch-sizes {max(args.batch_sizes)} is more than --max-num-seqs {args.max_num_seqs}")
    for flag in ("input_len", "passage_len", "repeats", "num_seqs", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.output_len < 2 or args.warmup < 0 or min(args.batch_sizes) < 1:
        p.error(f"need --output-len >= 2, --warmup >= 0 and --batch-sizes >= 1, got {args.output_len}, "
                f"{args.warmup} and {args.batch_sizes}")
    return args


# ---- acceptance -------------------------------------------------------------------------------------
@dataclass
class SpecCounts:
    """The engine's speculative decoding counters at one moment."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: list[int]

    @classmethod
    def of(cls, llm) -> SpecCounts:
        s = llm.llm_engine.get_stats()
        return cls(s.spec_decode_num_drafts_total, s.spec_decode_num_draft_tokens_total,
                   s.spec_decode_num_accepted_tokens_total, list(s.spec_decode_num_accepted_tokens_per_pos_total))

    def since(self, before: SpecCounts) -> dict[str, Any]:
        """The acceptance figures of what happened between ``before`` and this."""
        drafts, draft_tokens = self.drafts - before.drafts, self.draft_tokens - before.draft_tokens
        accepted = self.accepted_tokens - before.accepted_tokens
        earlier = before.accepted_per_pos + [0] * (len(self.accepted_per_pos) - len(before.accepted_per_pos))
        per_pos = [now - then for now, then in zip(self.accepted_per_pos, earlier)]
        return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
                "mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else None,
                "acceptance_rate_per_position": [round(n / drafts, 4) if drafts else None for n in per_pos]}


# ---- decode ms/token --------------------------------------------------------------------------------
def decode_prompts(args: argparse.Namespace, vocab_size: int, batch_size: int) -> list[list[int]]:
    """One prompt per request, each of its own random draws."""
    passage_len = args.passage_len if args.prompt_kind == "repeated" else args.input_len
    passages = make_workload(batch_size, vocab_size, passage_len, passage_len, 1, 1, seed=args.seed).prompts
    return [(passage * -(-args.input_len // passage_len))[:args.input_len] for passage in passages]


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], list[float]]:
    """Seconds of one ``LLM.generate`` of ``prompts`` (prefix cache emptied first), its tokens, and
    the host's speed just before and after it (:func:`host_probe`'s wall ms, outside the timed part)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("could not empty the prefix cache (blocks still in use)")
    probe_before = host_probe()["wall_ms"]
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - started
    probe_after = host_probe()["wall_ms"]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if any(len(t) != max_tokens for t in tokens):
        raise RuntimeError(f"a request produced other than {max_tokens} tokens")
    return seconds, tokens, [probe_before, probe_after]


def measure_decode(llm, prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    """Decode ms per token of a batch (see the module docstring) and the acceptance of its timed runs."""
    for _ in range(args.warmup):
        timed_generate(llm, prompts, args.output_len)
    before, stats_before = SpecCounts.of(llm), llm.llm_engine.get_stats()
    runs = [timed_generate(llm, prompts, args.output_len) for _ in range(args.repeats)]
    acceptance = SpecCounts.of(llm).since(before)
    steps = step_split(stats_before, llm.llm_engine.get_stats())
    full, tokens = [seconds for seconds, _, _ in runs], runs[-1][1]
    prefill = [timed_generate(llm, prompts, 1)[0] for _ in range(args.warmup + args.repeats)][args.warmup:]
    decode_s = statistics.median(full) - statistics.median(prefill)
    result = {"ms_per_token": round(1e3 * decode_s / (args.output_len - 1), 4),
              "generate_s_median": round(statistics.median(full), 4),
              "prefill_s_median": round(statistics.median(prefill), 4),
              "generate_s_runs": [round(s, 4) for s in full],
              "generate_host_probe_ms": [probes for _, _, probes in runs], **acceptance, "steps": steps}
    return result, tokens


def step_split(before, after) -> dict[str, Any]:
    """The engine's steps between two stats snapshots: how many, tokens and ms per step, the executor's ms."""
    steps = after.num_steps - before.num_steps
    per_step = (lambda total: round(total / steps, 4) if steps else None)
    return {"engine_steps": steps,
            "tokens_per_engine_step": per_step(after.generation_tokens_total - before.generation_tokens_total),
            "ms_per_engine_step": per_step(1e3 * (after.step_time_total - before.step_time_total)),
            "executor_ms_per_engine_step": per_step(1e3 * (after.model_time_total - before.model_time_total))}


def profile_sides(args: argparse.Namespace, model_dir: str, device, batches: dict[int, list[list[int]]]
                  ) -> dict[str, dict[int, dict[str, Any]]]:
    """``--profile``: one more engine per side, after every timed round, profiles each batch (after its
    warm-up runs). A finished torch.profiler session may leave CUDA's profiling interface attached,
    which slows every later kernel launch in the process, so nothing timed follows one."""
    profiles: dict[str, dict[int, dict[str, Any]]] = {}
    for side in ("off", "on"):
        llm = start_engine(args, model_dir, side == "on")
        profiles[side] = {}
        for b, prompts in batches.items():
            for _ in range(args.warmup):
                timed_generate(llm, prompts, args.output_len)
            profiles[side][b] = profile_device(llm, prompts, args.output_len)
        close(llm, device)
    return profiles


def profile_device(llm, prompts: list[list[int]], max_tokens: int, top: int = 8) -> dict[str, Any]:
    """One more generate under torch.profiler: the device's busy ms per engine step (the union of the
    kernels' intervals, copies included) and the kernels with the most time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    steps_before = llm.llm_engine.get_stats().num_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, prompts, max_tokens)
        torch.cuda.synchronize()
    steps = llm.llm_engine.get_stats().num_steps - steps_before
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy_us, end = 0.0, float("-inf")
    for start, stop in intervals:  # the union: overlapping kernels count once
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    kernels = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                     key=lambda e: -e.self_device_time_total)[:top]
    per_step = (lambda value: round(value / steps, 4) if steps else None)
    return {"profiled_engine_steps": steps, "device_busy_ms_per_engine_step": per_step(busy_us / 1e3),
            "top_kernels": [{"kernel": e.key[:100], "ms_per_engine_step": per_step(e.self_device_time_total / 1e3),
                             "calls_per_engine_step": per_step(e.count)} for e in kernels]}


# ---- the two sides ----------------------------------------------------------------------------------
def start_engine(args: argparse.Namespace, model_dir: str, speculative: bool):
    """An engine for the decode figures: with speculation, drafts at any batch size (see the docstring)."""
    from novainfer import LLM

    spec = {"disable_by_batch_size": None, **args.speculative_config} if speculative else None
    return LLM(model_dir, **{**engine_kwargs(args), "speculative_config": spec})


def engine_facts(llm) -> dict[str, Any]:
    config = llm.llm_engine.config
    spec = config.speculative_config
    return {"async_scheduling": config.scheduler_config.async_scheduling,
            "speculative_config": None if spec is None else dataclasses.asdict(spec),
            "dtype": str(llm.llm_engine.model_config.torch_dtype).removeprefix("torch."),
            "device": str(config.device)}


def close(llm, device) -> None:
    llm.shutdown()
    release_device_memory(device)


def run_decode(args: argparse.Namespace, model_dir: str, vocab_size: int, device) -> dict[str, Any]:
    batches = {b: decode_prompts(args, vocab_size, b) for b in args.batch_sizes}
    rounds: dict[str, dict[int, list[tuple[dict[str, Any], list]]]] = {"off": {}, "on": {}}
    facts = {}
    for round_index in range(args.rounds):
        for side in side_order(round_index):
            llm = start_engine(args, model_dir, side == "on")
            facts[side] = engine_facts(llm)
            for b, prompts in batches.items():
                rounds[side].setdefault(b, []).append(measure_decode(llm, prompts, args))
                print(f"  decode batch {b}, round {round_index + 1}, speculation {side}: "
                      f"{rounds[side][b][-1][0]['ms_per_token']:.3f} ms/token, "
                      f"acceptance rate {rounds[side][b][-1][0]['acceptance_rate']}", flush=True)
            close(llm, device)
    profiles = profile_sides(args, model_dir, device, batches) if args.profile and device.type == "cuda" else None
    figures = {}
    for b in args.batch_sizes:
        (off, off_tokens), (on, on_tokens) = (median_round(rounds[side][b]) for side in ("off", "on"))
        if profiles is not None:
            off["steps"], on["steps"] = {**off["steps"], **profiles["off"][b]}, {**on["steps"], **profiles["on"][b]}
        figures[f"batch_{b}"] = {"batch_size": b, "off": off, "on": on,
                                 "speedup": round(off["ms_per_token"] / on["ms_per_token"], 3)
                                 if on["ms_per_token"] > 0 else None,
                                 "acceptance_rate": on["acceptance_rate"],
                                 "greedy_outputs_identical": off_tokens == on_tokens,
                                 **steady_host_speedup(rounds["off"][b], rounds["on"][b], args.output_len)}
    return {"workload": {"input_len": args.input_len, "output_len": args.output_len, "prompt_kind": args.prompt_kind,
                         "passage_len": args.passage_len if args.prompt_kind == "repeated" else None,
                         "greedy": True, "ignore_eos": True, "warmup_runs": args.warmup, "repeats": args.repeats,
                         "rounds": args.rounds,
                         "ms_per_token": "(median generate s - median prefill-only s) / (output_len - 1), "
                                         "of the median round",
                         "steady_host": "the same over every round's generate runs whose host probes, before and "
                                        f"after, stayed within {STEADY_HOST_MARGIN}x of the fastest probe of "
                                        "either side (the prefill-only term: the median of the rounds' medians)"},
            "engines": facts, "figures": figures}


def steady_host_speedup(off_rounds: list[tuple[dict[str, Any], list]], on_rounds: list[tuple[dict[str, Any], list]],
                        output_len: int) -> dict[str, Any]:
    """Both sides' decode ms/token over their steady-host generate runs only (see ``host_probe``),
    and the speedup between them; None where a side kept no run."""
    sides = {"off": [r for r, _ in off_rounds], "on": [r for r, _ in on_rounds]}
    probes = [p for results in sides.values() for r in results for p in r["generate_host_probe_ms"]]
    flags = iter(steady_host(probes))  # in the order of the runs below
    ms: dict[str, float | None] = {}
    runs: dict[str, int] = {}
    for side, results in sides.items():
        kept = [s for r in results for s, steady in zip(r["generate_s_runs"], flags) if steady]
        prefill = statistics.median(r["prefill_s_median"] for r in results)
        runs[side] = len(kept)
        ms[side] = round(1e3 * (statistics.median(kept) - prefill) / (output_len - 1), 4) if kept else None
    speedup = round(ms["off"] / ms["on"], 3) if ms["off"] and ms["on"] else None
    return {"steady_host": {"off_ms_per_token": ms["off"], "on_ms_per_token": ms["on"], "speedup": speedup,
                            "runs": runs}}


def side_order(round_index: int) -> tuple[str, str]:
    """Which side's engine runs first in a round: off in even rounds, on in odd ones. Of two
    engines run one after the other in one process the second was measured slower (one H200:
    offline throughput with speculation on at 0.76-0.87x of off when always second, 0.97-0.99x
    in processes of their own), so each side takes each place equally often."""
    return ("off", "on") if round_index % 2 == 0 else ("on", "off")


def median_round(results: list[tuple[dict[str, Any], list]]) -> tuple[dict[str, Any], list]:
    """The round whose ms/token is the median (the upper one of an even count), with every round's."""
    result, tokens = sorted(results, key=lambda r: r[0]["ms_per_token"])[len(results) // 2]
    return {**result, "ms_per_token_rounds": [r["ms_per_token"] for r, _ in results]}, tokens


def run_throughput(args: argparse.Namespace, model_dir: str, vocab_size: int, device) -> dict[str, Any]:
    """throughput.py's NovaInfer runner with and without speculation on its workload, an engine per
    side and round (see :func:`side_order`). The median over every round's runs is reported."""
    # throughput.py's settings where this script has none (sampling but temperature, tokenizer), token ids
    # only (text is the same work with speculation or without).
    targs = argparse.Namespace(**{**vars(throughput.parse_args(["--peer", "none"])), **vars(args),
                                  "detokenize": False})
    workload = make_workload(args.num_seqs, vocab_size, args.min_input, args.max_input, args.min_output,
                             args.max_output, seed=args.seed)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    tokens, engines = {}, {}
    for round_index in range(args.rounds):
        for side in side_order(round_index):
            targs.speculative_config = args.speculative_config if side == "on" else None
            runner = throughput.NovaInferRunner(targs, model_dir, workload)
            for _ in range(args.repeats):
                before = SpecCounts.of(runner.llm)
                result, tokens[side] = runner.run()
                runs[side].append({**result, **SpecCounts.of(runner.llm).since(before)})
            engines[side] = engine_facts(runner.llm)
            print(f"  throughput, round {round_index + 1}, speculation {side}: "
                  f"{[round(r['output_tokens_per_s']) for r in runs[side][-args.repeats:]]} output tok/s", flush=True)
            runner.close()
            release_device_memory(device)
    sides = {}
    for side, side_runs in runs.items():
        median = sorted(side_runs, key=lambda r: r["output_tokens_per_s"])[len(side_runs) // 2]
        sides[side] = {**median, "engine": engines[side],
                       "output_tokens_per_s_runs": [r["output_tokens_per_s"] for r in side_runs]}
    return {"workload": workload.describe(), "sampling": throughput.sampling_settings(targs), "rounds": args.rounds,
            "off": sides["off"], "on": sides["on"],
            "on_over_off": round(sides["on"]["output_tokens_per_s"] / sides["off"]["output_tokens_per_s"], 4),
            "acceptance_rate": sides["on"]["acceptance_rate"],
            "greedy_outputs_identical": tokens["off"] == tokens["on"] if args.temperature == 0 else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    model_dir, tag, summary = resolve_model_args(args, device)
    print(f"model {scrub_path(model_dir)} on {device}; speculative config {args.speculative_config}", flush=True)
    load_at_start = load_average()
    results: dict[str, Any] = {"benchmark": "speculative decoding: decode ms/token and offline throughput, on "
                                            "against off", "model": summary,
                               "speculative_config": args.speculative_config}
    if "decode" in args.modes:
        results["decode"] = run_decode(args, model_dir, summary["vocab_size"], device)
    if "throughput" in args.modes:
        results["throughput"] = run_throughput(args, model_dir, summary["vocab_size"], device)
    facts = run_facts(device, load_at_start, argv, __file__)
    results = {"gpu": facts.pop("gpu"), **results, **facts}
    print_summary(results)
    path = write_results(args.output or f"spec_decode_{device.type}_{tag}", results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


def print_summary(results: dict[str, Any]) -> None:
    print(f"\n{'':28} {'off':>12} {'on':>12} {'on vs off':>10} {'acceptance':>11} {'mean len':>9}")
    figures = results.get("decode", {}).get("figures", {})
    for name, f in figures.items():
        print(f"{'decode ms/token ' + name:28} {f['off']['ms_per_token']:12.3f} {f['on']['ms_per_token']:12.3f} "
              f"{f['speedup']:9.2f}x {_fmt(f['on']['acceptance_rate']):>11} {_fmt(f['on']['mean_accepted_length']):>9}")
        steady = f["steady_host"]
        print(f"{'  steady-host runs':28} {_fmt(steady['off_ms_per_token']):>12} {_fmt(steady['on_ms_per_token']):>12} "
              f"{_fmt(steady['speedup']):>9}x  ({steady['runs']['off']} and {steady['runs']['on']} runs)")
    for name, f in figures.items():
        for side in ("off", "on"):
            s = f[side]["steps"]
            busy = s.get("device_busy_ms_per_engine_step")
            print(f"  {name}, speculation {side}: {s['engine_steps']} engine steps of "
                  f"{_fmt(s['tokens_per_engine_step'])} tokens, {_fmt(s['ms_per_engine_step'])} ms each "
                  f"(executor {_fmt(s['executor_ms_per_engine_step'])})"
                  + ("" if busy is None else f", device busy {busy:.3f} ms"))
    t = results.get("throughput")
    if t is not None:
        print(f"{'throughput output tok/s':28} {t['off']['output_tokens_per_s']:12.1f} "
              f"{t['on']['output_tokens_per_s']:12.1f} {t['on_over_off']:9.3f}x {_fmt(t['acceptance_rate']):>11} "
              f"{_fmt(t['on']['mean_accepted_length']):>9}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
