"""Triton attention kernels and backend against the PyTorch reference backend (the oracle).

Each step is described as sequences of ``(context_len, query_len)``: ``context_len`` tokens are
already in the paged cache, ``query_len`` new ones are computed. Blocks are scattered at random
over the cache; every slot that holds no token of the step is filled with large random garbage, so
a kernel that reads outside a sequence's context gets a visibly wrong answer.

Tolerances (``max |out - ref| <= atol + rtol * |ref|``): the reference attends in float32 and rounds
the output once; the kernels also accumulate in float32 but round the softmax weights to the input
dtype before the P @ V product, so they may differ by a couple of output ulps:
float32 (interpreter only) 1e-5, float16 2e-3, bfloat16 1.6e-2 (2 ulps) on both atol and rtol.
Cache writes must be exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from novainfer.attention.backends import AttentionMetadata, TorchReferenceBackend  # noqa: E402
from novainfer.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from novainfer.attention.ops import (decode_attention, prefill_attention, prefill_tile_config,  # noqa: E402
                                     reshape_and_cache)
from novainfer.attention.ops.prefill_attention import SEARCH_CHUNK  # noqa: E402
from tests.gpu.triton_env import DEVICE, DTYPES, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NUM_KV_HEADS = 2
POISON = 100.0


@dataclass
class Step:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    k_cache: torch.Tensor  # prefixes written, every other slot poisoned
    v_cache: torch.Tensor
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # [B, max_blocks]
    slot_mapping: np.ndarray  # [T]

    def metadata(self, backend, max_seq_len: int | None = None) -> AttentionMetadata:
        query_start_loc = np.concatenate(([0], np.cumsum(self.query_lens)))
        metadata = AttentionMetadata(
            num_tokens=int(self.query_lens.sum()), num_seqs=len(self.query_lens),
            block_size=self.k_cache.shape[1], max_query_len=int(self.query_lens.max()),
            max_seq_len=max_seq_len or int(self.seq_lens.max()),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor(self.block_tables, dtype=torch.int32, device=DEVICE),
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.int64, device=DEVICE),
            query_lens_cpu=self.query_lens, seq_lens_cpu=self.seq_lens, backend=backend)
        backend.prepare(metadata)
        return metadata


def make_step(specs: list[tuple[int, int]], ratio: int, head_size: int, block_size: int, dtype: torch.dtype,
              seed: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    seq_lens = np.array([c + q for c, q in specs], dtype=np.int64)
    num_blocks = [-(-int(n) // block_size) for n in seq_lens]
    total_blocks = sum(num_blocks) + 2
    order = rng.permutation(total_blocks)
    width = max(num_blocks)
    # Table entries past a sequence's blocks point at real (poisoned) blocks: they must not be read.
    tables = rng.integers(0, total_blocks, size=(len(specs), width))
    start = 0
    for row, n in enumerate(num_blocks):
        tables[row, :n] = order[start:start + n]
        start += n

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    k_cache = randn(total_blocks, block_size, NUM_KV_HEADS, head_size, scale=POISON)
    v_cache = randn(total_blocks, block_size, NUM_KV_HEADS, head_size, scale=POISON)
    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, head_size), v_cache.view(-1, NUM_KV_HEADS, head_size)
    queries, keys, values, slots = [], [], [], []
    for (context_len, query_len), table in zip(specs, tables):
        positions = np.arange(context_len + query_len)
        seq_slots = table[positions // block_size] * block_size + positions % block_size
        k, v = randn(len(positions), NUM_KV_HEADS, head_size), randn(len(positions), NUM_KV_HEADS, head_size)
        flat_k[seq_slots[:context_len]] = k[:context_len]
        flat_v[seq_slots[:context_len]] = v[:context_len]
        keys.append(k[context_len:])
        values.append(v[context_len:])
        queries.append(randn(query_len, NUM_KV_HEADS * ratio, head_size))
        slots.append(seq_slots[context_len:])
    return Step(torch.cat(queries).to(DEVICE), torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE),
                k_cache.to(DEVICE), v_cache.to(DEVICE), np.array([q for _, q in specs], dtype=np.int64), seq_lens,
                tables, np.concatenate(slots))


def reference(step: Step, scale: float):
    """The oracle's output and caches after the step."""
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    backend = TorchReferenceBackend()
    out = backend.forward(step.query, step.key, step.value, k_cache, v_cache, step.metadata(backend), scale)
    return out, k_cache, v_cache


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    tol = TOLERANCE[ref.dtype]
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.float() - ref.float()).abs()
    bound = tol + tol * ref.float().abs()
    worst = int(torch.argmax((err - bound).flatten()))
    assert (err <= bound).all(), (f"{what}: |out - ref| = {err.flatten()[worst].item():.3g} > "
                                  f"{bound.flatten()[worst].item():.3g} at flat index {worst}; max err {err.max():.3g}")


def run_backend(step: Step, scale: float, max_seq_len: int | None = None):
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    backend = TritonAttentionBackend()
    out = backend.forward(step.query, step.key, step.value, k_cache, v_cache, step.metadata(backend, max_seq_len),
                          scale)
    return out, k_cache, v_cache


def check_backend_step(step: Step, what: str, max_seq_len: int | None = None) -> None:
    scale = step.query.shape[-1] ** -0.5
    ref_out, ref_k, ref_v = reference(step, scale)
    out, k_cache, v_cache = run_backend(step, scale, max_seq_len)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), f"{what}: caches differ"
    assert_close(out, ref_out, what)


# ---- step shapes --------------------------------------------------------------------------------
if INTERPRET:
    MIXED = [(0, 1), (0, 7), (0, 40), (19, 21), (50, 1), (5, 1), (33, 17), (0, 2)]
    PREFILL = [(0, 1), (0, 3), (0, 70), (64, 16), (7, 40)]
    DECODE_CONTEXTS = [1, 15, 16, 17, 90, 300]
else:
    # Ragged lengths from 1 to several thousand, cached prefixes longer and shorter than the chunk,
    # and decodes with long contexts in the same step.
    MIXED = [(0, 1), (0, 7), (0, 300), (0, 2051), (150, 90), (1000, 1), (37, 1), (3000, 1), (512, 513),
             (3001, 64), (0, 2), (15, 17)]
    PREFILL = [(0, 1), (0, 16), (0, 1500), (64, 64), (2049, 700), (1, 1), (777, 33)]
    DECODE_CONTEXTS = [1, 15, 16, 17, 64, 65, 1000, 2048, 4097, 8000, 12345]

# (queries per KV head, head size, block size, dtype): every GQA ratio from 1 to 8, both head
# sizes and every block size, and the Qwen2-0.5B (7, 64) and Qwen2-1.5B (6, 128) shapes in full.
_BLOCK_SIZES = [16, 32] if INTERPRET else [16, 32, 64]
_RATIOS = [1, 3, 7, 8] if INTERPRET else list(range(1, 9))
CASES = [(ratio, [64, 128][i % 2], _BLOCK_SIZES[i % len(_BLOCK_SIZES)], DTYPES[i % len(DTYPES)])
         for i, ratio in enumerate(_RATIOS)]
QWEN_SHAPES = [(7, 64), (6, 128)]
QWEN_CASES = [(r, d, bs, dt) for (r, d), bs, dt in itertools.product(QWEN_SHAPES, _BLOCK_SIZES, DTYPES)]
if INTERPRET:
    QWEN_CASES = QWEN_CASES[::3]


def case_id(case) -> str:
    ratio, head_size, block_size, dtype = case
    return f"gqa{ratio}-d{head_size}-bs{block_size}-{str(dtype).removeprefix('torch.')}"


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", _BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_every_slot_and_skips_negative(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens, head_size = 9, 40, 64
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_size, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_size, generator=gen).to(dtype).to(DEVICE)
    # Rows of a fused QKV output: keys and values are strided views, as in the model.
    qkv = torch.randn(num_tokens, 3, NUM_KV_HEADS, head_size, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding rows
    slots = slots.to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, NUM_KV_HEADS, head_size)[slots[keep]] = key[keep]
    expected_v.view(-1, NUM_KV_HEADS, head_size)[slots[keep]] = value[keep]
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("case", CASES + QWEN_CASES, ids=case_id)
def test_mixed_prefill_and_decode_step(case):
    ratio, head_size, block_size, dtype = case
    step = make_step(MIXED, ratio, head_size, block_size, dtype, seed=ratio * 1000 + head_size + block_size)
    check_backend_step(step, f"mixed step {case_id(case)}")


@pytest.mark.parametrize("case", CASES[::2] + QWEN_CASES[:2], ids=case_id)
def test_prefill_only_step_with_cached_prefixes(case):
    ratio, head_size, block_size, dtype = case
    step = make_step(PREFILL, ratio, head_size, block_size, dtype, seed=7 + ratio)
    check_backend_step(step, f"prefill step {case_id(case)}")


@pytest.mark.parametrize("case", CASES[1::2] + QWEN_CASES, ids=case_id)
def test_decode_only_step_long_contexts(case):
    ratio, head_size, block_size, dtype = case
    step = make_step([(c - 1, 1) for c in DECODE_CONTEXTS], ratio, head_size, block_size, dtype, seed=11 + ratio)
    check_backend_step(step, f"decode step {case_id(case)}")


@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
@pytest.mark.parametrize("case", QWEN_CASES[:2], ids=case_id)
def test_decode_kernel_any_split_count(case, num_splits):
    """Split-K gives the same result whatever the number of splits, including splits left empty."""
    ratio, head_size, block_size, dtype = case
    step = make_step([(c - 1, 1) for c in DECODE_CONTEXTS], ratio, head_size, block_size, dtype, seed=num_splits)
    scale = head_size ** -0.5
    ref_out, k_cache, v_cache = reference(step, scale)  # also stores this step's K/V
    metadata = step.metadata(TorchReferenceBackend())
    out = torch.full_like(step.query, float("nan"))
    decode_attention(step.query, k_cache, v_cache, out, metadata.seq_lens, metadata.block_tables, scale, num_splits)
    assert_close(out, ref_out, f"decode with {num_splits} splits")


@pytest.mark.parametrize("query_rows", [0, 2 ** 62], ids=["small-step-tile", "large-step-tile"])
@pytest.mark.parametrize("case", QWEN_CASES[:2], ids=case_id)
def test_prefill_kernel_alone_computes_decode_rows_too(case, query_rows):
    """The varlen kernel is a complete path on its own: it also serves single-query sequences, at
    each tile ``prefill_tile_config`` may pick for a step's size."""
    ratio, head_size, block_size, dtype = case
    step = make_step(MIXED, ratio, head_size, block_size, dtype, seed=3)
    scale = head_size ** -0.5
    ref_out, k_cache, v_cache = reference(step, scale)
    metadata = step.metadata(TorchReferenceBackend())
    out = torch.full_like(step.query, float("nan"))
    config = prefill_tile_config(head_size, query_rows, 132)
    prefill_attention(step.query, k_cache, v_cache, out, metadata.query_start_loc, metadata.seq_lens,
                      metadata.block_tables, scale, config=config)
    assert_close(out, ref_out, f"prefill kernel on a mixed step with {config}")


@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize("case", QWEN_CASES[:2], ids=case_id)
def test_decode_kernel_in_a_mixed_step_writes_only_decode_rows(case, num_splits):
    """With ``query_start_loc`` the decode kernel computes single-query sequences (at their rows) and
    leaves every row of the other sequences as it was, split or not."""
    ratio, head_size, block_size, dtype = case
    step = make_step(MIXED, ratio, head_size, block_size, dtype, seed=40 + num_splits)
    scale = head_size ** -0.5
    ref_out, k_cache, v_cache = reference(step, scale)
    metadata = step.metadata(TorchReferenceBackend())
    out = torch.full_like(step.query, float("nan"))
    decode_attention(step.query, k_cache, v_cache, out, metadata.seq_lens, metadata.block_tables, scale,
                     num_splits, query_start_loc=metadata.query_start_loc)
    rows = np.repeat(step.query_lens == 1, step.query_lens)
    decode_rows = torch.from_numpy(rows).to(DEVICE)
    assert_close(out[decode_rows], ref_out[decode_rows], f"decode rows, {num_splits} splits")
    assert torch.isnan(out[~decode_rows]).all(), "the decode kernel wrote rows of a prefill sequence"


def test_step_of_more_sequences_than_one_search_chunk():
    """The prefill kernel finds each program's sequence in chunks of the sequence table: a step of
    more sequences than one chunk, single- and multi-query ones interleaved."""
    specs = [(i % 5, 1 + i % 3) for i in range(SEARCH_CHUNK + 44)]
    step = make_step(specs, 7, 64, 16, DTYPES[0], seed=12)
    check_backend_step(step, f"mixed step of {len(specs)} sequences")


@pytest.mark.parametrize("case", QWEN_CASES[:2], ids=case_id)
def test_padded_decode_rows_are_harmless(case):
    """A CUDA-graph decode batch: padding rows (seq_len 0, slot -1) and max_seq_len only a bound."""
    ratio, head_size, block_size, dtype = case
    contexts = DECODE_CONTEXTS[:5]
    num_pad = 3
    step = make_step([(c - 1, 1) for c in contexts], ratio, head_size, block_size, dtype, seed=5)
    scale = head_size ** -0.5
    ref_out, ref_k, ref_v = reference(step, scale)

    gen = torch.Generator().manual_seed(6)
    padded = Step(
        query=torch.cat([step.query, torch.randn(num_pad, *step.query.shape[1:], generator=gen).to(step.query)]),
        key=torch.cat([step.key, torch.randn(num_pad, *step.key.shape[1:], generator=gen).to(step.key)]),
        value=torch.cat([step.value, torch.randn(num_pad, *step.value.shape[1:], generator=gen).to(step.value)]),
        k_cache=step.k_cache, v_cache=step.v_cache,
        query_lens=np.ones(len(contexts) + num_pad, dtype=np.int64),
        seq_lens=np.concatenate([step.seq_lens, np.zeros(num_pad, dtype=np.int64)]),
        block_tables=np.concatenate([step.block_tables, np.zeros((num_pad, step.block_tables.shape[1]), np.int64)]),
        slot_mapping=np.concatenate([step.slot_mapping, -np.ones(num_pad, dtype=np.int64)]))
    bound = 32768 if not INTERPRET else 4096  # e.g. max_model_len: picks more splits than needed
    out, k_cache, v_cache = run_backend(padded, scale, max_seq_len=bound)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "padding rows wrote into the cache"
    assert_close(out[:len(contexts)], ref_out, "real rows of a padded decode batch")
    assert (out[len(contexts):] == 0).all(), "padding rows must come out as zeros"


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("case", QWEN_CASES[:2], ids=case_id)
def test_decode_step_replays_from_a_cuda_graph(case):
    """Captured once, replayed on other sequences: lengths, block tables and slots are read on the
    device at replay time (two padding rows, ``max_seq_len`` only a bound)."""
    ratio, head_size, block_size, dtype = case
    batch, num_pad = 4, 2
    steps = [make_step([(c - 1, 1) for c in contexts], ratio, head_size, block_size, dtype, seed=20 + i)
             for i, contexts in enumerate([[5, 100, 2000, 30], [3000, 1, 64, 700]])]
    rows = batch + num_pad
    num_blocks = max(s.k_cache.shape[0] for s in steps)
    width = max(s.block_tables.shape[1] for s in steps)
    static = dict(
        query=torch.zeros(rows, *steps[0].query.shape[1:], dtype=dtype, device=DEVICE),
        key=torch.zeros(rows, *steps[0].key.shape[1:], dtype=dtype, device=DEVICE),
        value=torch.zeros(rows, *steps[0].value.shape[1:], dtype=dtype, device=DEVICE),
        k_cache=torch.zeros(num_blocks, *steps[0].k_cache.shape[1:], dtype=dtype, device=DEVICE),
        v_cache=torch.zeros(num_blocks, *steps[0].v_cache.shape[1:], dtype=dtype, device=DEVICE),
        seq_lens=torch.zeros(rows, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(rows, width, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=DEVICE))

    def load(step: Step) -> None:
        for name in ("query", "key", "value"):
            static[name][:batch] = getattr(step, name)
        blocks = step.k_cache.shape[0]
        static["k_cache"][:blocks] = step.k_cache
        static["v_cache"][:blocks] = step.v_cache
        static["seq_lens"][:batch] = torch.from_numpy(step.seq_lens)
        static["block_tables"][:batch, :step.block_tables.shape[1]] = torch.from_numpy(step.block_tables)
        static["slot_mapping"][:batch] = torch.from_numpy(step.slot_mapping)

    backend = TritonAttentionBackend()
    metadata = AttentionMetadata(
        num_tokens=rows, num_seqs=rows, block_size=block_size, max_query_len=1, max_seq_len=32768,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=DEVICE), seq_lens=static["seq_lens"],
        block_tables=static["block_tables"], slot_mapping=static["slot_mapping"],
        query_lens_cpu=np.ones(rows, dtype=np.int64), seq_lens_cpu=np.full(rows, 32768), backend=backend)
    scale = head_size ** -0.5

    def forward() -> torch.Tensor:
        return backend.forward(static["query"], static["key"], static["value"], static["k_cache"],
                               static["v_cache"], metadata, scale)

    load(steps[0])
    backend.prepare(metadata)
    forward()  # compiles the kernels and allocates the split workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for i, step in enumerate(steps):
        load(step)
        graph.replay()
        ref_out, ref_k, _ = reference(step, scale)
        assert torch.equal(static["k_cache"][:step.k_cache.shape[0]], ref_k), f"replay {i}: cache differs"
        assert_close(out[:batch], ref_out, f"replay {i}")
        assert (out[batch:] == 0).all()


def test_backend_prepare_picks_the_decode_path():
    step = make_step([(5, 1), (9, 1)], 2, 64, 16, DTYPES[0], seed=0)
    assert step.metadata(TritonAttentionBackend()).backend_data.decode_only
    mixed = make_step([(5, 1), (0, 9)], 2, 64, 16, DTYPES[0], seed=0).metadata(TritonAttentionBackend()).backend_data
    assert not mixed.decode_only and mixed.num_decodes == 1 and mixed.has_prefills
