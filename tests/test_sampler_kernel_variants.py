"""The fused draw kernel's compiled variants, computed without a GPU: start-up's launches must cover
the variant of every real step, whatever its sampling settings and batch size.

Oracle: Triton's own binder for an sm_90 target, which names the specialization (argument dtypes,
16-byte alignment of pointers, integers equal to 1, constexprs) that a launch with these arguments
would compile. The arguments are those ``novainfer.sample.ops`` passes for start-up's warm-up and for
metadata from the sampling state table (whose per-row parameters are columns of one table, at
byte offsets that are not all 16-byte aligned).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from novainfer.sample import SamplingMetadata, ops  # noqa: E402
from novainfer.sampling_params import SamplingParams  # noqa: E402

VOCAB = 1000
SETTINGS = [dict(temperature=0), dict(temperature=0.8), dict(temperature=0.8, seed=3), dict(temperature=0, logprobs=3),
            dict(temperature=0.8, repetition_penalty=1.2), dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
            dict(temperature=0.9, min_tokens=4, logprobs=2, repetition_penalty=1.1, presence_penalty=0.2)]


@pytest.fixture
def draw_variants(monkeypatch):
    """Replaces the draw kernel with a recorder of the specialization each launch would compile."""
    kernel = ops._draw_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    variants: set[str] = set()

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _, specialization, options = binder(*args, **kwargs)
                variants.add(f"{specialization} {sorted(options.items())}")
            return launch

    class Skipped:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    # The launchers ops calls (each holds its kernel).
    monkeypatch.setattr(ops, "_launch_draw", Recorder())
    monkeypatch.setattr(ops, "_launch_combine_chunks", Skipped())
    return variants


def test_start_up_compiles_the_draw_variant_of_every_setting_and_batch_size(draw_variants):
    ops.warm_up_draw(torch.zeros(1, VOCAB))
    compiled = set(draw_variants)
    assert len(compiled) == 4  # noise x log-sum-exp
    for settings in SETTINGS:
        for batch_size in (1, 3, 5, 16):
            params = [SamplingParams(max_tokens=8, **settings)] * batch_size
            metadata = SamplingMetadata.from_requests(params, [[1, 2]] * batch_size, [[3]] * batch_size, "cpu", VOCAB)
            ops.draw_whole_vocabulary(torch.zeros(batch_size, VOCAB), metadata, metadata.noise_keys,
                                      metadata.max_num_logprobs is not None)
    assert draw_variants == compiled, sorted(draw_variants - compiled)
