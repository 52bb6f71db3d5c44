"""Single-stream decode latency: time per output token at batch 1, NovaInfer against transformers.

One request alone (``--input-len`` random prompt token ids, ``--output-len`` new tokens, greedy,
EOS ignored) is generated ``--warmup`` times untimed, then ``--repeats`` times timed. Each run
records when the first new token reaches the caller (TTFT) and when the last one does (total);
TPOT = (total - TTFT) / (n - 1), the decode time per token without the prefill. Reported: the
median of each over the timed runs.

* NovaInfer: ``LLM.generate_stream`` (the first streamed output holding a token marks TTFT), its
  prefix cache emptied before each run.
* transformers: ``generate`` with ``cache_implementation="static"`` and, on CUDA, the decode
  forward compiled by ``generate`` itself (``compile_config``: ``torch.compile`` with
  ``mode="reduce-overhead"``, i.e. CUDA graphs, and ``fullgraph=True``), as transformers
  documents for 5.x. A streamer marks the first token; transformers already copies every token
  to the host for its stopping check, so the streamer adds no synchronisation. On CPU,
  ``generate`` does not compile.

On CUDA, NovaInfer runs first and its engine is shut down and its memory released before
transformers loads.

    python benchmarks/latency.py                       # tiny model on CPU
    python benchmarks/latency.py --arch qwen2-0.5b     # a real architecture on the GPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers.generation.streamers import BaseStreamer

from benchmarks.common import add_engine_arguments, add_model_arguments, add_output_arguments, \
    engine_kwargs, greedy_params, load_average, load_transformers_model, make_workload, release_device_memory, \
    resolve_model_args, run_facts, scrub_path, transformers_errors_only, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    w.add_argument("--output-len", type=int, default=256, help="new tokens (EOS ignored)")
    w.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    w.add_argument("--ttft-input-lens", type=int, nargs="*", default=[],
                   help="also NovaInfer's TTFT alone (one new token) for prompts of these lengths, e.g. 1024 8192 30000")
    add_engine_arguments(p)
    add_output_arguments(p, "latency_<device>_<model>")
    r = p.add_argument_group("runs")
    r.add_argument("--warmup", type=int, default=3, help="untimed runs per side first (the peer compiles in these)")
    r.add_argument("--repeats", type=int, default=5, help="timed runs per side; medians are reported")
    r.add_argument("--peer", default="generate", choices=["generate", "none"],
                   help="generate: transformers' static-cache generate, compiled on CUDA")
    r.add_argument("--peer-attn-implementation", default="sdpa", help="transformers attn_implementation")
    r.add_argument("--peer-compile-mode", default="reduce-overhead", help="torch.compile mode of the peer's decode")
    args = p.parse_args(argv)
    if args.input_len < 1 or args.output_len < 2:
        p.error(f"need --input-len >= 1 and --output-len >= 2 (TPOT needs a second token), "
                f"got {args.input_len} and {args.output_len}")
    if args.warmup < 0 or args.repeats < 1:
        p.error(f"need --warmup >= 0 and --repeats >= 1, got {args.warmup} and {args.repeats}")
    return args


@dataclass
class Run:
    """One timed generation as the caller saw it."""

    ttft_s: float
    total_s: float
    num_tokens: int

    @property
    def tpot_ms(self) -> float:
        return 1e3 * (self.total_s - self.ttft_s) / (self.num_tokens - 1)


def measure(side, prompt: list[int], num_tokens: int, warmup: int, repeats: int) -> tuple[list[Run], list[int]]:
    """``warmup`` untimed then ``repeats`` timed runs of ``side.generate``; checks every run's length."""
    runs, tokens = [], []
    for i in range(warmup + repeats):
        run, tokens = side.generate(prompt, num_tokens)
        if run.num_tokens != num_tokens:
            raise RuntimeError(f"{side.name} produced {run.num_tokens} tokens, expected {num_tokens}")
        if i >= warmup:
            runs.append(run)
            print(f"  run {i - warmup + 1}/{repeats} {side.name}: TTFT {1e3 * run.ttft_s:.1f} ms, "
                  f"TPOT {run.tpot_ms:.2f} ms", flush=True)
    return runs, tokens


def measure_ttft(side, vocab_size: int, lengths: list[int], warmup: int, repeats: int,
                 seed: int) -> dict[str, float]:
    """Median TTFT in ms of one request per prompt length (random prompts; one new token)."""
    ttft = {}
    for length in lengths:
        prompt = make_workload(1, vocab_size, length, length, 1, 1, seed=seed + length).prompts[0]
        times = [side.generate(prompt, 1)[0].ttft_s for _ in range(warmup + repeats)][warmup:]
        ttft[str(length)] = round(1e3 * statistics.median(times), 3)
        print(f"  TTFT of a {length}-token prompt: {ttft[str(length)]:.2f} ms (median of {repeats})", flush=True)
    return ttft


def summarize(runs: list[Run]) -> dict[str, Any]:
    tpot = statistics.median(r.tpot_ms for r in runs)
    return {"tpot_ms": round(tpot, 3), "ttft_ms": round(1e3 * statistics.median(r.ttft_s for r in runs), 3),
            "total_s": round(statistics.median(r.total_s for r in runs), 4),
            "decode_tokens_per_s": round(1e3 / tpot, 1), "repeats": len(runs),
            "runs": [{**asdict(r), "tpot_ms": round(r.tpot_ms, 3)} for r in runs]}


# ---- NovaInfer ------------------------------------------------------------------------------------
class NovaInferSide:
    name = "NovaInfer"

    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        from novainfer import LLM

        self.llm = LLM(model_dir, **engine_kwargs(args))
        self.engine = self.llm.llm_engine
        self.dtype = self.engine.model_config.torch_dtype

    def generate(self, prompt: list[int], num_tokens: int) -> tuple[Run, list[int]]:
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("could not empty NovaInfer's prefix cache (blocks still in use)")
        first = None
        started = time.perf_counter()
        for output in self.llm.generate_stream({"prompt_token_ids": prompt}, greedy_params(num_tokens)):
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
            last = output
        total = time.perf_counter() - started
        tokens = list(last.outputs[0].token_ids)
        return Run(first - started, total, len(tokens)), tokens

    def describe(self) -> dict[str, Any]:
        return {"method": "LLM.generate_stream, one request; TTFT when the first output holding a token arrives",
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.engine.config.device),
                "max_num_batched_tokens": self.engine.config.scheduler_config.max_num_batched_tokens,
                "tensor_parallel_size": self.engine.config.parallel_config.tensor_parallel_size}

    def close(self) -> None:
        self.llm.shutdown()  # releases the model and KV cache
        del self.llm, self.engine
        gc.collect()


# ---- transformers static-cache generate ------------------------------------------------------------
class _FirstTokenClock(BaseStreamer):
    """A transformers streamer that notes when the first new token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersSide:
    name = "transformers generate"

    def __init__(self, args: argparse.Namespace, model_dir: str, dtype, device) -> None:
        import torch
        from transformers import CompileConfig, GenerationConfig

        self.device, self.dtype = device, dtype
        self.model = load_transformers_model(model_dir, dtype, device, args.peer_attn_implementation)
        self.compiled = device.type == "cuda"  # generate() compiles only on accelerators
        self.compile_config = CompileConfig(fullgraph=True, mode=args.peer_compile_mode) if self.compiled else None
        # Greedy, an EOS id no token has (never stops early), a static KV cache sized for the request.
        self.config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                       max_new_tokens=args.output_len, cache_implementation="static",
                                       compile_config=self.compile_config)
        self._torch = torch

    def generate(self, prompt: list[int], num_tokens: int) -> tuple[Run, list[int]]:
        torch = self._torch
        self.config.max_new_tokens = num_tokens
        clock = _FirstTokenClock()
        input_ids = torch.tensor([prompt], device=self.device)
        with transformers_errors_only(), torch.inference_mode():
            started = time.perf_counter()
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=self.config, streamer=clock)
            tokens = out[0, len(prompt):].tolist()  # synchronises with the device
            total = time.perf_counter() - started
        return Run(clock.first - started, total, len(tokens)), tokens

    def describe(self) -> dict[str, Any]:
        return {"method": "generate(cache_implementation='static', compile_config=...) on one request; TTFT "
                          "when the streamer receives the first new token",
                "dtype": str(self.dtype).removeprefix("torch."),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "compiled": self.compiled,
                "compile_config": self.compile_config.to_dict() if self.compile_config else None}

    def close(self) -> None:
        del self.model
        gc.collect()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    model_dir, tag, summary = resolve_model_args(args, device)
    workload = make_workload(1, summary["vocab_size"], args.input_len, args.input_len, args.output_len,
                             args.output_len, seed=args.seed)
    prompt = workload.prompts[0]
    name = args.output or f"latency_{device.type}_{tag}"
    print(f"model {scrub_path(model_dir)} on {device}; batch 1, prompt {args.input_len} tokens, "
          f"{args.output_len} new tokens (greedy, ignore_eos); {args.warmup} warm-up + {args.repeats} timed runs "
          f"per side", flush=True)

    load_at_start = load_average()
    nova = NovaInferSide(args, model_dir)
    nova_runs, nova_tokens = measure(nova, prompt, args.output_len, args.warmup, args.repeats)
    nova_result = {**summarize(nova_runs), **nova.describe(),
                   "ttft_ms_by_input_len": measure_ttft(nova, summary["vocab_size"], args.ttft_input_lens, args.warmup,
                                                        args.repeats, args.seed)}
    dtype = nova.dtype
    nova.close()
    memory_left = release_device_memory(device)

    rows = [("NovaInfer", nova_result)]
    peer_result = ratio = None
    if args.peer == "generate":
        peer = TransformersSide(args, model_dir, dtype, device)
        peer_runs, peer_tokens = measure(peer, prompt, args.output_len, args.warmup, args.repeats)
        peer_result = {"name": "transformers static-cache generate" + (" (compiled)" if peer.compiled else ""),
                       **summarize(peer_runs), **peer.describe(),
                       "greedy_outputs_identical": nova_tokens == peer_tokens}
        peer.close()
        release_device_memory(device)
        ratio = round(peer_result["tpot_ms"] / nova_result["tpot_ms"], 3)
        rows.append((peer_result["name"], peer_result))

    print(f"\nmedian of {args.repeats} run(s)")
    print(f"{'':44} {'TTFT ms':>9} {'TPOT ms':>9} {'total s':>8} {'decode tok/s':>13}")
    for label, r in rows:
        print(f"{label:44} {r['ttft_ms']:9.2f} {r['tpot_ms']:9.3f} {r['total_s']:8.3f} "
              f"{r['decode_tokens_per_s']:13,.1f}")
    if peer_result is not None:
        print(f"TPOT speedup NovaInfer vs transformers: {ratio:.2f}x (greedy outputs identical: "
              f"{peer_result['greedy_outputs_identical']})")

    facts = run_facts(device, load_at_start, argv, __file__)
    results = {
        "benchmark": "single-stream decode latency (batch 1)",
        "gpu": facts.pop("gpu"),
        "model": summary,
        "engine": "novainfer",
        "tpot_ms": nova_result["tpot_ms"],
        "ttft_ms": nova_result["ttft_ms"],
        "peer_tpot_ms": peer_result["tpot_ms"] if peer_result else None,
        "ratio": ratio,
        "ratio_definition": "median transformers TPOT / median NovaInfer TPOT (> 1: NovaInfer decodes faster)",
        **facts,
        "workload": {"batch_size": 1, "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                     "warmup_runs": args.warmup, "ignore_eos": True, "greedy": True,
                     "tpot": "(total - TTFT) / (output_len - 1)"},
        "novainfer": nova_result,
        "device_memory_after_novainfer_shutdown": memory_left,
        "peer": peer_result,
    }
    path = write_results(name, results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
