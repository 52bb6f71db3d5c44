"""Every sampling path against greedy without text, in one engine and interleaved rounds.

``throughput.py`` measures one sampling setting per process. Comparing settings across processes
mixes the cost of a path with what changes between processes and over time on a shared host (its
clock, its other load: on one GPU machine the same tree's decode step ranged from 1.7 to 2.3 ms
between processes). Here one ``LLM`` runs the same workload (throughput.py's nano-vllm shape)
with every setting in turn, round after round: each setting is warmed up first, then each round
times every setting once, in the same order. A setting's figure is its median round, and its
ratio is taken round by round against greedy-without-text of the same round (the median of those
ratios is reported), so that a slow spell hits a setting and its baseline alike.

Spells shorter than a round still land on one setting and not its baseline, so every run also
records the host's speed just before and after it (``throughput.timed_run``'s ``host_probe_ms``) and
each setting gets a third reading over its steady-host runs only: those whose probes both stayed
within ``STEADY_HOST_MARGIN`` of the fastest probe of the whole benchmark.

    python benchmarks/sampling_paths.py --arch qwen2-0.5b --tokenizer ../shared/data/qwen2_tokenizer \\
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --rounds 3
                                         # one GPU; --num-seqs 1024 for the steady-state workload
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import throughput
from benchmarks.common import STEADY_HOST_MARGIN, load_average, run_facts, scrub_path, steady_host, write_results

# The table of what users run: name -> throughput.py's sampling flags that differ from greedy with text.
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"detokenize": False},
    "greedy-text": {},
    "temp0.6-text": {"temperature": 0.6},
    "topp-topk-text": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "topp-topk-seed-text": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed_per_request": True},
    "rep-penalty-text": {"temperature": 0.8, "repetition_penalty": 1.1},
    "logprobs5-text": {"logprobs": 5},
}
BASELINE = "greedy"
# throughput.py's sampling flags at their defaults (greedy with text).
_SAMPLING_DEFAULTS = throughput.sampling_settings(throughput.parse_args([]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """throughput.py's model, workload and engine flags (its sampling flags are set per setting), plus
    ``--rounds`` and ``--settings``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="timed runs of every setting, interleaved")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of {', '.join(SETTINGS)} ({BASELINE} is always run)")
    own, rest = p.parse_known_args(argv)
    if own.rounds < 1:
        p.error(f"--rounds must be >= 1, got {own.rounds}")
    names = [n for n in own.settings.split(",") if n]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        p.error(f"--settings: unknown {unknown}; known: {list(SETTINGS)}")
    args = throughput.parse_args([*rest, "--peer", "none"])
    args.rounds, args.settings = own.rounds, [BASELINE, *(n for n in names if n != BASELINE)]
    return args


def setting_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """``args`` with the sampling flags of setting ``name`` (every other sampling flag at its default)."""
    return argparse.Namespace(**{**vars(args), **_SAMPLING_DEFAULTS, **SETTINGS[name]})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, model_dir, tag, summary, workload = throughput.resolve_run(args)
    print(f"model {scrub_path(model_dir)} on {device}; {workload.num_seqs} requests, {workload.total_output_tokens} "
          f"output tokens; settings {args.settings}; {args.rounds} interleaved rounds", flush=True)
    load_at_start = load_average()
    runner = throughput.NovaInferRunner(setting_args(args, BASELINE), model_dir, workload)
    warmup = throughput.warmup_requests(workload, args.max_num_batched_tokens)
    for name in args.settings[1:]:  # the runner warmed up the baseline
        runner.args = setting_args(args, name)
        runner.generate(*warmup)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.settings}
    for round_index in range(args.rounds):
        for name in args.settings:
            runner.args = setting_args(args, name)
            result, _ = runner.run()
            runs[name].append(result)
            print(f"  round {round_index + 1}/{args.rounds} {name:20} {result['output_tokens_per_s']:10,.0f} output tok/s",
                  flush=True)
    runner.close()

    rows = {}
    best_baseline = max(r["output_tokens_per_s"] for r in runs[BASELINE])
    steady = steady_host_runs(runs)
    steady_baseline = steady[BASELINE]
    for name, name_runs in runs.items():
        ratios = [r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in zip(name_runs, runs[BASELINE])]
        rows[name] = {"sampling": throughput.sampling_settings(setting_args(args, name)),
                      "vs_greedy_per_round": [round(x, 4) for x in ratios],
                      "vs_greedy_median": round(statistics.median(ratios), 4),
                      # The runs least slowed by the host, each side's fastest: a second reading
                      # where single runs spread more than the rows differ.
                      "vs_greedy_best_runs": round(max(r["output_tokens_per_s"] for r in name_runs) / best_baseline, 4),
                      "steady_host_runs": len(steady[name]),
                      "vs_greedy_steady_host": (
                          round(statistics.median(steady[name]) / statistics.median(steady_baseline), 4)
                          if steady[name] and steady_baseline else None),
                      **throughput.summarize(name_runs)}
    print(f"\n{'setting':22} {'median tok/s':>13} {'vs greedy (median of rounds)':>30} {'best run vs best greedy':>25}"
          f" {'steady-host runs vs greedy':>28}")
    for name, row in rows.items():
        steady_ratio = row["vs_greedy_steady_host"]
        print(f"{name:22} {row['output_tokens_per_s']:13,.0f} {row['vs_greedy_median']:30.3f} "
              f"{row['vs_greedy_best_runs']:25.3f} "
              f"{'-' if steady_ratio is None else f'{steady_ratio:.3f}':>20} ({row['steady_host_runs']} runs)")

    facts = run_facts(device, load_at_start, argv, __file__)
    results = {"benchmark": "sampling paths (offline, nano-vllm shape, interleaved rounds)",
               "gpu": facts.pop("gpu"), "model": summary, **facts, "workload": workload.describe(),
               "rounds": args.rounds, "baseline": BASELINE,
               "method": "one LLM; every setting warmed up, then each round times every setting once in the "
                         "listed order; a setting's figures are its median round's, its ratio the median of its "
                         "per-round ratios to the same round's baseline (vs_greedy_best_runs: its fastest run "
                         "over the baseline's fastest; vs_greedy_steady_host: the median of its steady-host runs over "
                         f"the baseline's, a steady-host run's two host probes within {STEADY_HOST_MARGIN}x of the "
                         "benchmark's fastest probe)",
               "settings": rows}
    path = write_results(args.output or f"sampling_paths_{device.type}_{tag}", results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


def steady_host_runs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per setting, the output tok/s of its runs whose host probes, before and after, both took at
    most ``STEADY_HOST_MARGIN`` times the fastest probe of any run."""
    named_runs = [(name, r) for name, name_runs in runs.items() for r in name_runs]
    kept: dict[str, list[float]] = {name: [] for name in runs}
    for (name, run), steady in zip(named_runs, steady_host([r["host_probe_ms"] for _, r in named_runs])):
        if steady:
            kept[name].append(run["output_tokens_per_s"])
    return kept


if __name__ == "__main__":
    main()
