"""Fused Triton RMSNorm(+residual), SiLU-and-mul, in-place RoPE and RoPE fused with the KV-cache store
against the layers' PyTorch code.

The kernels round where the PyTorch code rounds. A float32 intermediate may still differ in its
last bits (another reduction order, another exp), which can flip each of the two roundings to the
output dtype, so they must agree with it to two units in the last place: tolerance
``2 * ulp * (|ref| + 1e-3)`` with ulp = 2^-7 (bf16), 2^-10 (fp16), 2^-20 (fp32, where only the
order of operations differs). The residual sum must be bitwise equal. The RoPE kernel rotates in
float32 and rounds once, while the PyTorch path rounds cos/sin, each product and the sum to the
dtype. Its outputs can cancel, so RoPE errors are measured against the size of the terms,
``m = |x| + |rotate_half(x)|``: within ``ulp * |exact| + 2^-22 * m`` of the rotation computed in
float64 from the same float32 tables (one rounding plus float32 arithmetic), and within
``4 * ulp * m`` of the PyTorch path.

The fused RoPE + KV-cache store rounds where the in-place RoPE kernel followed by the plain store
does, so against that unfused sequence it must be bitwise equal (queries and both caches); against
the PyTorch path (``forward_native`` then ``index_copy_``, the CPU backend's) it gets the RoPE
tolerance above. Cache slots of padding rows (slot -1) and every other slot must stay untouched.

On CUDA the layers themselves are called (their ``x.is_cuda`` branch picks the kernel); under the
Triton interpreter (CPU tensors) the ops are called directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from novainfer.attention.backends import AttentionMetadata  # noqa: E402
from novainfer.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from novainfer.attention.ops import reshape_and_cache, rotary_embedding_and_cache  # noqa: E402
from novainfer.layers.activation import SiluAndMul  # noqa: E402
from novainfer.layers.layernorm import RMSNorm  # noqa: E402
from novainfer.layers.ops import fused_add_rms_norm_, rms_norm, rotary_embedding_, silu_and_mul  # noqa: E402
from novainfer.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from tests.gpu.triton_env import DEVICE, DTYPES, INTERPRET, MARKS  # noqa: E402

pytestmark = MARKS

ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}
NUM_TOKENS = 37 if INTERPRET else 1000


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)} vs " \
                                                              f"{ref.dtype}{tuple(ref.shape)}"
    err = (out.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g}, worst excess {(err - bound).max():.3g}"


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float, what: str) -> None:
    assert_within(out, ref, ulps * ULP[ref.dtype] * (ref.double().abs() + 1e-3), what)


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("hidden_size", [896, 1536, 100])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_layer(hidden_size, with_residual, dtype):
    layer = RMSNorm(hidden_size, eps=1e-6, params_dtype=dtype).to(DEVICE)
    layer.weight.data = randn(hidden_size, dtype=dtype, seed=1, scale=0.5) + 1
    x = randn(NUM_TOKENS, hidden_size, dtype=dtype, seed=2, scale=3.0)
    residual = randn(NUM_TOKENS, hidden_size, dtype=dtype, seed=3) if with_residual else None
    expected = layer.forward_native(x, residual)
    got = layer(x, residual) if DEVICE == "cuda" else rms_norm(x, layer.weight, layer.eps, residual)
    if with_residual:
        assert torch.equal(got[1], expected[1]), "the residual sum must be rounded exactly like x + residual"
        got, expected = got[0], expected[0]
    assert_within_ulps(got, expected, 2, "RMSNorm")


@pytest.mark.parametrize("hidden_size", [896, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_rms_norm_writes_the_functional_results_over_its_inputs(hidden_size, dtype):
    weight = randn(hidden_size, dtype=dtype, seed=1, scale=0.5) + 1
    x = randn(NUM_TOKENS, hidden_size, dtype=dtype, seed=2, scale=3.0)
    residual = randn(NUM_TOKENS, hidden_size, dtype=dtype, seed=3)
    expected_out, expected_sum = rms_norm(x, weight, 1e-6, residual)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    out, summed = fused_add_rms_norm_(x, residual, weight, 1e-6)
    assert out.data_ptr() == x_ptr and summed.data_ptr() == residual_ptr
    assert torch.equal(out, expected_out) and torch.equal(summed, expected_sum)
    with pytest.raises(ValueError, match="different memory"):
        fused_add_rms_norm_(x, x, weight, 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        fused_add_rms_norm_(x, residual, weight.float() if dtype != torch.float32 else weight.half(), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_add_rms_norm_(x.view(1, *x.shape), residual.view(1, *x.shape), weight, 1e-6)


def test_rms_norm_float32_weight_promotes_output():
    x = randn(5, 64, dtype=DTYPES[0], seed=4)
    weight = randn(64, dtype=torch.float32, seed=5)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32


def test_norm_and_activation_keep_leading_dims():
    """[T, hidden] is the model's case (no views); other shapes come back in their own shape."""
    x = randn(3, 5, 64, dtype=DTYPES[0], seed=6)
    residual = randn(3, 5, 64, dtype=DTYPES[0], seed=7)
    weight = randn(64, dtype=DTYPES[0], seed=8)
    out, summed = rms_norm(x, weight, 1e-6, residual)
    flat_out, flat_summed = rms_norm(x.view(15, 64), weight, 1e-6, residual.view(15, 64))
    assert out.shape == summed.shape == x.shape
    assert torch.equal(out.view(15, 64), flat_out) and torch.equal(summed.view(15, 64), flat_summed)
    act = silu_and_mul(x)
    assert act.shape == (3, 5, 32) and torch.equal(act.view(15, 32), silu_and_mul(x.view(15, 64)))


@pytest.mark.parametrize("d", [4864, 8960, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_layer(d, dtype):
    layer = SiluAndMul()
    x = randn(NUM_TOKENS, 2 * d, dtype=dtype, seed=d, scale=4.0)
    got = layer(x) if DEVICE == "cuda" else silu_and_mul(x)
    assert_within_ulps(got, layer.forward_native(x), 2, "SiluAndMul")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(14, 2, 64), (12, 2, 128), (4, 4, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_qkv_views(num_heads, num_kv_heads, head_size, dtype):
    rope = RotaryEmbedding(head_size, 32768, 1000000.0).to(DEVICE)
    gen = torch.Generator().manual_seed(head_size)
    positions = torch.randint(0, 32768, (NUM_TOKENS,), generator=gen).to(DEVICE)
    # As in the model: q and k are views into the fused QKV projection output.
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = randn(NUM_TOKENS, q_size + 2 * kv_size, dtype=dtype, seed=9, scale=2.0)
    original = qkv.clone()
    q = qkv[:, :q_size].view(NUM_TOKENS, num_heads, head_size)
    k = qkv[:, q_size:q_size + kv_size].view(NUM_TOKENS, num_kv_heads, head_size)
    native_q, native_k = rope.forward_native(positions, q.clone(), k.clone())
    if DEVICE == "cuda":
        got_q, got_k = rope(positions, q, k)
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr(), "RoPE must work in place"
    else:
        rotary_embedding_(positions, q, k, rope.cos_cached, rope.sin_cached)
        got_q, got_k = q, k
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:]), "RoPE touched the values"

    cos = rope.cos_cached[positions].double().unsqueeze(1)
    sin = rope.sin_cached[positions].double().unsqueeze(1)
    for got, native, x, name in ((got_q, native_q, original[:, :q_size], "q"),
                                 (got_k, native_k, original[:, q_size:q_size + kv_size], "k")):
        x = x.double().view(got.shape)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        exact = x * cos + rotated * sin
        terms = x.abs() + rotated.abs()
        ulp = ULP[dtype]
        assert_within(got, exact.to(dtype), ulp * exact.abs() + 2.0 ** -22 * terms, f"RoPE {name} vs float64")
        assert_within(got, native, 4 * ulp * terms, f"RoPE {name} vs the PyTorch path")


def rope_bounds(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
    """The exact float64 rotation of ``x`` and the size of its terms (see the module docstring)."""
    x = x.double()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin, x.abs() + rotated.abs()


def fused_rope_inputs(num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
                      seed: int):
    """A fused QKV output, positions, slots (every 5th row padding, -1) and caches full of garbage."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 32768, (NUM_TOKENS,), generator=gen)
    num_blocks = -(-2 * NUM_TOKENS // block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:NUM_TOKENS]
    slots[::5] = -1
    qkv = randn(NUM_TOKENS, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=seed + 1, scale=2.0)
    caches = [randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + i, scale=50.0)
              for i in (2, 3)]
    return positions.to(DEVICE), slots.to(DEVICE), qkv, caches


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int):
    """Strided [T, H, D] views of q, k and v, as the model passes them."""
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return (q.view(NUM_TOKENS, num_heads, head_size), k.view(NUM_TOKENS, num_kv_heads, head_size),
            v.view(NUM_TOKENS, num_kv_heads, head_size))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(14, 2, 64), (12, 2, 128), (4, 4, 16), (3, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "query-out"])
def test_rope_fused_with_kv_cache_store(num_heads, num_kv_heads, head_size, block_size, dtype, in_place):
    rope = RotaryEmbedding(head_size, 32768, 1000000.0).to(DEVICE)
    positions, slots, qkv, (k_cache, v_cache) = fused_rope_inputs(num_heads, num_kv_heads, head_size, block_size,
                                                                   dtype, seed=head_size + block_size)
    original, original_k_cache, original_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()

    # The unfused sequence: in-place RoPE, then the store.
    unfused_qkv, unfused_k_cache, unfused_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    uq, uk, uv = split_heads(unfused_qkv, num_heads, num_kv_heads, head_size)
    rotary_embedding_(positions, uq, uk, rope.cos_cached, rope.sin_cached)
    reshape_and_cache(uk, uv, unfused_k_cache, unfused_v_cache, slots)

    q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_size)
    # Out of place (as the compiled forward calls it): the rotated queries go to a contiguous tensor.
    query_out = None if in_place else torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    rotary_embedding_and_cache(positions, q, k, v, k_cache, v_cache, slots, rope.cos_cached, rope.sin_cached,
                               query_out=query_out)
    if not in_place:
        assert torch.equal(qkv, original), "rotating into query_out must leave the QKV output as it is"
        q = query_out
    assert torch.equal(q, uq), "queries differ from the unfused RoPE"
    assert torch.equal(k_cache, unfused_k_cache), "key cache differs from RoPE followed by the store"
    assert torch.equal(v_cache, unfused_v_cache), "value cache differs from the plain store"
    assert torch.equal(qkv[:, num_heads * head_size:], original[:, num_heads * head_size:]), \
        "the fused op must leave the key and value rows of the QKV output as they are"

    # The PyTorch path, as the CPU backend runs it.
    oq, ok, ov = split_heads(original, num_heads, num_kv_heads, head_size)
    native_q, native_k = rope.forward_native(positions, oq, ok)
    stored = slots >= 0
    flat_k = k_cache.view(-1, num_kv_heads, head_size)
    flat_v = v_cache.view(-1, num_kv_heads, head_size)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[stored]] = False
    assert torch.equal(flat_k[untouched], original_k_cache.view_as(flat_k)[untouched]), "a slot not written changed"
    assert torch.equal(flat_v[untouched], original_v_cache.view_as(flat_v)[untouched]), "a slot not written changed"
    assert torch.equal(flat_v[slots[stored]], ov[stored]), "values must be stored exactly"

    cos = rope.cos_cached[positions].double().unsqueeze(1)
    sin = rope.sin_cached[positions].double().unsqueeze(1)
    ulp = ULP[dtype]
    for got, native, x, name in ((q, native_q, oq, "q"),
                                 (flat_k[slots[stored]], native_k[stored], ok[stored], "cached k")):
        rows = slice(None) if name == "q" else stored
        exact, terms = rope_bounds(x, cos[rows], sin[rows], dtype)
        assert_within(got, exact.to(dtype), ulp * exact.abs() + 2.0 ** -22 * terms, f"fused RoPE {name} vs float64")
        assert_within(got, native, 4 * ulp * terms, f"fused RoPE {name} vs the PyTorch path")


def paged_step_metadata(backend, query_lens: list[int], context_lens: list[int], block_size: int):
    """Metadata of a step whose sequences own consecutive cache blocks; returns it and its slots."""
    seq_lens = np.array(context_lens) + np.array(query_lens)
    blocks_each = -(-seq_lens.max() // block_size)
    tables = np.arange(len(query_lens) * blocks_each, dtype=np.int32).reshape(len(query_lens), blocks_each)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    metadata = AttentionMetadata(
        num_tokens=len(positions), num_seqs=len(query_lens), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.tensor(np.concatenate(([0], np.cumsum(query_lens))), dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(tables, device=DEVICE), slot_mapping=torch.tensor(slots, device=DEVICE),
        query_lens_cpu=np.array(query_lens), seq_lens_cpu=seq_lens, backend=backend)
    backend.prepare(metadata)
    return metadata, torch.tensor(positions, device=DEVICE), tables.size


@pytest.mark.parametrize("query_lens,context_lens",
                         [([1] * 6, [0, 5, 16, 40, 3, 100]), ([1, 9, 1, 20], [7, 0, 60, 13])], ids=["decode", "mixed"])
def test_triton_backend_runs_rope_in_its_cache_store(query_lens, context_lens):
    """The backend's rotary path gives what rotating first and then running its plain path gives."""
    num_heads, num_kv_heads, head_size, block_size, dtype = 14, 2, 64, 16, DTYPES[0]
    backend = TritonAttentionBackend()
    metadata, positions, num_blocks = paged_step_metadata(backend, query_lens, context_lens, block_size)
    num_tokens = positions.shape[0]
    rope = RotaryEmbedding(head_size, 4096, 1000000.0).to(DEVICE)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=11)
    cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=12)
    results = []
    for fused in (True, False):
        q, k, v = qkv.clone().split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
        q, k, v = (x.view(num_tokens, -1, head_size) for x in (q, k, v))
        k_cache, v_cache = cache.clone(), cache.clone()
        if fused:
            out = backend.forward_rotary(positions, rope, q, k, v, k_cache, v_cache, metadata, head_size ** -0.5)
        else:
            rotary_embedding_(positions, q, k, rope.cos_cached, rope.sin_cached)
            out = backend.forward(q, k, v, k_cache, v_cache, metadata, head_size ** -0.5)
        results.append((out, k_cache, v_cache))
    for got, expected, name in zip(results[0], results[1], ("output", "key cache", "value cache")):
        assert torch.equal(got, expected), f"{name} differs between the fused and the unfused RoPE"
