"""Offline throughput: NovaInfer's ``LLM.generate`` against transformers' ``generate`` on the same requests.

The workload has nano-vllm's shape (its ``bench.py``): N sequences of random prompt token ids,
prompt and output lengths drawn uniformly, EOS ignored so every request produces exactly its own
output length. Decoding is greedy (temperature 0) on both sides, so both do the same work.

The peer, transformers ``generate``, has no continuous batching: requests are sorted by output
length, cut into static batches of ``--peer-batch-size`` with left padding and an attention mask,
and each batch runs to its longest output length. Only each request's own output length counts
as useful output tokens (the extra tokens of shorter requests in a batch are wasted work, which
is the cost of static batching).

Each side is warmed up (not timed), then timed ``--repeats`` times; the figures reported are those
of the median run (all runs are kept in the results file). On CPU the runs alternate between the
two sides (NovaInfer, transformers, NovaInfer, ...), so that a burst of other work on a shared
machine hits both alike; on CUDA all NovaInfer runs come first and its engine (which reserves most
of the GPU memory for its KV cache) is shut down before transformers loads. NovaInfer's prefix
cache is emptied before every timed run, so a repeat never reuses the previous run's prompts.

    python benchmarks/throughput.py      # tiny model on CPU: 256 requests, inputs 16-256, outputs 16-256,
                                         # 3 runs each: ~1.5 minutes on 2 idle cores
    python benchmarks/throughput.py --model DIR --device cuda --num-seqs 256 \\
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --output throughput_gpu_qwen
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Workload, command_line, git_commit, load_average, machine_info, make_workload, \
    model_summary, resolve_model, scrub_path, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: the built-in tiny random Qwen2)")
    p.add_argument("--tiny-config", default=None,
                   help='JSON overrides for a tiny model variant, e.g. \'{"hidden_size": 256}\'')
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input", type=int, default=16)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's random draws")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument("--max-num-seqs", type=int, default=256, help="NovaInfer: most sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="NovaInfer: most tokens per step (default: the engine's, max(8192, max_model_len))")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side; the median run is reported")
    p.add_argument("--skip-peer", action="store_true", help="do not run transformers generate")
    p.add_argument("--peer-batch-size", type=int, default=16, help="transformers: requests per static batch")
    p.add_argument("--output", default=None,
                   help="results file name under benchmarks/results/ (default: throughput_<device>_<model>)")
    args = p.parse_args(argv)
    if args.peer_batch_size < 1:
        p.error("--peer-batch-size must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def warmup_prompts(workload: Workload) -> list[list[int]]:
    """Short prompts that are not in the workload (so they leave nothing in the prefix cache to hit)."""
    rng = random.Random(workload.seed + 1)
    return [[rng.randrange(workload.token_id_limit) for _ in range(n)] for n in (24, 8)]


# ---- NovaInfer ------------------------------------------------------------------------------------
_STAT_FIELDS = ("num_steps", "step_time_total", "model_time_total", "generation_tokens_total",
                "prompt_tokens_total", "num_preemptions_total", "prefix_cache_hits_total")


class NovaInferRunner:
    name = "NovaInfer LLM.generate"

    def __init__(self, args: argparse.Namespace, model_dir: str, workload: Workload) -> None:
        from novainfer import LLM, SamplingParams

        self.workload = workload
        engine_args: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs}
        if args.max_num_batched_tokens is not None:
            engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
        started = time.perf_counter()
        self.llm = LLM(model_dir, **engine_args)
        self.load_seconds = time.perf_counter() - started
        self.engine = self.llm.llm_engine
        self.dtype = self.engine.model_config.torch_dtype
        self.device = self.engine.config.device
        self.params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in workload.output_lens]
        # Warm-up, not timed: a couple of short requests through prefill and decode.
        self.llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4),
                          use_tqdm=False)

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        if not self.engine.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("could not empty NovaInfer's prefix cache (blocks still in use)")
        before = {k: getattr(self.engine.get_stats(), k) for k in _STAT_FIELDS}
        started, cpu_started = time.perf_counter(), time.process_time()
        outputs = self.llm.generate(self.workload.prompts, self.params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        after = {k: getattr(self.engine.get_stats(), k) for k in _STAT_FIELDS}
        delta = {k: after[k] - before[k] for k in _STAT_FIELDS}

        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        for i, (toks, want) in enumerate(zip(tokens, self.workload.output_lens)):
            if len(toks) != want:
                raise RuntimeError(f"NovaInfer request {i} produced {len(toks)} tokens, expected {want} "
                                   f"(finish_reason={outputs[i].outputs[0].finish_reason})")
        output_tokens = sum(len(t) for t in tokens)
        steps = int(delta["num_steps"])
        step_time, model_time = delta["step_time_total"], delta["model_time_total"]
        overhead = step_time - model_time
        return {
            "output_tokens": output_tokens,
            "seconds": round(seconds, 4),
            "process_cpu_seconds": round(cpu_seconds, 3),
            "output_tokens_per_s": round(output_tokens / seconds, 2),
            "total_tokens_per_s": round((output_tokens + self.workload.total_input_tokens) / seconds, 2),
            "steps": steps,
            "overhead_share": round(overhead / step_time, 4) if step_time > 0 else None,
            "overhead_ms_per_step": round(1e3 * overhead / steps, 3) if steps else None,
            "step_ms_avg": round(1e3 * step_time / steps, 3) if steps else None,
            "model_ms_per_step": round(1e3 * model_time / steps, 3) if steps else None,
            "step_time_total_s": round(step_time, 4),
            "model_time_total_s": round(model_time, 4),
            "outside_step_s": round(seconds - step_time, 4),
            "engine_generation_tokens": int(delta["generation_tokens_total"]),
            "engine_prompt_tokens_computed": int(delta["prompt_tokens_total"]),
            "preemptions": int(delta["num_preemptions_total"]),
            "prefix_cache_hit_tokens": int(delta["prefix_cache_hits_total"]),
        }, tokens

    def describe(self) -> dict[str, Any]:
        sched, cache = self.engine.config.scheduler_config, self.engine.config.cache_config
        return {"load_seconds": round(self.load_seconds, 2),
                "engine": {"dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                           "max_num_seqs": sched.max_num_seqs,
                           "max_num_batched_tokens": sched.max_num_batched_tokens,
                           "kv_cache_blocks": self.engine.kv_cache_manager.num_blocks,
                           "block_size": cache.block_size, "enable_prefix_caching": cache.enable_prefix_caching},
                "note": "overhead = step time outside executor.execute_model (scheduling + output "
                        "processing), from EngineStats of the timed generate only; the prefix cache is "
                        "emptied before each timed run"}

    def close(self) -> None:
        self.engine.shutdown()  # releases the model and KV cache
        del self.llm, self.engine
        gc.collect()


# ---- transformers generate -----------------------------------------------------------------------
class TransformersRunner:
    name = "transformers generate"

    def __init__(self, args: argparse.Namespace, model_dir: str, workload: Workload, dtype, device) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.workload, self.device, self.dtype, self.batch_size = workload, device, dtype, args.peer_batch_size
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.load_seconds = time.perf_counter() - started
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

        config = copy.deepcopy(self.model.generation_config)
        config.do_sample = False
        config.repetition_penalty = 1.0  # plain greedy, as NovaInfer's temperature=0 requests
        config.eos_token_id = -1  # an id no token has: never stops before max_new_tokens (as tests/utils.py)
        config.pad_token_id = self.pad_id
        config.min_new_tokens = None
        self.config = config
        self._torch = torch

        order = sorted(range(workload.num_seqs), key=lambda i: (workload.output_lens[i], i))
        self.batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        self._quiet(lambda: self._generate(warmup_prompts(workload), 4))  # warm-up, not timed

    def _quiet(self, fn):
        from transformers.utils import logging as transformers_logging

        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # it warns that -1 is not a real token id
        try:
            return fn()
        finally:
            transformers_logging.set_verbosity(verbosity)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        torch = self._torch
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        self.config.max_new_tokens = max_new_tokens
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention_mask.to(self.device), generation_config=self.config)
        new = out[:, width:].tolist()  # .tolist() synchronises with the device
        if any(len(r) != max_new_tokens for r in new):
            raise RuntimeError("transformers stopped early: EOS was not disabled")
        return new

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        w = self.workload

        def timed():
            tokens: list[list[int]] = [[] for _ in range(w.num_seqs)]
            started, cpu_started = time.perf_counter(), time.process_time()
            for batch in self.batches:
                new = self._generate([w.prompts[i] for i in batch], max(w.output_lens[i] for i in batch))
                for i, row in zip(batch, new):
                    tokens[i] = row[:w.output_lens[i]]
            return tokens, time.perf_counter() - started, time.process_time() - cpu_started

        tokens, seconds, cpu_seconds = self._quiet(timed)
        useful = sum(len(t) for t in tokens)
        return {
            "output_tokens": useful,
            "seconds": round(seconds, 4),
            "process_cpu_seconds": round(cpu_seconds, 3),
            "output_tokens_per_s": round(useful / seconds, 2),
            "total_tokens_per_s": round((useful + w.total_input_tokens) / seconds, 2),
        }, tokens

    def describe(self) -> dict[str, Any]:
        w = self.workload
        generated = sum(len(b) * max(w.output_lens[i] for i in b) for b in self.batches)
        padded_prompt = sum(len(b) * max(len(w.prompts[i]) for i in b) for b in self.batches)
        return {"generated_tokens_incl_padding_waste": generated, "padded_prompt_tokens": padded_prompt,
                "batch_size": self.batch_size, "num_batches": len(self.batches),
                "load_seconds": round(self.load_seconds, 2), "dtype": str(self.dtype).removeprefix("torch."),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "method": "greedy (do_sample=False), eos_token_id=-1; requests sorted by output length, static "
                          "batches with left padding + attention_mask, max_new_tokens = the batch's longest "
                          "output; only each request's own output length counts as output tokens"}

    def close(self) -> None:
        del self.model
        gc.collect()


# ---- putting it together ---------------------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far the two greedy outputs agree (informative: padding and batching change float rounding)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            prefix += 1
    total = sum(len(x) for x in a)
    return {"identical_requests": same, "num_requests": len(a),
            "matching_prefix_token_share": round(prefix / total, 4) if total else None}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's figures (by wall time; the lower middle one for an even count), plus every run."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    median = ordered[(len(ordered) - 1) // 2]
    rates = [r["output_tokens_per_s"] for r in runs]
    return {**median, "repeats": len(runs),
            "output_tokens_per_s_min_median_max": [min(rates), round(statistics.median(rates), 2), max(rates)],
            "runs": runs}


def _timed(label: str, runner, runs: list, index: int, repeats: int) -> list[list[int]]:
    result, tokens = runner.run()
    runs.append(result)
    print(f"  run {index + 1}/{repeats} {label}: {result['seconds']:.2f} s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    model_dir, tag = resolve_model(args.model, args.tiny_config)
    summary = model_summary(model_dir, json.loads(args.tiny_config) if args.tiny_config else None)
    workload = make_workload(args.num_seqs, summary["vocab_size"], args.min_input, args.max_input,
                             args.min_output, args.max_output, seed=args.seed)
    name = args.output or f"throughput_{device.type}_{tag}"
    print(f"model {scrub_path(model_dir)} on {device}; {workload.num_seqs} requests, "
          f"{workload.total_input_tokens} prompt tokens, {workload.total_output_tokens} output tokens "
          f"(inputs {args.min_input}-{args.max_input}, outputs {args.min_output}-{args.max_output}, "
          f"greedy, ignore_eos, seed {args.seed}); {args.repeats} timed runs per side", flush=True)

    load_at_start = load_average()
    nova_runs: list[dict[str, Any]] = []
    peer_runs: list[dict[str, Any]] = []
    nova = NovaInferRunner(args, model_dir, workload)
    interleave = device.type == "cpu" and not args.skip_peer
    peer = TransformersRunner(args, model_dir, workload, nova.dtype, device) if interleave else None
    nova_tokens = peer_tokens = None
    for r in range(args.repeats):
        nova_tokens = _timed("NovaInfer", nova, nova_runs, r, args.repeats)
        if interleave:
            peer_tokens = _timed("transformers", peer, peer_runs, r, args.repeats)
    nova_info = nova.describe()
    nova.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_peer and not interleave:
        peer = TransformersRunner(args, model_dir, workload, nova.dtype, device)
        for r in range(args.repeats):
            peer_tokens = _timed("transformers", peer, peer_runs, r, args.repeats)

    nova_result = {**summarize(nova_runs), **nova_info}
    print(f"NovaInfer:             {nova_result['output_tokens']} tokens in {nova_result['seconds']:.2f} s = "
          f"{nova_result['output_tokens_per_s']:.1f} output tok/s (median of {args.repeats}); "
          f"{nova_result['steps']} steps, {100 * nova_result['overhead_share']:.1f}% of step time outside the "
          f"model ({nova_result['overhead_ms_per_step']:.2f} ms/step of {nova_result['step_ms_avg']:.2f} ms)")
    peer_result = ratio = None
    if peer is not None:
        peer_result = {"name": "transformers generate", **summarize(peer_runs), **peer.describe(),
                       "greedy_agreement_with_novainfer": agreement(nova_tokens, peer_tokens)}
        peer.close()
        ratio = round(nova_result["output_tokens_per_s"] / peer_result["output_tokens_per_s"], 3)
        print(f"transformers generate: {peer_result['output_tokens']} useful tokens in "
              f"{peer_result['seconds']:.2f} s = {peer_result['output_tokens_per_s']:.1f} output tok/s (median of "
              f"{args.repeats}; static batches of {args.peer_batch_size} sorted by output length, left padding; "
              f"{peer_result['generated_tokens_incl_padding_waste']} tokens generated, only each request's own "
              f"output length counted)")
        agree = peer_result["greedy_agreement_with_novainfer"]
        print(f"ratio NovaInfer / transformers: {ratio:.2f}x   (greedy outputs identical for "
              f"{agree['identical_requests']}/{agree['num_requests']} requests)")

    results = {
        "benchmark": "throughput (offline, nano-vllm shape)",
        "machine": {**machine_info(device), "load_average_1_5_15m": {"start": load_at_start, "end": load_average()}},
        "commit": git_commit(),
        "command": command_line(),
        "model": summary,
        "workload": workload.describe(),
        "novainfer": nova_result,
        "peer": peer_result,
        "ratio": ratio,
        "ratio_definition": "median-run NovaInfer output tokens/s / median-run transformers generate output tokens/s",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = write_results(name, results)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
