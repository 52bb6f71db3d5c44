"""Direct launches (``KernelLauncher``) against Triton's own ``kernel[grid]`` path, on CUDA.

Every fused op of a decoder layer runs once with direct launches off, and then twice with them on
(the first call of a specialization takes the plain path and keeps the binary, the second launches
the kept binary), and the outputs must be bitwise equal. The cases alternate specializations that
Triton compiles separately (dtypes, a pointer off 16-byte alignment, an integer argument equal to 1,
token counts), so a launcher that reused a binary across specializations would launch the wrong
one. A counter on ``JITFunction.run`` checks that repeated calls really skip it.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from novainfer.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from novainfer.attention.ops import reshape_and_cache  # noqa: E402
from novainfer.layers.ops import fused_add_rms_norm_, rms_norm, rotary_embedding_, silu_and_mul  # noqa: E402
from novainfer.layers.ops.launcher import KernelLauncher, direct_launches  # noqa: E402
from novainfer.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from tests.gpu.test_fused_ops import paged_step_metadata, randn  # noqa: E402
from tests.gpu.triton_env import INTERPRET  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason="the interpreter has no binaries to launch")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def unaligned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a tensor whose data starts one element past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:]
    assert flat.data_ptr() % 16
    return flat.view(x.shape).copy_(x)


def norm_and_activation(dtype: torch.dtype, num_tokens: int, misaligned: bool):
    hidden = 896
    x = randn(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=2)
    weight = randn(hidden, dtype=dtype, seed=3, scale=0.5) + 1
    gate_up = randn(num_tokens, 2 * 1216, dtype=dtype, seed=4)
    if misaligned:
        x, gate_up = unaligned(x), unaligned(gate_up)
    return (rms_norm(x, weight, 1e-6), *rms_norm(x, weight, 1e-6, residual), silu_and_mul(gate_up),
            *fused_add_rms_norm_(x.clone(), residual.clone(), weight, 1e-6))


def attention_step(dtype: torch.dtype, query_lens: list[int], context_lens: list[int]):
    """A Triton backend step: RoPE fused with the cache store, then prefill and/or split-K decode
    attention; plus the unfused in-place RoPE and the plain cache store."""
    num_heads, num_kv_heads, head_size, block_size = 14, 2, 64, 16
    backend = TritonAttentionBackend()
    metadata, positions, num_blocks = paged_step_metadata(backend, query_lens, context_lens, block_size)
    num_tokens = positions.shape[0]
    rope = RotaryEmbedding(head_size, 4096, 1000000.0).to("cuda")
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=5)
    cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=6)
    sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
    q, k, v = (x.view(num_tokens, -1, head_size) for x in qkv.clone().split(sizes, -1))
    k_cache, v_cache = cache.clone(), cache.clone()
    out = backend.forward_rotary(positions, rope, q, k, v, k_cache, v_cache, metadata, head_size ** -0.5)
    q2, k2, v2 = (x.view(num_tokens, -1, head_size) for x in qkv.clone().split(sizes, -1))
    k_cache2, v_cache2 = cache.clone(), cache.clone()
    rotary_embedding_(positions, q2, k2, rope.cos_cached, rope.sin_cached)
    reshape_and_cache(k2, v2, k_cache2, v_cache2, metadata.slot_mapping)
    return out, q, k_cache, v_cache, q2, k2, k_cache2, v_cache2


CASES = [
    *[(f"norm-act-{str(dtype)[6:]}-{n}", norm_and_activation, (dtype, n, False)) for dtype in DTYPES for n in (37, 1)],
    ("norm-act-unaligned", norm_and_activation, (torch.bfloat16, 37, True)),
    ("decode", attention_step, (torch.bfloat16, [1] * 6, [0, 5, 16, 40, 3, 1000])),
    ("decode-one-seq", attention_step, (torch.bfloat16, [1], [700])),
    ("mixed", attention_step, (torch.bfloat16, [1, 9, 1, 20], [7, 0, 60, 13])),
    ("mixed-fp16", attention_step, (torch.float16, [1, 9, 1, 20], [7, 0, 60, 13])),
    ("prefill", attention_step, (torch.bfloat16, [33, 17], [0, 0])),
    ("prefill-one-seq", attention_step, (torch.bfloat16, [40], [0])),  # num_seqs == 1: a constexpr to Triton
]


def launchers() -> list[KernelLauncher]:
    """Every launcher of the ops above (modules by name: the ops package re-exports functions
    that have the names of some of its modules)."""
    names = {"novainfer.layers.ops.rms_norm": ["_launch_rms_norm"],
             "novainfer.layers.ops.activation": ["_launch_silu_and_mul"],
             "novainfer.layers.ops.rotary_embedding": ["_launch_rotary_embedding"],
             "novainfer.attention.ops.reshape_and_cache": ["_launch_reshape_and_cache"],
             "novainfer.attention.ops.decode_attention": ["_launch_decode_attention", "_launch_reduce_splits"],
             "novainfer.attention.ops.prefill_attention": ["_launch_prefill_attention"]}
    return [getattr(importlib.import_module(module), name) for module, attrs in names.items() for name in attrs]


def test_direct_launches_give_the_plain_launches_outputs(monkeypatch):
    plain_runs = []
    for launcher in launchers():
        monkeypatch.setattr(launcher, "_binaries", {})  # none kept by earlier tests
        run = launcher.kernel.run
        monkeypatch.setattr(launcher.kernel, "run", lambda *a, run=run, name=launcher.kernel.fn.__name__, **k:
                            plain_runs.append(name) or run(*a, **k))
    with direct_launches(False):
        expected = {name: fn(*args) for name, fn, args in CASES}
    plain_calls = len(plain_runs)
    assert plain_calls > 0
    for repeat in range(2):  # the first pass keeps each specialization's binary, the second launches it
        with direct_launches(True):
            got = {name: fn(*args) for name, fn, args in CASES}
        for name, _, _ in CASES:
            for i, (g, e) in enumerate(zip(got[name], expected[name], strict=True)):
                assert torch.equal(g, e), f"{name}: output {i} differs from the plain launch (pass {repeat})"
        if repeat == 0:
            first_pass_calls = len(plain_runs) - plain_calls
            assert 0 < first_pass_calls <= plain_calls
    assert len(plain_runs) == plain_calls + first_pass_calls, \
        f"the second direct pass went through JITFunction.run: {plain_runs[plain_calls + first_pass_calls:]}"
    torch.cuda.synchronize()


def test_launches_inside_a_cuda_graph_replay_the_direct_binaries():
    """A graph captured with direct launches (on the capture stream) replays what the plain path computes."""
    x = randn(64, 896, dtype=torch.bfloat16, seed=7)
    residual = randn(64, 896, dtype=torch.bfloat16, seed=8)
    weight = randn(896, dtype=torch.bfloat16, seed=9) + 1
    with direct_launches(False):
        expected = rms_norm(silu_and_mul(torch.cat([x, x], -1)), weight, 1e-6, residual)
    with direct_launches(True):
        for _ in range(2):  # keep the binaries before capturing
            rms_norm(silu_and_mul(torch.cat([x, x], -1)), weight, 1e-6, residual)
        gate_up = torch.cat([x, x], -1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rms_norm(silu_and_mul(gate_up), weight, 1e-6, residual)
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip(out, expected, strict=True):
        assert torch.equal(g, e)


def test_model_steps_with_direct_launches_give_the_plain_logits():
    """A Qwen2-0.5B-shaped model (4 layers), bf16, Triton attention: a prefill step and then a mixed
    step (decodes beside a new prompt) give bitwise the logits of the same steps launched plainly."""
    from novainfer.worker.model_runner import SequenceInput
    from tests.test_model_parity import block_tables_for, make_runner, random_prompts
    from tests.utils import tiny_model

    model_dir = tiny_model(num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_size=896,
                           intermediate_size=4864, num_hidden_layers=4, tie_word_embeddings=True, std=0.05)
    runner = make_runner(model_dir, block_size=16, num_blocks=64, device="cuda", dtype="bfloat16",
                         attention_backend="triton")
    prompts = random_prompts(runner.model_config.vocab_size, [5, 33, 120, 17], seed=3)
    tables = block_tables_for([len(p) + 1 for p in prompts], runner.block_size)
    prefill = [SequenceInput(p, 0, t, "all") for p, t in zip(prompts[:3], tables)]
    mixed = [*(SequenceInput([7 + i], len(p), t, "last") for i, (p, t) in enumerate(zip(prompts[:3], tables))),
             SequenceInput(prompts[3], 0, tables[3], "all")]
    logits = {}
    for direct in (False, True, True):  # the second direct run launches kept binaries only
        with direct_launches(direct):
            logits[direct] = [runner.forward(prefill).cpu(), runner.forward(mixed).cpu()]
    for got, expected, step in zip(logits[True], logits[False], ("prefill", "mixed")):
        assert torch.equal(got, expected), f"{step} step: direct launches changed the logits"
