"""Fused Triton RMSNorm(+residual), SiLU-and-mul and in-place RoPE against the layers' PyTorch code.

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

On CUDA the layers themselves are called (their ``x.is_cuda`` branch picks the kernel); under the
Triton interpreter (CPU tensors) the ops are called directly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from novainfer.layers.activation import SiluAndMul  # noqa: E402
from novainfer.layers.layernorm import RMSNorm  # noqa: E402
from novainfer.layers.ops import rms_norm, rotary_embedding_, silu_and_mul  # noqa: E402
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


def test_rms_norm_float32_weight_promotes_output():
    x = randn(5, 64, dtype=DTYPES[0], seed=4)
    weight = randn(64, dtype=torch.float32, seed=5)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32


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
