"""Counter-based random noise for seeded requests: a pure function of (seed, output position, token id).

A seeded request must get the same tokens whatever shares its batch, whether the step before it
was still running on the device when its step was launched (async scheduling), and after it was
preempted and recomputed. A stateful generator per request gets this only by being advanced in
lockstep with the request (one generator call per seeded row per step, and its state kept across
preemption); a counter-based generator gets it by construction: the noise that decides the token
at output position ``p`` of a request with seed ``s`` is ``hash(s, p, token id)``, computed for
any number of rows at once on the device (elementwise torch ops; on CUDA one Triton kernel,
:mod:`novainfer.sample.ops`, with the same arithmetic). Nothing is stored per request but the
seed, and nothing moves between host and device.

Why a hash in torch rather than torch's Philox with per-row offsets: torch's generators take one
(seed, offset) each, so a batch of seeded rows needs one generator call per row (a kernel launch
and host work per row, every step), while the hash serves the whole batch at once, and is
keyed by token id, so the noise of a token does not depend on which other tokens are candidates
(sampling among a row's top-k candidates draws exactly what sampling over the whole vocabulary
would have drawn for them).

The hash works on 32-bit values held in int64 tensors, with odd multipliers below 2**31: every
product stays below 2**63, so no signed overflow happens on any backend. It is the xor-shift /
multiply integer hash (``x ^= x >> 16; x *= 0x45d9f3b``) applied three times, a bijection of the
32-bit values. Uniforms keep the top 23 bits (see :func:`uniform_from_bits`).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B
# Odd (so multiplying by it permutes the 32-bit values), from the golden ratio; token ids are
# below 2**31, so their products with it stay below 2**63.
GOLDEN = 0x9E3779B1


def _mix32(x: ArrayT) -> ArrayT:
    """A bijective 32-bit integer hash of the int64 tensor or array ``x`` (values in [0, 2**32))."""
    for _ in range(3):
        x = ((x >> 16) ^ x) * HASH_MUL & MASK32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    for _ in range(3):
        x = ((x >> 16) ^ x) * HASH_MUL & MASK32
    return (x >> 16) ^ x


def seed_lanes(seed: int) -> tuple[int, int]:
    """A seed (any value SamplingParams accepts: [-2**63, 2**64)) as two hashed 32-bit lanes."""
    seed &= (1 << 64) - 1
    return _mix32_int(seed & MASK32), _mix32_int((seed >> 32) ^ 0x5BD1E995)


def row_keys(seed_lo: ArrayT, seed_hi: ArrayT, positions: ArrayT) -> ArrayT:
    """[B] 32-bit keys of each row's draw at its output position: int64 tensors, or int64 numpy
    arrays (the same operations, so the same keys), of one shape."""
    return _mix32(seed_hi ^ _mix32(seed_lo ^ _mix32(positions & MASK32)))


def exponential_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise, float32, one value per (row, token): ``keys`` [B] from :func:`row_keys`,
    ``token_ids`` [B, W] (each row's candidates) or [W] (the same tokens for every row). On CUDA
    one Triton kernel computes it (:mod:`novainfer.sample.ops`)."""
    if keys.is_cuda:
        from novainfer.sample.ops import exponential_noise_triton

        return exponential_noise_triton(keys, token_ids)
    return exponential_noise_torch(keys, token_ids)


def exponential_noise_torch(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """:func:`exponential_noise` in torch operations (any device)."""
    if token_ids.dim() == 1:
        token_ids = token_ids.unsqueeze(0)
    bits = _mix32((keys.unsqueeze(1) + token_ids * GOLDEN) & MASK32)
    return -torch.log(uniform_from_bits(bits))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hash values as float32 uniforms strictly inside (0, 1), so their noise is finite and > 0.

    (top 23 bits + 1/2) / 2**23 is exact in float32 (24 significant bits). With 24 bits the largest
    value, (2**24 - 1/2) / 2**24, would round to 1.0: noise 0, which wins any Gumbel-max draw.
    """
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
