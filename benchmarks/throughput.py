"""Offline throughput: NovaInfer's ``LLM.generate`` against transformers on the same model and requests.

The workload has nano-vllm's shape (its ``bench.py``): N sequences of random prompt token ids,
prompt and output lengths drawn uniformly, EOS ignored so every request produces exactly its own
output length. NovaInfer samples with the ``--temperature`` / ``--top-p`` / ``--top-k`` /
``--repetition-penalty`` / ``--logprobs`` / ``--seed-per-request`` settings and produces the text
(``--detokenize``, on by default as in vLLM's benchmark; ``--no-detokenize`` for token ids only).
A peer decodes greedy without text: it can only be compared with NovaInfer decoding greedy (with
or without text, which only adds to NovaInfer's work); sampled runs take ``--peer none``.

Two peers (``--peer``):

* ``continuous-batching``: transformers' continuous batching (the manager behind
  ``generate_batch``, paged KV cache, CUDA graphs on CUDA). Requests are added through the
  manager's ``add_request`` so that each gets its own ``max_new_tokens`` (``generate_batch`` takes
  one for all).
* ``generate``: transformers ``generate``, which has no continuous batching: requests are sorted by
  output length, cut into static batches of ``--peer-batch-size`` with left padding and an
  attention mask, and each batch runs to its longest output length. Only each request's own output
  length counts as useful output tokens (the extra tokens are the cost of static batching).

Each side is warmed up (not timed) on the same requests shaped like the workload's (see
``warmup_requests``; ``--no-warmup`` skips it, so that the first timed run measures a fresh process),
then timed ``--repeats`` times; the figures reported are those of the median run (all runs are kept
in the results file, with the first run's rate over the median's). On CPU the runs alternate between the
two sides (NovaInfer, peer, NovaInfer, ...), so that a burst of other work on a shared machine hits
both alike; on CUDA all NovaInfer runs come first and its engine (which reserves most of the GPU
memory for its KV cache) is shut down and its memory released before the peer loads. NovaInfer's
prefix cache is emptied before every timed run, so a repeat never reuses the previous run's prompts.
``--multiprocess`` runs the engine core in a process of its own (``LLM(multiprocess=True)``), so the
front-end's detokenization and outputs run beside its steps.

``--profile`` adds where NovaInfer's step time goes: executor (forward + sampling) against host
(scheduling + output processing) per step, and a ``torch.profiler`` table of the top kernels (CPU
operators on CPU) over ``--profile-steps`` decode steps of a full batch, run after the timed runs.

    python benchmarks/throughput.py      # tiny model on CPU: 256 requests, inputs 16-256, outputs 16-256,
                                         # 3 runs each, peer: transformers generate
    python benchmarks/throughput.py --arch qwen2-0.5b --temperature 0.6 --peer none --repeats 2 \\
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 \\
        --tokenizer ../shared/data/qwen2_tokenizer [--profile]
                                         # nano-vllm's workload and sampling (temperature 0.6, with text) on
                                         # a GPU (also: --arch qwen2-1.5b)
    python benchmarks/throughput.py --arch qwen2-0.5b --peer continuous-batching --repeats 1 \\
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --no-detokenize
                                         # the same workload, greedy, against transformers
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import itertools
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Workload, add_engine_arguments, add_model_arguments, add_output_arguments, \
    engine_kwargs, host_probe, load_average, load_transformers_model, make_workload, release_device_memory, \
    resolve_model_args, run_facts, scrub_path, steal_seconds, transformers_errors_only, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument("--num-seqs", type=int, default=256)
    w.add_argument("--min-input", type=int, default=16)
    w.add_argument("--max-input", type=int, default=256)
    w.add_argument("--min-output", type=int, default=16)
    w.add_argument("--max-output", type=int, default=256)
    w.add_argument("--seed", type=int, default=0, help="seed of the workload's random draws")
    add_engine_arguments(p)
    sampling = p.add_argument_group("sampling (NovaInfer's side; the peer runs greedy without text)")
    # A GPU run samples as nano-vllm's benchmark does: --temperature 0.6 (see the module docstring).
    sampling.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0: off")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (default: none)")
    sampling.add_argument("--seed-per-request", action="store_true",
                          help="each request samples from a generator of its own (seed = workload seed + index)")
    sampling.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=True,
                          help="produce the text as well, as LLM.generate does by default (the tokenizer must "
                               "cover the model's vocabulary: see --tokenizer)")
    sampling.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    add_output_arguments(p, "throughput_<device>_<model>")
    r = p.add_argument_group("runs")
    r.add_argument("--repeats", type=int, default=3, help="timed runs per side; the median run is reported")
    r.add_argument("--peer", default="generate", choices=[*PEERS, "none"], help="what NovaInfer is compared with")
    r.add_argument("--peer-batch-size", type=int, default=16, help="--peer generate: requests per static batch")
    r.add_argument("--peer-attn-implementation", default="paged|sdpa",
                   help="--peer continuous-batching: transformers attn_implementation")
    r.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="NovaInfer's warm-up run before the timed ones (--no-warmup: its first timed run is the "
                        "engine's first work in a fresh process, after what its start-up compiles and captures)")
    r.add_argument("--multiprocess", action="store_true",
                   help="the engine core in a process of its own (LLM(multiprocess=True)): scheduling, the forward "
                        "and sampling there, detokenization and outputs in this process (excludes --profile)")
    r.add_argument("--profile", action="store_true",
                   help="also report NovaInfer's step time split and a profiler table of decode steps")
    r.add_argument("--profile-steps", type=int, default=8, help="decode steps under torch.profiler")
    args = p.parse_args(argv)
    for flag in ("peer_batch_size", "repeats", "profile_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.profile and args.multiprocess:  # the profile reaches into the engine core
        p.error("--profile needs the engine core in this process: it excludes --multiprocess")
    greedy = {**sampling_settings(p.parse_args([])), "detokenize": args.detokenize}
    if args.peer != "none" and sampling_settings(args) != greedy:
        p.error("the peer runs greedy: pass --peer none with sampling or logprobs flags")
    return args


def sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every NovaInfer request of the run samples with (recorded in the results)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "repetition_penalty": args.repetition_penalty, "logprobs": args.logprobs,
            "seed_per_request": args.seed_per_request, "detokenize": args.detokenize}


def request_params(args: argparse.Namespace, max_tokens: int, index: int):
    """One request's parameters: the run's sampling settings, exactly ``max_tokens`` tokens."""
    from novainfer import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, logprobs=args.logprobs,
                          seed=args.seed + index if args.seed_per_request else None, ignore_eos=True,
                          max_tokens=max_tokens, detokenize=args.detokenize)


def warmup_requests(workload: Workload, token_budget: int) -> tuple[list[list[int]], list[int]]:
    """Requests shaped like the workload's first ones but with other prompts (so they leave nothing in a
    prefix cache to hit) and 1 to 8 output tokens each.

    There are enough of them to fill one step's token budget and spill over (or all of the workload's
    count, if fewer), so that the warm-up runs full prefill steps, a chunked prompt, mixed steps and
    decode steps of shrinking batches: every kernel the timed runs need is compiled before them.
    """
    rng = random.Random(workload.seed + 1)
    prompts: list[list[int]] = []
    output_lens: list[int] = []
    for i, prompt in enumerate(workload.prompts):
        prompts.append([rng.randrange(workload.token_id_limit) for _ in prompt])
        output_lens.append(min(workload.output_lens[i], 1 + i % 8))
        if sum(len(p) for p in prompts) > token_budget:
            break
    return prompts, output_lens


def timed_run(runner, workload: Workload) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed ``runner.generate`` of the whole workload: the figures every run of any side reports,
    with the host's speed just before and after it (:func:`host_probe`, outside the timed part)."""
    probe_before, steal_before = host_probe(), steal_seconds()
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = runner.generate(workload.prompts, workload.output_lens)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    probe_after, steal_after = host_probe(), steal_seconds()
    for i, (toks, want) in enumerate(zip(tokens, workload.output_lens)):
        if len(toks) != want:
            raise RuntimeError(f"{runner.name} request {i} produced {len(toks)} tokens, expected {want}")
    output_tokens = sum(len(t) for t in tokens)
    return {"output_tokens": output_tokens, "seconds": round(seconds, 4), "process_cpu_seconds": round(cpu_seconds, 3),
            "output_tokens_per_s": round(output_tokens / seconds, 2),
            "total_tokens_per_s": round((output_tokens + workload.total_input_tokens) / seconds, 2),
            "host_probe_ms": [probe_before["wall_ms"], probe_after["wall_ms"]],
            "host_probe_cpu_ms": [probe_before["cpu_ms"], probe_after["cpu_ms"]],
            "steal_s": None if steal_before is None else round(steal_after - steal_before, 3)}, tokens


# ---- NovaInfer ------------------------------------------------------------------------------------
_STAT_FIELDS = ("num_steps", "step_time_total", "model_time_total", "generation_tokens_total",
                "prompt_tokens_total", "num_preemptions_total", "prefix_cache_hits_total", "steps_by_kind",
                "step_time_by_kind")


def step_kind_breakdown(counts: Counter, seconds: Counter, total_seconds: float) -> dict[str, dict[str, float]]:
    """Per step kind (decode / mixed / prefill): count, mean ms and share of the step time. Under async
    scheduling a step's time includes waiting for the step before it, so the shares are approximate."""
    return {kind: {"count": int(counts[kind]),
                   "mean_ms": round(1e3 * seconds[kind] / counts[kind], 3) if counts[kind] else None,
                   "share_of_step_time": round(seconds[kind] / total_seconds, 4) if total_seconds > 0 else None}
            for kind in ("decode", "mixed", "prefill")}


class NovaInferRunner:
    name = "NovaInfer LLM.generate"

    def __init__(self, args: argparse.Namespace, model_dir: str, workload: Workload) -> None:
        from novainfer import LLM

        self.workload = workload
        self.args = args
        started = time.perf_counter()
        self.llm = LLM(model_dir, **engine_kwargs(args), tokenizer=args.tokenizer, multiprocess=args.multiprocess)
        self.load_seconds = time.perf_counter() - started
        self.engine = self.llm.llm_engine
        self.dtype = self.engine.model_config.torch_dtype
        self.device = self.engine.config.device
        if args.warmup:
            self.generate(*warmup_requests(workload, args.max_num_batched_tokens))  # warm-up, not timed

    def _stats(self) -> dict[str, Any]:
        stats = self.engine.get_stats()
        return {k: copy.copy(getattr(stats, k)) for k in _STAT_FIELDS}

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [request_params(self.args, n, i) for i, n in enumerate(output_lens)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        if self.args.enable_prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("could not empty NovaInfer's prefix cache (blocks still in use)")
        before = self._stats()
        result, tokens = timed_run(self, self.workload)
        delta = {k: v - before[k] for k, v in self._stats().items()}
        steps = int(delta["num_steps"])
        step_time, model_time = delta["step_time_total"], delta["model_time_total"]
        overhead = step_time - model_time
        return {
            **result,
            "steps": steps,
            "overhead_share": round(overhead / step_time, 4) if step_time > 0 else None,
            "overhead_ms_per_step": round(1e3 * overhead / steps, 3) if steps else None,
            "step_ms_avg": round(1e3 * step_time / steps, 3) if steps else None,
            "model_ms_per_step": round(1e3 * model_time / steps, 3) if steps else None,
            "step_time_total_s": round(step_time, 4),
            "model_time_total_s": round(model_time, 4),
            "outside_step_s": round(result["seconds"] - step_time, 4),
            "engine_generation_tokens": int(delta["generation_tokens_total"]),
            "engine_prompt_tokens_computed": int(delta["prompt_tokens_total"]),
            "preemptions": int(delta["num_preemptions_total"]),
            "prefix_cache_hit_tokens": int(delta["prefix_cache_hits_total"]),
            "step_kinds": step_kind_breakdown(delta["steps_by_kind"], delta["step_time_by_kind"], step_time),
        }, tokens

    def profile_decode(self, num_steps: int, top: int = 25) -> dict[str, Any]:
        """Profiles ``num_steps`` decode-only steps of a full batch of the workload's prompts, sampled
        as the timed runs sample.

        The requests go straight to the engine (``LLM.generate`` has no hook between steps) with
        final-only outputs, as ``generate`` makes them; once no step computes prompt tokens any more,
        every following step is a pure decode step. The requests are aborted afterwards.
        """
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        from novainfer.sampling_params import RequestOutputKind

        engine = self.engine
        max_len = engine.model_config.max_model_len
        batch = self.workload.prompts[:engine.config.scheduler_config.max_num_seqs]
        request_ids = [f"profile-{i}" for i in range(len(batch))]
        for index, (request_id, prompt) in enumerate(zip(request_ids, batch)):
            params = request_params(self.args, max_len - len(prompt), index)  # the run's sampling settings
            params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        try:
            prompt_tokens = -1
            while engine.get_stats().num_waiting_reqs or prompt_tokens != engine.get_stats().prompt_tokens_total:
                prompt_tokens = engine.get_stats().prompt_tokens_total
                engine.step()
            cuda = self.device.type == "cuda"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            started = time.perf_counter()
            with profile(activities=activities) as prof:
                for _ in range(num_steps):
                    engine.step()
                if cuda:
                    torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - started
            running = engine.get_stats().num_running_reqs  # fewer than the batch if the KV cache ran out
        finally:
            engine.abort_request(request_ids)

        # Kernels on CUDA (device time), operators on CPU (self CPU time): each counted once.
        kind = DeviceType.CUDA if cuda else DeviceType.CPU
        events = [e for e in prof.key_averages() if e.device_type == kind]
        time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        total_us = sum(time_of(e) for e in events) or 1.0
        rows = [{"name": e.key, "calls": e.count, "total_ms": round(time_of(e) / 1e3, 3),
                 "share": round(time_of(e) / total_us, 4)}
                for e in sorted(events, key=time_of, reverse=True)[:top]]
        return {"decode_steps": num_steps, "batch_size": running,
                "step_ms_mean_under_profiler": round(1e3 * seconds / num_steps, 3),
                "measured": "CUDA kernels, device time" if cuda else "CPU operators, self CPU time",
                "total_ms": round(total_us / 1e3, 3), "top": rows}

    def describe(self) -> dict[str, Any]:
        sched, cache = self.engine.config.scheduler_config, self.engine.config.cache_config
        return {"load_seconds": round(self.load_seconds, 2),
                "engine": {"dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                           "max_num_seqs": sched.max_num_seqs,
                           "max_num_batched_tokens": sched.max_num_batched_tokens,
                           "max_model_len": self.engine.model_config.max_model_len,
                           "gpu_memory_utilization": cache.gpu_memory_utilization,
                           "tensor_parallel_size": self.engine.config.parallel_config.tensor_parallel_size,
                           "distributed_executor_backend":
                               self.engine.config.parallel_config.distributed_executor_backend,
                           "disable_custom_all_reduce": self.engine.config.parallel_config.disable_custom_all_reduce,
                           "enable_vocab_parallel": self.engine.config.parallel_config.enable_vocab_parallel,
                           "async_scheduling": sched.async_scheduling,
                           "kv_cache_blocks": self.engine.engine_core.info.num_blocks,
                           "multiprocess": self.engine.multiprocess,
                           "block_size": cache.block_size, "enable_prefix_caching": cache.enable_prefix_caching},
                "note": "overhead = step time outside executor.execute_model (scheduling + output "
                        "processing), from EngineStats of the timed generate only; the prefix cache is "
                        "emptied before each timed run"}

    def close(self) -> None:
        self.llm.shutdown()  # releases the model and KV cache
        del self.llm, self.engine
        gc.collect()


def step_breakdown(result: dict[str, Any]) -> dict[str, Any]:
    """Where the median run's time went, per engine step (from EngineStats)."""
    return {"steps": result["steps"], "step_ms_mean": result["step_ms_avg"],
            "executor_ms_mean": result["model_ms_per_step"], "host_ms_mean": result["overhead_ms_per_step"],
            "host_share_of_step": result["overhead_share"], "outside_steps_s": result["outside_step_s"],
            "definitions": "executor = forward + sampling (executor.execute_model); host = scheduling + output "
                           "processing (the rest of LLMEngine.step); outside steps = LLM.generate's own work "
                           "(adding requests, collecting outputs)"}


# ---- transformers generate (static batches) --------------------------------------------------------
class TransformersGenerateRunner:
    name = "transformers generate"

    def __init__(self, args: argparse.Namespace, model_dir: str, workload: Workload, dtype, device) -> None:
        import torch
        from transformers import AutoTokenizer

        self.workload, self.device, self.dtype, self.batch_size = workload, device, dtype, args.peer_batch_size
        started = time.perf_counter()
        self.model = load_transformers_model(model_dir, dtype, device)
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

        self.generate(*warmup_requests(workload, args.max_num_batched_tokens))  # warm-up, not timed

    def _generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
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

    def _static_batches(self, output_lens: list[int]) -> list[list[int]]:
        """Request indices sorted by output length, cut into batches of ``batch_size``."""
        order = sorted(range(len(output_lens)), key=lambda i: (output_lens[i], i))
        return [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        tokens: list[list[int]] = [[] for _ in prompts]
        with transformers_errors_only():
            for batch in self._static_batches(output_lens):
                new = self._generate_batch([prompts[i] for i in batch], max(output_lens[i] for i in batch))
                for i, row in zip(batch, new):
                    tokens[i] = row[:output_lens[i]]
        return tokens

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        return timed_run(self, self.workload)

    def describe(self) -> dict[str, Any]:
        w = self.workload
        batches = self._static_batches(w.output_lens)
        generated = sum(len(b) * max(w.output_lens[i] for i in b) for b in batches)
        padded_prompt = sum(len(b) * max(len(w.prompts[i]) for i in b) for b in batches)
        return {"generated_tokens_incl_padding_waste": generated, "padded_prompt_tokens": padded_prompt,
                "batch_size": self.batch_size, "num_batches": len(batches),
                "load_seconds": round(self.load_seconds, 2), "dtype": str(self.dtype).removeprefix("torch."),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "method": "greedy (do_sample=False), eos_token_id=-1; requests sorted by output length, static "
                          "batches with left padding + attention_mask, max_new_tokens = the batch's longest "
                          "output; only each request's own output length counts as output tokens"}

    def summary_line(self) -> str:
        return (f"static batches of {self.batch_size} sorted by output length, left padding; "
                f"{self.describe()['generated_tokens_incl_padding_waste']} tokens generated, only each request's "
                f"own output length counted")

    def close(self) -> None:
        del self.model
        gc.collect()


# ---- transformers continuous batching --------------------------------------------------------------
class TransformersContinuousBatchingRunner:
    name = "transformers continuous batching"

    # Fields of transformers' ContinuousBatchingConfig worth recording once the manager has resolved them.
    _CONFIG_FIELDS = ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
                      "max_memory_percent", "use_cuda_graph", "use_async_batching", "allow_block_sharing",
                      "scheduler_type")

    def __init__(self, args: argparse.Namespace, model_dir: str, workload: Workload, dtype, device) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.workload, self.dtype, self.device = workload, dtype, device
        started = time.perf_counter()
        self.model = load_transformers_model(model_dir, dtype, device, args.peer_attn_implementation)
        self.load_seconds = time.perf_counter() - started
        cuda = device.type == "cuda"
        # Greedy, and an EOS id no token has: every request runs to its own max_new_tokens.
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                             max_new_tokens=max(workload.output_lens))
        # A cache that holds every request of the workload at once, so the peer never preempts. Not
        # its default (a share of free memory): its paged sdpa path expands the KV heads of the whole
        # cache in every layer, which at 90% of an H200 runs out of memory in warm-up.
        page = _tokens_per_block(ContinuousBatchingConfig())
        num_blocks = sum(-(-(len(p) + n) // page) for p, n in zip(workload.prompts, workload.output_lens)) + 2
        # No block sharing (prefix caching): the random prompts share no prefix, so it could only let a
        # repeat reuse the previous run's prompts (NovaInfer empties its prefix cache before each run).
        options = {"num_blocks": num_blocks, "max_requests_per_batch": args.max_num_seqs, "use_cuda_graph": cuda,
                   "allow_block_sharing": False}
        if "auto_switch_to_flash" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}:
            options["auto_switch_to_flash"] = False  # newer transformers: keep the attention asked for
        cb_config = ContinuousBatchingConfig(**options)
        started = time.perf_counter()
        with transformers_errors_only():
            self.manager = self.model.init_continuous_batching(generation_config=generation_config,
                                                               continuous_batching_config=cb_config)
            self.manager.warmup()  # allocates the cache and captures the CUDA graphs
            self.manager.start()
        self._ids = itertools.count()
        self.generate(*warmup_requests(workload, args.max_num_batched_tokens))  # warm-up, not timed
        self.warmup_seconds = time.perf_counter() - started

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        request_ids = []
        for prompt, n in zip(prompts, max_new_tokens):
            request_id = f"req-{next(self._ids)}"
            if self.manager.add_request(prompt, request_id=request_id, max_new_tokens=n) is None:
                raise RuntimeError("transformers' continuous batching manager refused a request")
            request_ids.append(request_id)
        finished: dict[str, Any] = {}
        while len(finished) < len(request_ids):
            output = self.manager.get_result(timeout=1)
            if output is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
            elif output.is_finished():
                if output.error:
                    raise RuntimeError(f"transformers request {output.request_id} failed: {output.error}")
                finished[output.request_id] = output
        return [list(finished[r].generated_tokens) for r in request_ids]

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        return timed_run(self, self.workload)

    def describe(self) -> dict[str, Any]:
        config = self.manager.continuous_batching_config
        return {"load_seconds": round(self.load_seconds, 2), "warmup_seconds": round(self.warmup_seconds, 2),
                "dtype": str(self.dtype).removeprefix("torch."),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "continuous_batching_config": {k: getattr(config, k, None) for k in self._CONFIG_FIELDS},
                "method": "model.init_continuous_batching (the manager behind generate_batch), warmup(), then "
                          "every request through add_request with its own max_new_tokens; greedy "
                          "(do_sample=False), eos_token_id=-1"}

    def summary_line(self) -> str:
        config = self.describe()["continuous_batching_config"]
        return (f"attn {self.model.config._attn_implementation}, CUDA graphs {config['use_cuda_graph']}, "
                f"max_batch_tokens {config['max_batch_tokens']}, {config['num_blocks']} blocks of "
                f"{_tokens_per_block(self.manager.continuous_batching_config)} tokens")

    def close(self) -> None:
        self.manager.stop(block=True)
        del self.manager, self.model
        gc.collect()


def _tokens_per_block(config) -> int:
    """Tokens per KV block of a ContinuousBatchingConfig (``page_size``; ``block_size`` in transformers <= 5.17)."""
    return getattr(config, "page_size", None) or config.block_size


PEERS = {"continuous-batching": TransformersContinuousBatchingRunner, "generate": TransformersGenerateRunner}


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
    rates_ = [r["output_tokens_per_s"] for r in runs]
    return {**median, "repeats": len(runs),
            "output_tokens_per_s_min_median_max": [min(rates_), round(statistics.median(rates_), 2), max(rates_)],
            "first_run_vs_median": round(rates_[0] / statistics.median(rates_), 4),
            "runs": runs}


def _timed(label: str, runner, runs: list, index: int, repeats: int) -> list[list[int]]:
    result, tokens = runner.run()
    runs.append(result)
    print(f"  run {index + 1}/{repeats} {label}: {result['seconds']:.2f} s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return tokens


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
    print(f"{'':34} {'output tok/s':>13} {'total tok/s':>12} {'time s':>8}")
    for label, r in rows:
        print(f"{label:34} {r['output_tokens_per_s']:13,.1f} {r['total_tokens_per_s']:12,.1f} {r['seconds']:8.2f}")


def print_profile(breakdown: dict[str, Any], decode: dict[str, Any] | None) -> None:
    print(f"NovaInfer steps: {breakdown['steps']}, {breakdown['step_ms_mean']:.2f} ms/step = executor "
          f"{breakdown['executor_ms_mean']:.2f} ms (forward + sampling) + host {breakdown['host_ms_mean']:.2f} ms "
          f"(scheduling + output processing, {100 * breakdown['host_share_of_step']:.1f}%); "
          f"{breakdown['outside_steps_s']:.2f} s outside steps")
    if decode:
        print(f"{decode['decode_steps']} decode steps of {decode['batch_size']} requests under torch.profiler "
              f"({decode['step_ms_mean_under_profiler']:.2f} ms/step), {decode['measured']}:")
        for row in decode["top"]:
            print(f"  {100 * row['share']:5.1f}% {row['total_ms']:9.3f} ms {row['calls']:6d}x  {row['name'][:90]}")


def profile_figures(nova: NovaInferRunner, nova_result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``--profile``'s figures: the timed runs' step breakdown and a profile of decode steps."""
    return {"step_breakdown": step_breakdown(nova_result), "decode_profile": nova.profile_decode(args.profile_steps)}


def resolve_run(args: argparse.Namespace) -> tuple[Any, str, str, dict[str, Any], Workload]:
    """The device, the model (directory, results-file tag, summary) and the workload of a run's flags."""
    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    model_dir, tag, summary = resolve_model_args(args, device)
    workload = make_workload(args.num_seqs, summary["vocab_size"], args.min_input, args.max_input,
                             args.min_output, args.max_output, seed=args.seed)
    return device, model_dir, tag, summary, workload


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, model_dir, tag, summary, workload = resolve_run(args)
    name = args.output or f"throughput_{device.type}_{tag}"
    print(f"model {scrub_path(model_dir)} on {device}; {workload.num_seqs} requests, "
          f"{workload.total_input_tokens} prompt tokens, {workload.total_output_tokens} output tokens "
          f"(inputs {args.min_input}-{args.max_input}, outputs {args.min_output}-{args.max_output}, "
          f"ignore_eos, seed {args.seed}); sampling {sampling_settings(args)}; {args.repeats} timed runs per side",
          flush=True)

    load_at_start = load_average()
    peer_class = PEERS.get(args.peer)
    nova_runs: list[dict[str, Any]] = []
    peer_runs: list[dict[str, Any]] = []
    nova = NovaInferRunner(args, model_dir, workload)
    interleave = device.type == "cpu" and peer_class is not None
    peer = peer_class(args, model_dir, workload, nova.dtype, device) if interleave else None
    nova_tokens = peer_tokens = None
    for r in range(args.repeats):
        nova_tokens = _timed("NovaInfer", nova, nova_runs, r, args.repeats)
        if interleave:
            peer_tokens = _timed(peer.name, peer, peer_runs, r, args.repeats)
    nova_result = {**summarize(nova_runs), **nova.describe()}
    # A finished torch.profiler session may leave CUDA's profiling interface attached, which slows every
    # later kernel launch in the process: nothing timed may follow a profile. With a peer timed after
    # NovaInfer, the profile is taken after the peer's runs, in an engine of its own.
    profile_after_peer = args.profile and peer_class is not None and not interleave
    if args.profile and not profile_after_peer:
        nova_result["profile"] = profile_figures(nova, nova_result, args)
    nova.close()
    memory_left = release_device_memory(device)
    if peer_class is not None and not interleave:
        peer = peer_class(args, model_dir, workload, nova.dtype, device)
        for r in range(args.repeats):
            peer_tokens = _timed(peer.name, peer, peer_runs, r, args.repeats)

    rows = [("NovaInfer LLM.generate", nova_result)]
    peer_result = ratio = None
    if peer is not None:
        peer_result = {"name": peer.name, **summarize(peer_runs), **peer.describe(),
                       "greedy_agreement_with_novainfer": agreement(nova_tokens, peer_tokens)}
        summary_line = peer.summary_line()
        peer.close()
        release_device_memory(device)
        ratio = round(nova_result["output_tokens_per_s"] / peer_result["output_tokens_per_s"], 3)
        rows.append((peer.name, peer_result))
    if profile_after_peer:
        profiled = NovaInferRunner(args, model_dir, workload)
        nova_result["profile"] = profile_figures(profiled, nova_result, args)
        profiled.close()
        release_device_memory(device)
    print(f"\nmedian of {args.repeats} run(s); {workload.total_output_tokens} output tokens")
    print_table(rows)
    for kind, row in nova_result["step_kinds"].items():
        if row["count"]:
            print(f"  {kind} steps: {row['count']}, {row['mean_ms']:.2f} ms each, "
                  f"{100 * row['share_of_step_time']:.1f}% of step time")
    if peer_result is not None:
        agree = peer_result["greedy_agreement_with_novainfer"]
        print(f"peer: {summary_line}")
        print(f"speedup NovaInfer / {peer.name}: {ratio:.2f}x (greedy outputs identical for "
              f"{agree['identical_requests']}/{agree['num_requests']} requests)")
    if args.profile:
        print_profile(nova_result["profile"]["step_breakdown"], nova_result["profile"]["decode_profile"])

    facts = run_facts(device, load_at_start, argv, __file__)
    results = {
        "benchmark": "throughput (offline, nano-vllm shape)",
        "gpu": facts.pop("gpu"),
        "model": summary,
        "engine": "novainfer",
        "output_tokens_per_s": nova_result["output_tokens_per_s"],
        "total_tokens_per_s": nova_result["total_tokens_per_s"],
        "peer_output_tokens_per_s": peer_result["output_tokens_per_s"] if peer_result else None,
        "ratio": ratio,
        "ratio_definition": "median-run NovaInfer output tokens/s / median-run peer output tokens/s",
        **facts,
        "workload": workload.describe(),
        "sampling": sampling_settings(args),
        "novainfer": nova_result,
        "device_memory_after_novainfer_shutdown": memory_left,
        "peer": peer_result,
    }
    path = write_results(name, results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
