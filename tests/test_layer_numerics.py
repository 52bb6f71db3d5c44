"""RoPE, RMSNorm and SiluAndMul against naive float64 implementations written from their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from novainfer.layers.activation import SiluAndMul
from novainfer.layers.layernorm import RMSNorm
from novainfer.layers.rotary_embedding import RotaryEmbedding

MAX_POSITION = 32768


# ---- RoPE ---------------------------------------------------------------------------------------
def naive_rope(x: torch.Tensor, positions: list[int], base: float) -> torch.Tensor:
    """Rotate-half RoPE, one position at a time, as complex multiplication in float64.

    Element ``i`` and element ``i + d/2`` of a head form the complex number ``x_i + j x_{i+d/2}``,
    which is multiplied by ``exp(j * pos * base^(-2i/d))``.
    """
    d = x.shape[-1]
    half = d // 2
    out = torch.empty(x.shape, dtype=torch.float64)
    for t, pos in enumerate(positions):
        angles = torch.tensor([pos * base ** (-2.0 * i / d) for i in range(half)], dtype=torch.float64)
        rotation = torch.polar(torch.ones_like(angles), angles)  # [half]
        z = torch.complex(x[t, :, :half].double(), x[t, :, half:].double()) * rotation
        out[t, :, :half] = z.real
        out[t, :, half:] = z.imag
    return out


def rope_tolerance(x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Per-token bound on the float32 error of a table-based RoPE.

    The angle ``pos * inv_freq`` is formed in float32, so it is off by up to a few ulps of itself
    (one ulp of ``pos`` is ``pos * 2^-23`` at most): ``pos * 2^-22`` radians bounds it at every
    frequency (observed: under a third of that). The rotated values move by that angle times their
    magnitude. A real mistake (wrong layout, position, base) moves them by O(|x|).
    """
    mags = x.double().abs().flatten(1).amax(dim=1)
    pos = torch.tensor(positions, dtype=torch.float64)
    return (2e-6 + pos * 2.0 ** -22) * mags


def check_rope(rope: RotaryEmbedding, positions: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               base: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(positions), num_heads, head_dim, generator=gen)
    k = torch.randn(len(positions), num_kv_heads, head_dim, generator=gen)
    q_out, k_out = rope(torch.tensor(positions), q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    for x, out in ((q, q_out), (k, k_out)):
        expected = naive_rope(x, positions, base)
        err = (out.double() - expected).abs().flatten(1).amax(dim=1)
        tol = rope_tolerance(x, positions)
        assert (err <= tol).all(), f"RoPE error {err.tolist()} exceeds {tol.tolist()} at positions {positions}"
        # The tolerance is tight enough to see a position off by one.
        shifted = naive_rope(x, [p + 1 for p in positions], base)
        shifted_err = (out.double() - shifted).abs().flatten(1).amax(dim=1)
        assert (shifted_err > 10 * tol).all()


@pytest.fixture(scope="module")
def ropes():
    cache = {}

    def get(head_dim: int, base: float) -> RotaryEmbedding:
        if (head_dim, base) not in cache:
            cache[(head_dim, base)] = RotaryEmbedding(head_dim, MAX_POSITION, base)
        return cache[(head_dim, base)]

    return get


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("base", [1e4, 1e6])
def test_rope_matches_naive_at_arbitrary_positions(ropes, head_dim, base):
    rope = ropes(head_dim, base)
    # Unsorted, repeated, both ends of the table, and large values.
    positions = [17, 0, 5, MAX_POSITION - 1, 3, 3, 1000, 1, 31000, 2, 8191, 12345, MAX_POSITION - 2, 0, 777]
    check_rope(rope, positions, num_heads=4, num_kv_heads=2, head_dim=head_dim, base=base, seed=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("base", [1e4, 1e6])
def test_rope_small_positions_are_tight(ropes, head_dim, base):
    rope = ropes(head_dim, base)
    positions = [9, 2, 0, 63, 7, 1, 40]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(positions), 3, head_dim, generator=gen)
    k = torch.randn(len(positions), 1, head_dim, generator=gen)
    q_out, k_out = rope(torch.tensor(positions), q, k)
    torch.testing.assert_close(q_out.double(), naive_rope(q, positions, base), rtol=0, atol=2e-5)
    torch.testing.assert_close(k_out.double(), naive_rope(k, positions, base), rtol=0, atol=2e-5)


def test_rope_position_zero_is_identity_and_norms_are_preserved(ropes):
    rope = ropes(64, 1e6)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 2, 64, generator=gen)
    k = torch.randn(6, 2, 64, generator=gen)
    positions = torch.tensor([0, 0, 30000, 11, 4096, 9])
    q_out, k_out = rope(positions, q, k)
    assert torch.equal(q_out[:2], q[:2]) and torch.equal(k_out[:2], k[:2])
    # Each (i, i + d/2) pair is rotated, so its length does not change.
    def pair_norms(x):
        return torch.hypot(x[..., :32], x[..., 32:])
    torch.testing.assert_close(pair_norms(q_out), pair_norms(q), rtol=1e-5, atol=1e-5)


def test_rope_bfloat16_inputs(ropes):
    rope = ropes(128, 1e6)
    positions = [5, 0, 100, 17, 2047]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(positions), 2, 128, generator=gen).bfloat16()
    k = torch.randn(len(positions), 2, 128, generator=gen).bfloat16()
    q_out, k_out = rope(torch.tensor(positions), q, k)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits: a few ulps of values of magnitude up to ~4.
    torch.testing.assert_close(q_out.double(), naive_rope(q, positions, 1e6), rtol=0, atol=0.1)
    torch.testing.assert_close(k_out.double(), naive_rope(k, positions, 1e6), rtol=0, atol=0.1)


def test_rope_rejects_odd_head_size():
    with pytest.raises(ValueError):
        RotaryEmbedding(63, 16, 1e4)


# ---- RMSNorm ------------------------------------------------------------------------------------
def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        v = x[row]
        rms = math.sqrt(sum(float(e) ** 2 for e in v) / v.numel() + eps)
        out[row] = v / rms * weight.double()
    return out


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # at 1e-3 the eps term is a visible part of the rms
def test_rms_norm_matches_formula(eps, scale):
    hidden = 48
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(hidden, eps)
    weight = 1.0 + 0.3 * torch.randn(hidden, generator=gen)
    norm.weight.data.copy_(weight)
    x = torch.randn(7, hidden, generator=gen) * scale
    out = norm(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_rms_norm(x, weight, eps), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_with_residual(eps):
    hidden = 32
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(hidden, eps)
    weight = 1.0 + 0.3 * torch.randn(hidden, generator=gen)
    norm.weight.data.copy_(weight)
    x = torch.randn(5, hidden, generator=gen)
    residual = torch.randn(5, hidden, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x_before + residual_before)
    torch.testing.assert_close(out.double(), naive_rms_norm(x_before + residual_before, weight, eps),
                               rtol=1e-5, atol=1e-6)
    # The inputs the caller still holds are not modified.
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_bfloat16_matches_transformers_rounding():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    hidden = 64
    gen = torch.Generator().manual_seed(6)
    weight = (1.0 + 0.3 * torch.randn(hidden, generator=gen)).bfloat16()
    x = (torch.randn(9, hidden, generator=gen) * 3).bfloat16()
    ours = RMSNorm(hidden, 1e-6, params_dtype=torch.bfloat16)
    ours.weight.data.copy_(weight)
    theirs = Qwen2RMSNorm(hidden, eps=1e-6).to(torch.bfloat16)
    theirs.weight.data.copy_(weight)
    out = ours(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, theirs(x))
    torch.testing.assert_close(out.double(), naive_rms_norm(x, weight, 1e-6), rtol=2e-2, atol=2e-2)


# ---- SiluAndMul ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 2 * 7), (2, 3, 2 * 16)])
def test_silu_and_mul_matches_formula(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 3
    out = SiluAndMul()(x)
    d = shape[-1] // 2
    assert out.shape == (*shape[:-1], d)
    flat_x = x.reshape(-1, shape[-1]).double()
    flat_out = out.reshape(-1, d)
    for row in range(flat_x.shape[0]):
        for i in range(d):
            gate, up = float(flat_x[row, i]), float(flat_x[row, d + i])
            expected = gate / (1.0 + math.exp(-gate)) * up
            assert abs(float(flat_out[row, i]) - expected) <= 1e-5 * (1 + abs(expected))
