"""Kernel timings on one GPU: Triton attention backend and fused small ops against their PyTorch paths.

One decoder layer's worth of work per call, at the Qwen2-0.5B (14 query heads, 2 KV heads, head
size 64, hidden 896) and Qwen2-1.5B (12, 2, 128, hidden 1536) shapes, bfloat16, KV block size 16:

* decode-only steps (store + split-K decode): batch x context from 1 x 1000 to 256 x 4000, also with
  ``max_seq_len`` only an upper bound (as in a CUDA-graph batch); the Triton side is timed eagerly
  and as a CUDA graph replay (no launch overhead), the PyTorch reference eagerly;
* prefill and mixed steps (store + varlen prefill, plus decode for the decoding rows);
* RMSNorm + residual, SiLU-and-mul and RoPE at decode (256 rows) and prefill (8192 rows) sizes.

Times are medians of ``triton.testing.do_bench`` (which flushes the L2 cache between runs).
Bandwidth counts the K/V bytes a decode must read; TFLOP/s counts causal attention's two matrix
products. ``--sweep decode prefill`` also times those kernels' tile configurations (to pick the
defaults). Rows are printed as they are measured.

    python benchmarks/attention_kernels.py [--sweep decode prefill] [--output NAME]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.common import add_output_arguments, command_line, git_commit, machine_info, write_results

SHAPES = {"qwen2-0.5b": dict(num_heads=14, num_kv_heads=2, head_size=64, hidden=896, intermediate=4864),
          "qwen2-1.5b": dict(num_heads=12, num_kv_heads=2, head_size=128, hidden=1536, intermediate=8960)}
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
GRAPH_BOUND = 32768  # max_seq_len a CUDA-graph decode batch is captured with


def bench(fn: Callable[[], Any], graph: bool = False, rep_ms: int = 100) -> float:
    """Median microseconds of ``fn`` (replayed from a CUDA graph when ``graph``)."""
    import triton.testing

    if graph:
        return 1000 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return 1000 * triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


class Step:
    """One layer's attention inputs for a step of sequences ``(context_len, query_len)``."""

    def __init__(self, specs: list[tuple[int, int]], shape: dict[str, int], seed: int = 0) -> None:
        from novainfer.attention.backends import AttentionMetadata

        self.specs = specs
        gen = torch.Generator(device="cuda").manual_seed(seed)
        rng = np.random.default_rng(seed)
        hq, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_size"]
        query_lens = np.array([q for _, q in specs], dtype=np.int64)
        seq_lens = np.array([c + q for c, q in specs], dtype=np.int64)
        blocks = -(-seq_lens // BLOCK_SIZE)
        width = int(blocks.max())
        order = rng.permutation(int(blocks.sum()))  # scattered blocks, as after a while of serving
        tables = np.zeros((len(specs), width), dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(blocks)))
        for i, n in enumerate(blocks):
            tables[i, :n] = order[starts[i]:starts[i] + n]
        seq_index = np.repeat(np.arange(len(specs)), query_lens)
        cu = np.concatenate(([0], np.cumsum(query_lens)))
        positions = np.arange(cu[-1]) - cu[:-1][seq_index] + (seq_lens - query_lens)[seq_index]
        slots = tables[seq_index, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        num_tokens = int(cu[-1])

        def randn(*s):
            return torch.randn(*s, device="cuda", dtype=DTYPE, generator=gen)

        self.k_cache = randn(int(blocks.sum()), BLOCK_SIZE, hkv, d)
        self.v_cache = randn(int(blocks.sum()), BLOCK_SIZE, hkv, d)
        qkv = randn(num_tokens, (hq + 2 * hkv) * d)  # q/k/v are strided views, as in the model
        self.query = qkv[:, :hq * d].view(num_tokens, hq, d)
        self.key = qkv[:, hq * d:(hq + hkv) * d].view(num_tokens, hkv, d)
        self.value = qkv[:, (hq + hkv) * d:].view(num_tokens, hkv, d)
        self.scale = d ** -0.5
        cuda = dict(device="cuda")
        self.args = dict(
            num_tokens=num_tokens, num_seqs=len(specs), block_size=BLOCK_SIZE, max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, **cuda),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **cuda),
            block_tables=torch.tensor(tables, dtype=torch.int32, **cuda),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **cuda),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        self.metadata_cls = AttentionMetadata
        self.kv_bytes = int(2 * seq_lens.sum() * hkv * d * self.k_cache.element_size())
        context = seq_lens - query_lens
        # Causal: query i of a chunk sees context + i + 1 keys; two products of 2*d flops per pair.
        pairs = float((query_lens * context + query_lens * (query_lens + 1) / 2).sum())
        self.flops = 4.0 * d * hq * pairs

    def forward_fn(self, backend, max_seq_len: int | None = None) -> Callable[[], torch.Tensor]:
        args = dict(self.args, max_seq_len=max_seq_len or self.args["max_seq_len"])
        metadata = self.metadata_cls(backend=backend, **args)
        backend.prepare(metadata)
        return lambda: backend.forward(self.query, self.key, self.value, self.k_cache, self.v_cache, metadata,
                                       self.scale)


def attention_rows(sweep: list[str]) -> Iterator[dict[str, Any]]:
    from novainfer.attention.backends import TorchReferenceBackend
    from novainfer.attention.backends.triton_attn import TritonAttentionBackend

    decode_cases = [(1, 1000), (1, 8000), (16, 2000), (64, 1000), (256, 1000), (256, 4000)]
    prefill_cases = {"8 x 1024 prompts": [(0, 1024)] * 8, "1 x 4096 prompt": [(0, 4096)],
                     "2048 chunk after 2048 cached": [(2048, 2048)],
                     "mixed: 2048 chunk + 255 decodes @1000": [(0, 2048)] + [(999, 1)] * 255}
    for name, shape in SHAPES.items():
        for batch, context in decode_cases:
            step = Step([(context - 1, 1)] * batch, shape)
            triton_fn = step.forward_fn(TritonAttentionBackend())
            row = dict(shape=name, kind="decode", case=f"{batch} x {context}", triton_us=bench(triton_fn),
                       triton_graph_us=bench(triton_fn, graph=True),
                       triton_graph_bound_us=bench(step.forward_fn(TritonAttentionBackend(), GRAPH_BOUND), graph=True))
            row["torch_us"] = bench(step.forward_fn(TorchReferenceBackend())) if batch * context <= 256000 else None
            row["graph_gbps"] = step.kv_bytes / row["triton_graph_us"] / 1e3
            yield row
        for case, specs in prefill_cases.items():
            step = Step(specs, shape)
            row = dict(shape=name, kind="prefill", case=case,
                       triton_us=bench(step.forward_fn(TritonAttentionBackend())))
            small = step.args["num_tokens"] <= 8192  # the reference pads to [B, max_q, max_ctx] scores
            row["torch_us"] = bench(step.forward_fn(TorchReferenceBackend())) if small else None
            row["tflops"] = step.flops / row["triton_us"] / 1e6
            yield row
        if "decode" in sweep:
            yield from decode_sweep_rows(name, shape)
        if "prefill" in sweep:
            yield from prefill_sweep_rows(name, shape)


def decode_sweep_rows(name: str, shape: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The decode kernel alone (the store is not timed): tile configurations at two sizes, then the
    number of splits at several batch sizes with the default tiles."""
    from novainfer.attention.ops import DecodeTileConfig, decode_attention

    def run(batch, context, splits, kind, config=None):
        step = Step([(context - 1, 1)] * batch, shape)
        out = torch.empty_like(step.query)
        a = step.args

        def fn():
            decode_attention(step.query, step.k_cache, step.v_cache, out, a["seq_lens"], a["block_tables"],
                             step.scale, splits, config=config)
        try:
            us = bench(fn, graph=True, rep_ms=30)
        except Exception as e:  # a configuration that does not fit (shared memory, registers)
            print(f"skip decode {config}: {type(e).__name__}", file=sys.stderr)
            return None
        return dict(shape=name, kind=kind, case=f"{batch} x {context} splits={splits}",
                    config=str(config or "default"), triton_us=us,
                    graph_gbps=step.kv_bytes / us / 1e3)

    for (batch, context, splits), block_n, warps, stages in itertools.product(
            [(256, 1000, 1), (1, 8000, 32)], [32, 64, 128], [2, 4, 8], [2, 3]):
        row = run(batch, context, splits, "sweep-decode-tiles", DecodeTileConfig(block_n, warps, stages))
        if row:
            yield row
    for (batch, context), splits in itertools.product([(1, 1000), (1, 8000), (16, 2000), (64, 1000), (256, 1000)],
                                                      [1, 2, 4, 8, 16, 32, 64]):
        if batch * 2 * splits <= 4096:
            row = run(batch, context, splits, "sweep-decode-splits")
            if row:
                yield row


def prefill_sweep_rows(name: str, shape: dict[str, int]) -> Iterator[dict[str, Any]]:
    """Tile configurations of the prefill kernel alone (the store is not timed), on steps of several
    sizes: the best tile depends on how many programs a step has per SM (see ``prefill_tile_config``)."""
    from novainfer.attention.ops import PrefillTileConfig, prefill_attention

    cases = {"8 x 1024": [(0, 1024)] * 8, "6 x 1024": [(0, 1024)] * 6, "1 x 4096": [(0, 4096)],
             "512 chunk + 255 decodes @1000": [(999, 1)] * 255 + [(0, 512)]}
    for case, specs in cases.items():
        step = Step(specs, shape)
        out = torch.empty_like(step.query)
        a = step.args
        skip_decodes = any(query_len == 1 for _, query_len in specs)
        for block_m, block_n, warps, stages in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3]):
            config = PrefillTileConfig(block_m, block_n, warps, stages)

            def fn(config=config):
                prefill_attention(step.query, step.k_cache, step.v_cache, out, a["query_start_loc"], a["seq_lens"],
                                  a["block_tables"], step.scale, skip_decodes=skip_decodes, config=config)
            try:
                us = bench(fn, graph=True, rep_ms=30)
            except Exception as e:  # a configuration that does not fit (shared memory, registers)
                print(f"skip prefill {config}: {type(e).__name__}", file=sys.stderr)
                continue
            yield dict(shape=name, kind="sweep-prefill", case=case, config=str(config), triton_us=us,
                       tflops=step.flops / us / 1e6)


def fused_op_rows() -> Iterator[dict[str, Any]]:
    from novainfer.layers.activation import SiluAndMul
    from novainfer.layers.layernorm import RMSNorm
    from novainfer.layers.rotary_embedding import RotaryEmbedding

    for (name, shape), tokens in itertools.product(SHAPES.items(), [256, 8192]):
        hidden, inter = shape["hidden"], shape["intermediate"]
        hq, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_size"]
        norm = RMSNorm(hidden, params_dtype=DTYPE).cuda()
        x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
        residual = torch.randn_like(x)
        act = SiluAndMul()
        gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
        rope = RotaryEmbedding(d, 32768, 1e6).cuda()
        positions = torch.randint(0, 32768, (tokens,), device="cuda")
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", dtype=DTYPE)
        q = qkv[:, :hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
        ops = [("rmsnorm+residual", lambda: norm(x, residual), lambda: norm.forward_native(x, residual), 4 * x.numel()),
               ("silu_and_mul", lambda: act(gate_up), lambda: act.forward_native(gate_up), 3 * gate_up.numel()),
               ("rope q+k", lambda: rope(positions, q, k), lambda: rope.forward_native(positions, q, k),
                4 * (q.numel() + k.numel()))]
        for op, fused, native, nbytes in ops:
            us = bench(fused)
            yield dict(shape=name, kind="fused-op", case=f"{op} {tokens} rows", triton_us=us,
                       torch_us=bench(native), graph_gbps=nbytes / us / 1e3)


COLUMNS = ["shape", "kind", "case", "config", "triton_us", "triton_graph_us", "triton_graph_bound_us", "torch_us",
           "graph_gbps", "tflops"]


def format_row(row: dict[str, Any]) -> str:
    def fmt(v):
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    return " | ".join(f"{c}={fmt(row[c])}" for c in COLUMNS if c in row)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", nargs="+", default=[], choices=["decode", "prefill"],
                   help="also time these kernels' tile configurations")
    add_output_arguments(p, "attention_kernels_<gpu>")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    rows = []
    for row in itertools.chain(attention_rows(args.sweep), fused_op_rows()):
        print(format_row(row), flush=True)
        rows.append(row)
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    path = write_results(args.output or f"attention_kernels_{gpu}", {
        "benchmark": "attention_kernels", "command": command_line(), "commit": git_commit(),
        "machine": machine_info("cuda"), "dtype": str(DTYPE), "block_size": BLOCK_SIZE, "rows": rows},
        args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
