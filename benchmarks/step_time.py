"""Host time against device time of one eager decode step, with and without torch.compile.

A step of ``--batch-size`` sequences, each decoding one token after ``--context`` tokens of (zero)
KV cache, runs through ``ModelRunner`` with CUDA graphs off (``enforce_eager``), so every step pays
its host cost. For each variant (``compilation_level`` 0, 1 and/or 2) the model forward (embedding to
final norm; staging the step's inputs and the LM head are not timed) is run ``--warmup`` times
(the compiled variant compiles in the first), then ``--steps`` times, and reports:

* ``host_ms``: Python's time to issue the forward (until it returns, before synchronising);
* ``wall_ms``: the same with the device synchronised at the end (the step's real cost);
* ``device_ms`` (CUDA): the sum of the kernels' durations per step, from torch.profiler;
* ``aten_ops``/``kernel_launches`` per step and per layer, from torch.profiler (the profiled
  steps are separate from the timed ones);
* ``wall_over_device``: the target of an eager step is at most 2;
* ``host_profile``: where the host time goes, from cProfile over ``--profile-steps`` more steps
  (its own overhead inflates the times, not their order): the functions with the most self time,
  and the project's functions (layers, kernels' wrappers) with the most cumulative time, per step
  and per layer.

Each variant runs in a fresh process, its timed steps before anything is profiled: a finished
torch.profiler session may leave the CUDA profiling interface attached, which slows every later
kernel launch in that process, and one variant's compiled code and caches must not be another's.

    python benchmarks/step_time.py                                  # tiny model on CPU
    python benchmarks/step_time.py --arch qwen2-0.5b --batch-size 256 --context 512
    python benchmarks/step_time.py --arch qwen2-0.5b --plain-triton-launches   # kernel[grid] launches, to compare
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import multiprocessing
import pstats
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_attention_backend_argument, add_model_arguments, add_output_arguments, load_average,
                               resolve_model_args, run_facts, scrub_path, write_results)

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    w = p.add_argument_group("step")
    w.add_argument("--batch-size", type=int, default=256, help="sequences decoding one token each")
    w.add_argument("--context", type=int, default=512, help="tokens already in each sequence's KV cache")
    w.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    w.add_argument("--compile", default="all", choices=["off", "on", "cpp", "both", "all"],
                   help="compilation_level 0 (off), 1 (on), 2 (cpp: inductor's C++ wrapper), 0 and 1 (both) or "
                        "all three, one after the other")
    add_attention_backend_argument(w)
    w.add_argument("--plain-triton-launches", action="store_true",
                   help="launch the Triton kernels through kernel[grid] (JITFunction.run) instead of directly")
    r = p.add_argument_group("runs")
    r.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens in these)")
    r.add_argument("--steps", type=int, default=30, help="timed steps; medians are reported")
    r.add_argument("--profile-steps", type=int, default=5,
                   help="steps under torch.profiler (op and kernel counts), then as many under cProfile")
    r.add_argument("--host-top", type=int, default=15, help="functions listed in each host-time table")
    add_output_arguments(p, "step_time_<device>_<model>_b<batch>")
    args = p.parse_args(argv)
    if min(args.batch_size, args.context, args.steps, args.profile_steps) < 1 or args.warmup < 1:
        p.error("--batch-size, --context, --steps, --profile-steps and --warmup must be >= 1")
    return args


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(forward, steps: int, device, num_layers: int) -> dict[str, Any]:
    """aten ops, kernel launches and (CUDA) kernel time per step of ``forward``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            forward()
        _synchronize(device)
    events = prof.events()
    aten_names = [e.name for e in events if e.name.startswith("aten::")]
    aten = len(aten_names)
    top = Counter(aten_names).most_common(12)
    launches = sum(1 for e in events if e.name in _LAUNCHES)
    kernel_us = sum(e.device_time for e in events if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy"))
    result = {"aten_ops": round(aten / steps, 1), "aten_ops_per_layer": round(aten / steps / num_layers, 1),
              "kernel_launches": round(launches / steps, 1) if device.type == "cuda" else None,
              "device_ms": round(kernel_us / steps / 1e3, 3) if device.type == "cuda" else None}
    result["kernel_launches_per_layer"] = (round(result["kernel_launches"] / num_layers, 1)
                                           if result["kernel_launches"] is not None else None)
    result["top_aten_ops_per_step"] = {op: round(count / steps, 1) for op, count in top}
    return result


def _function_name(key: tuple[str, int, str]) -> str:
    """``path:line(function)`` with the path from the package (or site-packages) down; builtins as named."""
    path, line, function = key
    if path == "~":
        return function
    for marker in ("site-packages/", "novainfer/", "benchmarks/"):
        if marker in path:
            path = (marker if marker != "site-packages/" else "") + path.split(marker, 1)[1]
            break
    return f"{scrub_path(path)}:{line}({function})"


def _host_profile(forward, steps: int, num_layers: int, top: int) -> dict[str, list[dict[str, Any]]]:
    """cProfile of ``steps`` calls of ``forward``: the ``top`` functions by self time, and the ``top``
    functions of the project by cumulative time (ms per step and per layer, calls per step)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        forward()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (path, line, function) -> (calls, ncalls, self s, cumulative s, _)

    def rows(keys, column: int) -> list[dict[str, Any]]:
        ranked = sorted(keys, key=lambda k: stats[k][column], reverse=True)[:top]
        return [{"function": _function_name(k), "ms_per_step": round(1e3 * stats[k][column] / steps, 3),
                 "ms_per_layer": round(1e3 * stats[k][column] / steps / num_layers, 4),
                 "calls_per_step": round(stats[k][1] / steps, 1)} for k in ranked]

    ours = [k for k in stats if "novainfer" in k[0]]
    return {"self_time": rows(stats, 2), "project_cumulative_time": rows(ours, 3)}


def _triton_launches(plain: bool):
    """Kernel launches through ``kernel[grid]`` when ``plain`` (imported only then: trees from before
    the direct launcher are measured as they are)."""
    if not plain:
        return contextlib.nullcontext()
    from novainfer.layers.ops.launcher import direct_launches

    return direct_launches(False)


def run_variant(args, model_dir: str, device, compilation_level: int) -> dict[str, Any]:
    import torch

    from novainfer.config import CacheConfig, ModelConfig
    from novainfer.worker.model_runner import ModelRunner, SequenceInput

    n, bs = args.batch_size, args.block_size
    max_len = args.context + 2
    blocks_each = -(-max_len // bs)
    # (The option is left out when off, so that the script also measures trees from before it.)
    options = {"compilation_level": compilation_level} if compilation_level else {}
    if args.attention_backend is not None:
        options["attention_backend"] = args.attention_backend
    runner = ModelRunner(ModelConfig(model_dir, dtype=args.dtype, max_model_len=max_len, enforce_eager=True, **options),
                         CacheConfig(block_size=bs), device)
    started = time.perf_counter()
    runner.load_model()
    load_s = time.perf_counter() - started
    runner.allocate_kv_cache(n * blocks_each)
    seqs = [SequenceInput([1 + s % 100], args.context, list(range(s * blocks_each, (s + 1) * blocks_each)), "last")
            for s in range(n)]
    step = runner.prepare_inputs(seqs)  # staged once: only the forward is timed
    model = runner.model

    def forward():
        return model(step.input_ids, step.positions, step.metadata)

    host, wall = [], []
    first_s = None
    with torch.inference_mode(), _triton_launches(args.plain_triton_launches):
        for i in range(args.warmup + args.steps):
            _synchronize(device)
            t0 = time.perf_counter()
            forward()
            t1 = time.perf_counter()
            _synchronize(device)
            t2 = time.perf_counter()
            if i == 0:
                first_s = t2 - t0
            if i >= args.warmup:
                host.append(t1 - t0)
                wall.append(t2 - t0)
        profiled = _profile(forward, args.profile_steps, device, runner.model_config.num_layers)
        host_profile = _host_profile(forward, args.profile_steps, runner.model_config.num_layers, args.host_top)
        _synchronize(device)
    compiled = getattr(getattr(model, "model", None), "compiled_forward", None)
    result = {"compilation_level": compilation_level, "attention_backend": runner.attn_backend.name,
              "load_s": round(load_s, 2), "first_step_s": round(first_s, 3),
              "compilations": compiled.num_compilations if compiled is not None else 0,
              "host_ms": round(1e3 * statistics.median(host), 3), "wall_ms": round(1e3 * statistics.median(wall), 3),
              **profiled, "host_profile": host_profile}
    if result["device_ms"]:
        result["wall_over_device"] = round(result["wall_ms"] / result["device_ms"], 2)
    return result


def run_variant_in_fresh_process(args, model_dir: str, device, compilation_level: int) -> dict[str, Any]:
    """``run_variant`` in a new (spawned) process: see the module's docstring for why."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_variant, args, model_dir, device, compilation_level).result()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    model_dir, tag, summary = resolve_model_args(args, device)
    name = args.output or f"step_time_{device.type}_{tag}_b{args.batch_size}"
    levels = {"off": [0], "on": [1], "cpp": [2], "both": [0, 1], "all": [0, 1, 2]}[args.compile]
    print(f"model {scrub_path(model_dir)} on {device}; eager decode step of {args.batch_size} sequences after "
          f"{args.context} tokens; compilation_level {levels}", flush=True)
    load_at_start = load_average()
    rows = [run_variant_in_fresh_process(args, model_dir, device, level) for level in levels]
    print(f"\n{'level':>5} {'first s':>8} {'host ms':>8} {'wall ms':>8} {'device ms':>9} {'wall/dev':>8} "
          f"{'aten/layer':>10} {'launch/layer':>12}")
    for r in rows:
        print(f"{r['compilation_level']:>5} {r['first_step_s']:>8.2f} {r['host_ms']:>8.2f} {r['wall_ms']:>8.2f} "
              f"{r['device_ms'] or float('nan'):>9.3f} {r.get('wall_over_device', float('nan')):>8.2f} "
              f"{r['aten_ops_per_layer']:>10.1f} {r['kernel_launches_per_layer'] or float('nan'):>12.1f}")
    for r in rows:
        for table, column in (("self_time", "self"), ("project_cumulative_time", "cumulative")):
            print(f"\nlevel {r['compilation_level']}: host time by {column} time under cProfile "
                  f"(ms per step, ms per layer, calls per step)")
            for row in r["host_profile"][table]:
                print(f"{row['ms_per_step']:>9.3f} {row['ms_per_layer']:>8.4f} {row['calls_per_step']:>8.1f}  "
                      f"{row['function']}")
    facts = run_facts(device, load_at_start, argv, __file__)
    results = {
        "benchmark": "eager decode step: host time against device kernel time, with and without torch.compile",
        "gpu": facts.pop("gpu"),
        "model": summary,
        **facts,
        "workload": {"batch_size": args.batch_size, "context": args.context, "block_size": args.block_size,
                     "triton_launches": "plain" if args.plain_triton_launches else "direct",
                     "dtype": args.dtype, "warmup_steps": args.warmup, "timed_steps": args.steps,
                     "profiled_steps": args.profile_steps, "timed": "model forward only (no staging, no LM head)"},
        "variants": rows,
    }
    path = write_results(name, results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
