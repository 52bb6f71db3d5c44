"""Host-side arithmetic of the kernels' launch parameters.

Plain Python on purpose: Triton's own ``triton.next_power_of_2``/``triton.cdiv`` are also callable
inside kernels, and from the host each call goes through Triton's JIT machinery, which costs
microseconds per call, several times per layer and step.
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
