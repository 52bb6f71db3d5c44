"""Tensor parallelism over two GPUs in bfloat16, against one GPU.

``uni`` keeps both ranks in this process (NCCL communicators made by CuPy, one thread per GPU);
``mp`` gives each rank a process (NCCL through torch.distributed). Greedy tokens must equal the
single-GPU engine's until a near-tie: where they first differ, the two candidates' float32
logits (transformers, the oracle) must be closer than twice transformers' own bf16 logit error
there. Each rank caches only its KV heads: half the bytes per block of one GPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from novainfer import LLM, SamplingParams
from tests.utils import hf_logits, random_ids, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices")]

# Qwen2-0.5B's shape, shallower: 14 query heads and 2 KV heads split into 7 and 1 per rank.
MODEL = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_size=896,
             intermediate_size=4864, num_hidden_layers=4, tie_word_embeddings=True, std=0.05)
ENGINE = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=256, max_num_seqs=8,
              num_gpu_blocks_override=128)
MAX_TOKENS = 32
BACKENDS = ["uni", "mp"]


@pytest.fixture(scope="module", autouse=True)
def nccl_environment():
    """NVLink SHARP multicast off (NCCL and torch's symmetric memory), before any communicator exists;
    worker processes inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NCCL_NVLS_ENABLE", "0")
        patch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        yield


def _needs_backend(backend: str) -> None:
    if backend == "uni":
        pytest.importorskip("cupy", reason="uni over several GPUs needs CuPy's NCCL binding")


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model(**MODEL)


@pytest.fixture(scope="module")
def prompts(model_dir):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return [random_ids(30 + i, n, vocab) for i, n in enumerate((4, 17, 60))]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def single_gpu(model_dir, prompts):
    llm = LLM(str(model_dir), **ENGINE)
    try:
        return _greedy(llm, prompts)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_bf16_greedy_equal_to_one_gpu_until_a_near_tie(model_dir, prompts, single_gpu, backend):
    _needs_backend(backend)
    llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend=backend, **ENGINE)
    try:
        outputs = _greedy(llm, prompts)
    finally:
        llm.llm_engine.shutdown()
    for prompt, ours, reference in zip(prompts, outputs, single_gpu):
        diverge = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
        print(f"{backend} prompt len {len(prompt)}: equal for "
              f"{diverge if diverge is not None else MAX_TOKENS}/{MAX_TOKENS} tokens")
        assert len(ours) == MAX_TOKENS
        if diverge is None:
            continue
        context = prompt + reference[:diverge]
        truth = hf_logits(model_dir, context, torch.float32, "cuda")[-1]
        bf16_noise = (hf_logits(model_dir, context, torch.bfloat16, "cuda")[-1] - truth).abs().max().item()
        gap = abs(truth[ours[diverge]] - truth[reference[diverge]]).item()
        print(f"  first divergence at token {diverge}: float32 gap {gap:.4f}, transformers bf16 noise "
              f"{bf16_noise:.4f}")
        assert gap < 2 * bf16_noise, f"diverged at token {diverge} with a float32 logit gap of {gap}"


# Run on each rank through collective_rpc (in the worker processes too, hence module level).
def _rank_kv(worker) -> tuple[str, int, int]:
    layers = worker.model_runner.model.attention_layers()
    kv_bytes = sum(layer.k_cache.nbytes + layer.v_cache.nbytes for layer in layers)
    return str(worker.device), layers[0].k_cache.shape[2], kv_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_gpu_caches_half_the_kv_heads(model_dir, backend):
    _needs_backend(backend)
    results = {}
    for tp in (1, 2):
        llm = LLM(str(model_dir), tensor_parallel_size=tp, distributed_executor_backend=backend, **ENGINE)
        try:
            results[tp] = llm.llm_engine.executor.collective_rpc(_rank_kv)
        finally:
            llm.llm_engine.shutdown()
    (device, heads, one_gpu_bytes), = results[1]
    assert heads == MODEL["num_key_value_heads"]
    assert sorted(device for device, _, _ in results[2]) == ["cuda:0", "cuda:1"]
    for device, heads, kv_bytes in results[2]:
        print(f"{backend} {device}: {heads} KV head(s), {kv_bytes} KV bytes (one GPU: {one_gpu_bytes})")
        assert heads == MODEL["num_key_value_heads"] // 2
        assert kv_bytes * 2 == one_gpu_bytes  # same block count, half the heads
