"""Tensor parallelism over two GPUs in bfloat16, against one GPU, on a Qwen2-1.5B-shaped model.

``uni`` keeps both ranks in this process (NCCL communicators made by CuPy, one thread per GPU);
``mp`` gives each rank a process (NCCL through torch.distributed). Greedy tokens must equal the
single-GPU engine's until a near-tie: where they first differ, the two candidates' float32
logits (transformers, the oracle) must be closer than twice transformers' own bf16 logit error
there. Each rank caches only its KV heads: half the bytes per block of one GPU.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from novainfer import LLM, SamplingParams
from tests.test_tensor_parallel import check_collectives, check_collectives_on_worker, run_thread_ranks
from tests.utils import hf_logits, random_ids, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices")]

# Qwen2-1.5B's shape: 12 query heads and 2 KV heads split into 6 and 1 per rank.
MODEL = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
             intermediate_size=8960, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
             max_position_embeddings=32768, dtype="bfloat16", std=0.05)
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
def single_gpu(model_dir, prompts) -> dict:
    """The one-GPU engine's greedy tokens and KV cache, the reference of every TP test (which run
    with async scheduling, the GPU default, while this one fetches each step before the next)."""
    llm = LLM(str(model_dir), async_scheduling=False, **ENGINE)
    try:
        (kv,) = llm.llm_engine.engine_core.executor.collective_rpc(_rank_kv)
        return {"tokens": _greedy(llm, prompts), "kv": kv}
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module", params=BACKENDS)
def tp2(request, model_dir) -> LLM:
    """A tp=2 engine of each executor backend (one at a time: the previous one is shut down first)."""
    _needs_backend(request.param)
    llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend=request.param, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_bf16_greedy_equal_to_one_gpu_until_a_near_tie(model_dir, prompts, single_gpu, tp2):
    backend = tp2.llm_engine.config.parallel_config.distributed_executor_backend
    outputs = _greedy(tp2, prompts)
    for prompt, ours, reference in zip(prompts, outputs, single_gpu["tokens"]):
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_lm_head_greedy_picks_the_argmax_of_the_gathered_logits(model_dir, prompts, backend):
    """Under a vocabulary-split LM head, plain greedy steps gather one (logit, id) pair per row and
    rank instead of the logits, after the decode graphs; asking for logprobs takes the path that
    gathers the whole logits. From the same head outputs both must pick the same tokens (no prefix
    cache: the second run must compute exactly what the first did)."""
    _needs_backend(backend)
    llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend=backend,
              enable_vocab_parallel=True, enable_prefix_caching=False, **ENGINE)
    try:
        plain = _greedy(llm, prompts)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert plain == [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.llm_engine.shutdown()


def test_uni_driver_launches_the_decode_graphs_of_every_rank(tp2, prompts):
    """In ``uni`` the driver's thread copies a decode step and replays its graph on the other GPU
    too (no host collective in it); eager steps run on each rank's own thread."""
    if tp2.llm_engine.config.parallel_config.distributed_executor_backend != "uni":
        pytest.skip("only the uni executor has every rank in one process")
    follower = tp2.llm_engine.engine_core.executor.workers[1].model_runner
    calls: list[tuple[str, bool]] = []
    run_staged = follower.run_staged

    def recording(staged):
        calls.append((threading.current_thread().name, staged is not None and staged.graph_key is not None))
        return run_staged(staged)

    follower.run_staged = recording
    try:
        _greedy(tp2, prompts)
    finally:
        del follower.run_staged
    graph_steps = [name for name, is_graph in calls if is_graph]
    assert len(graph_steps) >= MAX_TOKENS - 1
    assert all(name.startswith("novainfer-rank0") for name in graph_steps)
    assert all(name.startswith("novainfer-rank1") for name, is_graph in calls if not is_graph)


# Run on each rank through collective_rpc (in the worker processes too, hence module level).
def _rank_kv(worker) -> tuple[str, int, int]:
    layers = worker.model_runner.model.attention_layers()
    kv_bytes = sum(layer.k_cache.nbytes + layer.v_cache.nbytes for layer in layers)
    return str(worker.device), layers[0].k_cache.shape[2], kv_bytes


def test_each_gpu_caches_half_the_kv_heads(single_gpu, tp2):
    backend = tp2.llm_engine.config.parallel_config.distributed_executor_backend
    _, heads, one_gpu_bytes = single_gpu["kv"]
    assert heads == MODEL["num_key_value_heads"]
    ranks = tp2.llm_engine.engine_core.executor.collective_rpc(_rank_kv)
    assert sorted(device for device, _, _ in ranks) == ["cuda:0", "cuda:1"]
    for device, heads, kv_bytes in ranks:
        print(f"{backend} {device}: {heads} KV head(s), {kv_bytes} KV bytes (one GPU: {one_gpu_bytes})")
        assert heads == MODEL["num_key_value_heads"] // 2
        assert kv_bytes * 2 == one_gpu_bytes  # same block count, half the heads


def test_engine_group_collectives_match_pytorch(tp2):
    """Every collective of the engine's NCCL group (CuPy's in one process, torch.distributed's
    across processes), sync and async, on both GPUs."""
    backend = tp2.llm_engine.config.parallel_config.distributed_executor_backend
    expected = {"uni": "CupyNcclProcessGroup", "mp": "TorchDistributedProcessGroup"}[backend]
    assert tp2.llm_engine.engine_core.executor.collective_rpc(check_collectives_on_worker) == [expected] * 2


# ---- CuPy's NCCL group on its own: ranks as threads, one GPU each --------------------------------
DEVICES = [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize("async_op", [False, True])
def test_cupy_nccl_thread_group_collectives_match_pytorch(async_op):
    _needs_backend("uni")
    sums = run_thread_ranks(2, lambda group: check_collectives(group, async_op).cpu(), backend="cupy-nccl",
                            devices=DEVICES)
    for result in sums:
        assert isinstance(result, torch.Tensor), result
        assert torch.equal(result, sums[0])


def _capture(device: torch.device, fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured on a side stream of ``device``; other threads (ranks) may capture at the same time."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(capture_error_mode="thread_local")
        fn()
        graph.capture_end()
    return graph


def _all_reduce_in_a_graph(group) -> list[torch.Tensor]:
    """Captures an all-reduce on each rank's thread at once, then replays it on new inputs."""
    device = group.device
    tensor = torch.zeros(1024, device=device)
    group.all_reduce(tensor)  # NCCL connects on the first collective, which cannot happen in a capture
    graph = _capture(device, lambda: group.all_reduce(tensor.mul_(2.0)))
    results = []
    for step in range(3):
        tensor.fill_(group.rank + 1 + step)
        graph.replay()
        results.append(tensor.cpu())
    return results


def test_cupy_nccl_all_reduce_replays_in_cuda_graphs():
    _needs_backend("uni")
    ranks = run_thread_ranks(2, _all_reduce_in_a_graph, backend="cupy-nccl", devices=DEVICES)
    for results in ranks:
        assert not isinstance(results, BaseException), results
        for step, tensor in enumerate(results):
            # 2 * (1 + step) + 2 * (2 + step): both ranks' doubled inputs, summed
            assert torch.equal(tensor, torch.full((1024,), 4.0 * step + 6.0)), (step, tensor[:4])


# ---- the custom all-reduce: one-shot and two-shot kernels --------------------------------------
# Each kernel forced by the smallest size of the two-shot, and the default choice by size, which
# mixes both kernels on the same buffers at four ranks (the engine's case).
TWO_SHOT_MIN_BYTES = {"one-shot": math.inf, "two-shot": 0, "by-size": None}


def _custom_all_reduce_sums(group, two_shot_min_bytes: float | None) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Sums of several sizes and dtypes, eagerly and replayed in a CUDA graph: (case, ours, inputs)."""
    assert group.enable_custom_all_reduce(), "no custom all-reduce between these GPUs"
    if two_shot_min_bytes is not None:
        group.custom_all_reduce.two_shot_min_bytes = two_shot_min_bytes
    device, results = group.device, []
    gen = torch.Generator(device).manual_seed(group.rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for numel in (1, 1000, 3584 * 7, 256 * 3584):
            x = torch.randn(numel, generator=gen, device=device).to(dtype)
            ours = x.clone()
            group.all_reduce(ours)
            results.append((f"{dtype} {numel}", ours.cpu(), x.cpu()))
    static = torch.zeros(256, 3584, dtype=torch.bfloat16, device=device)  # a decode step's hidden states
    small = torch.zeros(3584, dtype=torch.bfloat16, device=device)  # one request's

    def step() -> None:
        group.all_reduce(static)
        group.all_reduce(small)

    graph = _capture(device, step)
    for replay in range(3):
        x = torch.randn(static.shape, generator=gen, device=device).to(static.dtype)
        y = torch.randn(small.shape, generator=gen, device=device).to(small.dtype)
        static.copy_(x)
        small.copy_(y)
        graph.replay()
        results.append((f"graph replay {replay}, {static.numel()} elements", static.cpu(), x.cpu()))
        results.append((f"graph replay {replay}, {small.numel()} elements", small.cpu(), y.cpu()))
    return results


@pytest.mark.parametrize("kernel", list(TWO_SHOT_MIN_BYTES))
@pytest.mark.parametrize("world", [2, 4])
def test_custom_all_reduce_sums_in_rank_order_eagerly_and_in_graphs(world, kernel):
    """Every rank gets the float32 sum of all ranks' inputs in rank order, rounded once: bit-equal,
    whichever kernel runs."""
    _needs_backend("uni")
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    ranks = run_thread_ranks(world, lambda group: _custom_all_reduce_sums(group, TWO_SHOT_MIN_BYTES[kernel]),
                             backend="cupy-nccl", devices=[torch.device("cuda", i) for i in range(world)])
    for results in ranks:
        assert not isinstance(results, BaseException), results
    for i, (case, _, _) in enumerate(ranks[0]):
        inputs = [results[i][2] for results in ranks]
        expected = sum(x.float() for x in inputs).to(inputs[0].dtype)
        for rank, results in enumerate(ranks):
            assert torch.equal(results[i][1], expected), f"rank {rank}, {case}"


def _uses_custom_all_reduce(worker) -> bool:
    return worker.tp_group.custom_all_reduce is not None


def test_engine_groups_use_the_custom_all_reduce(tp2):
    assert tp2.llm_engine.engine_core.executor.collective_rpc(_uses_custom_all_reduce) == [True, True]
