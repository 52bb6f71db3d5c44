"""Batched decode through the low-level API (``novainfer.core_api``) against the engine's decode step.

``--num-seqs`` sequences each hold ``--context`` random prompt tokens (prefilled untimed, one
sequence per call); then ``--steps`` timed calls each decode one token for every sequence, greedy,
the next call's tokens taken from the argmax of the last call's logits (on the host, as a caller of
the API must).

* core_api: ``Model.decode`` of a ``Batch`` of ``num_seqs`` tokens (its arrays filled in place,
  as the struct-of-arrays layout is meant to be), then ``get_logits().argmax``. With ``--attention
  auto`` such a batch (one token per sequence) is a decode step: on CUDA it replays a graph
  captured when the model was created, running the engine's Triton attention over each sequence's
  cells; ``masked`` forces the general masked path (eager).
* engine: ``ModelRunner.forward`` of the same step (block tables of ``--block-size``, CUDA graphs
  on GPU), which also returns float32 logits.

``--enforce-eager`` turns CUDA graphs off on both sides.

Both start from the same prompts; their greedy tokens are compared.

    python benchmarks/core_api_decode.py                                    # tiny model on CPU
    python benchmarks/core_api_decode.py --arch qwen2-0.5b --num-seqs 64 --context 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import (add_model_arguments, add_output_arguments, load_average, make_workload,
                               release_device_memory, resolve_model_args, run_facts, scrub_path, write_results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument("--num-seqs", type=int, default=64, help="sequences decoded together")
    w.add_argument("--context", type=int, default=1000, help="prompt tokens of each sequence")
    w.add_argument("--steps", type=int, default=64, help="timed decode calls (one token per sequence each)")
    w.add_argument("--warmup", type=int, default=4, help="untimed decode calls first")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("sides")
    s.add_argument("--attention", default="auto", choices=["auto", "masked"], help="core_api's attention path")
    s.add_argument("--block-size", type=int, default=16, help="the engine's KV block size")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on either side")
    s.add_argument("--peer", default="engine", choices=["engine", "none"])
    add_output_arguments(p, "core_api_decode_<device>_<model>")
    args = p.parse_args(argv)
    if min(args.num_seqs, args.context, args.steps) < 1 or args.warmup < 0:
        p.error("--num-seqs, --context and --steps must be >= 1, --warmup >= 0")
    return args


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_core_api(args, model_dir: str, device, prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    from novainfer.core_api import Batch, Model

    n = len(prompts)
    total = args.context + args.warmup + args.steps + 1
    started = time.perf_counter()
    model = Model.from_pretrained(model_dir, device=str(device), dtype=args.dtype, n_ctx=n * total, n_seq_max=n,
                                  n_batch=max(n, args.context), attention=args.attention,
                                  enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    tokens = []
    for seq, prompt in enumerate(prompts):
        batch = Batch.init(len(prompt), 1)
        for i, t in enumerate(prompt):
            batch.add(t, i, [seq], logits=i == len(prompt) - 1)
        _check(model.decode(batch), model)
        tokens.append(int(model.get_logits_ith(-1).argmax()))
    _synchronize(device)
    prefill_s = time.perf_counter() - started
    batch = Batch.init(n, 1)
    batch.n_tokens = n
    batch.n_seq_id[:] = 1
    batch.seq_id[:, 0] = np.arange(n)
    batch.logits[:] = True
    outputs = [[t] for t in tokens]

    def step(position: int) -> None:
        batch.token[:] = [out[-1] for out in outputs]
        batch.pos[:] = position
        _check(model.decode(batch), model)
        for out, t in zip(outputs, model.get_logits().argmax(dim=-1).tolist()):
            out.append(t)

    elapsed = _timed_steps(step, args, device)
    graphs = model.cuda_graphs
    result = {"name": f"core_api Model.decode (attention={args.attention}{', CUDA graphs' if graphs else ''})",
              "cuda_graphs": graphs, "graph_memory_mib": round(model.graph_memory_bytes / 2**20, 1),
              "load_and_capture_s": round(load_s, 3), "prefill_s": round(prefill_s, 3), **_rates(elapsed, args, n),
              "kv_cells": model.n_ctx, "kv_cells_used": model.kv_used_cells()}
    return result, outputs


def run_engine(args, model_dir: str, device, prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    from novainfer.config import CacheConfig, ModelConfig
    from novainfer.worker.model_runner import ModelRunner, SequenceInput

    n = len(prompts)
    total = args.context + args.warmup + args.steps + 1
    blocks_each = -(-total // args.block_size)
    runner = ModelRunner(ModelConfig(model_dir, dtype=args.dtype, max_model_len=total,
                                     enforce_eager=args.enforce_eager),
                         CacheConfig(block_size=args.block_size), device)
    runner.load_model()
    runner.allocate_kv_cache(n * blocks_each)
    runner.capture_model(n, max(n, args.context))
    tables = [list(range(s * blocks_each, (s + 1) * blocks_each)) for s in range(n)]
    started = time.perf_counter()
    outputs = [[int(runner.forward([SequenceInput(p, 0, tables[s], "last")])[0].argmax())]
               for s, p in enumerate(prompts)]
    _synchronize(device)
    prefill_s = time.perf_counter() - started

    def step(position: int) -> None:
        logits = runner.forward([SequenceInput([out[-1]], position, tables[s], "last")
                                 for s, out in enumerate(outputs)])
        for out, t in zip(outputs, logits.argmax(dim=-1).tolist()):
            out.append(t)

    elapsed = _timed_steps(step, args, device)
    result = {"name": "engine ModelRunner.forward" + (" (CUDA graphs)" if runner.graphs else ""),
              "prefill_s": round(prefill_s, 3), **_rates(elapsed, args, n), "kv_blocks": runner.num_blocks,
              "block_size": args.block_size}
    return result, outputs


def _timed_steps(step, args, device) -> float:
    for i in range(args.warmup):
        step(args.context + i)
    _synchronize(device)
    started = time.perf_counter()
    for i in range(args.steps):
        step(args.context + args.warmup + i)
    _synchronize(device)
    return time.perf_counter() - started


def _rates(elapsed: float, args, num_seqs: int) -> dict[str, float]:
    return {"decode_s": round(elapsed, 4), "ms_per_step": round(1e3 * elapsed / args.steps, 3),
            "tokens_per_s": round(num_seqs * args.steps / elapsed, 1)}


def _check(code: int, model) -> None:
    if code != 0:
        raise RuntimeError(f"decode returned {code}: {model.last_error}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    model_dir, tag, summary = resolve_model_args(args, device)
    workload = make_workload(args.num_seqs, summary["vocab_size"], args.context, args.context, 1, 1, seed=args.seed)
    name = args.output or f"core_api_decode_{device.type}_{tag}"
    print(f"model {scrub_path(model_dir)} on {device}; {args.num_seqs} sequences of {args.context} tokens, "
          f"{args.warmup} + {args.steps} decode calls of one token per sequence", flush=True)
    load_at_start = load_average()
    with torch.inference_mode():
        core, core_tokens = run_core_api(args, model_dir, device, workload.prompts)
    release_device_memory(device)
    rows = [core]
    engine = ratio = None
    if args.peer == "engine":
        engine, engine_tokens = run_engine(args, model_dir, device, workload.prompts)
        release_device_memory(device)
        agree = np.mean([a == b for a, b in zip(core_tokens, engine_tokens)])
        engine["greedy_sequences_identical_to_core_api"] = f"{int(agree * len(core_tokens))}/{len(core_tokens)}"
        ratio = round(core["tokens_per_s"] / engine["tokens_per_s"], 3)
        rows.append(engine)
    print(f"\n{'':52} {'ms/step':>9} {'tokens/s':>11}")
    for r in rows:
        print(f"{r['name']:52} {r['ms_per_step']:9.3f} {r['tokens_per_s']:11,.1f}")
    if engine is not None:
        print(f"core_api / engine decode throughput: {ratio:.2f}x; greedy sequences identical: "
              f"{engine['greedy_sequences_identical_to_core_api']}")
    facts = run_facts(device, load_at_start, argv, __file__)
    results = {
        "benchmark": "batched decode: core_api Model.decode against the engine's decode step",
        "gpu": facts.pop("gpu"),
        "model": summary,
        "tokens_per_s": core["tokens_per_s"],
        "peer_tokens_per_s": engine["tokens_per_s"] if engine else None,
        "ratio": ratio,
        "ratio_definition": "core_api tokens/s / engine tokens/s (> 1: the low-level API decodes faster)",
        **facts,
        "workload": {"num_seqs": args.num_seqs, "context": args.context, "warmup_steps": args.warmup,
                     "timed_steps": args.steps, "seed": args.seed, "greedy": True, "dtype": args.dtype,
                     "enforce_eager": args.enforce_eager},
        "core_api": core,
        "engine": engine,
    }
    path = write_results(name, results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
