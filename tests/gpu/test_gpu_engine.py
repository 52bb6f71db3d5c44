"""The GPU fast path end to end: CUDA graphs against eager steps, preemption and prefix caching.

Float32 models keep numerical noise (about 1e-6) far below the logit gaps of greedy choices, so
graph and eager runs, and runs with and without preemption or prefix caching, must produce the
same tokens exactly. Logits of one graph-replayed decode step are compared with the same step
run eagerly.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch

from novainfer import LLM, SamplingParams
from tests.test_model_parity import block_tables_for, make_runner, random_prompts
from tests.utils import hf_greedy, tiny_model

pytestmark = pytest.mark.gpu

GQA_MODEL = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=256,
                 intermediate_size=512, num_hidden_layers=3)


def _prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=count).tolist()
    return random_prompts(vocab_size, lengths, seed=seed)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model(**GQA_MODEL)


def _graph_and_eager_logits(runner, step, expected_key, atol: float = 1e-4):
    with torch.inference_mode():
        graph_input = runner._load(runner._stage(*runner._flatten(step)))
        assert graph_input.graph_key == expected_key
        graph_logits = runner._compute_logits(graph_input).float().clone()
        eager_logits = runner._compute_logits(runner.prepare_inputs(step)).float()
    rows = sum(len(s.token_ids) if s.logits == "all" else s.logits == "last" for s in step)
    assert graph_logits.shape == eager_logits.shape == (rows, runner.model_config.vocab_size)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def graph_runner(model_dir):
    runner = make_runner(model_dir, block_size=16, num_blocks=2048, device="cuda", dtype="float32",
                         attention_backend="triton")
    runner.capture_model(max_num_seqs=64, max_num_tokens=512)
    return runner


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 37])
def test_graph_replay_matches_eager_decode_step(graph_runner, num_seqs):
    from novainfer.worker.model_runner import SequenceInput

    runner = graph_runner
    prompts = _prompts(runner.model_config.vocab_size, num_seqs, seed=num_seqs)
    tables = block_tables_for([len(p) + 1 for p in prompts], runner.block_size)
    runner.forward([SequenceInput(p, 0, t, "none") for p, t in zip(prompts, tables)])
    decode = [SequenceInput([7], len(p), t, "last") for p, t in zip(prompts, tables)]
    _graph_and_eager_logits(runner, decode, runner.graphs.padded_key("decode", num_seqs))


@pytest.mark.parametrize("num_decodes, chunk", [(0, 5), (3, 40), (37, 200), (60, 2)])
def test_graph_replay_matches_eager_mixed_step(monkeypatch, graph_runner, num_decodes, chunk):
    """Decodes with long contexts (split over the decode kernel's programs), a prompt chunk on a
    cached prefix and a new prompt, padded to a mixed graph (never run as decode rows here)."""
    from novainfer.worker import model_runner
    from novainfer.worker.model_runner import SequenceInput

    monkeypatch.setattr(model_runner, "DECODE_ROWS_MAX_EXTRA_KEYS", 0)
    runner = graph_runner
    prompts = _prompts(runner.model_config.vocab_size, num_decodes + 2, seed=chunk)
    tables = block_tables_for([len(p) + chunk + 1 for p in prompts], runner.block_size)
    runner.forward([SequenceInput(p, 0, t, "none") for p, t in zip(prompts, tables)])
    step = [SequenceInput([7], len(p), t) for p, t in zip(prompts[:num_decodes], tables)]
    step.append(SequenceInput(prompts[-2][:chunk], len(prompts[-2]), tables[-2]))
    step.append(SequenceInput(prompts[-1][:chunk], 0, tables[-1]))
    num_tokens = num_decodes + 2 * chunk
    _graph_and_eager_logits(runner, step, runner.graphs.padded_key("mixed", num_tokens))


@pytest.mark.parametrize("num_seqs, max_queries", [(1, 5), (6, 3), (12, 3)])
def test_graph_replay_matches_eager_step_as_decode_rows(graph_runner, num_seqs, max_queries):
    """Sequences with a few query tokens each after their context (as a verification of drafts):
    one decode row per token, padded to a decode graph, gives the eager (prefill kernel) logits."""
    from novainfer.worker.model_runner import SequenceInput

    runner = graph_runner
    prompts = _prompts(runner.model_config.vocab_size, num_seqs, seed=100 + num_seqs)
    queries = [[7 + i] * (1 + i % max_queries) for i in range(num_seqs)]
    tables = block_tables_for([len(p) + len(q) for p, q in zip(prompts, queries)], runner.block_size)
    runner.forward([SequenceInput(p, 0, t, "none") for p, t in zip(prompts, tables)])
    step = [SequenceInput(q, len(p), t, "all") for p, q, t in zip(prompts, queries, tables)]
    # Two kernels (decode rows against the prefill kernel) sum the context in different orders.
    _graph_and_eager_logits(runner, step, runner.graphs.padded_key("decode", sum(map(len, queries))), atol=5e-4)


@pytest.fixture(scope="module")
def eager_outputs(model_dir):
    # Eager and each step fetched before the next: the reference of the graph and async engines.
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, async_scheduling=False, max_num_seqs=64,
              num_gpu_blocks_override=2048)
    prompts = _prompts(llm.llm_engine.model_config.vocab_size, 48, seed=1)
    outputs = _generate(llm, prompts, 40)
    llm.shutdown()
    return prompts, outputs


def test_cuda_graph_engine_equals_eager(model_dir, eager_outputs):
    prompts, expected = eager_outputs
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=64, num_gpu_blocks_override=2048)
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    assert runner.graphs, "no CUDA graph was captured"
    assert _generate(llm, prompts, 40) == expected
    llm.shutdown()


def test_preemption_on_gpu_keeps_outputs(model_dir, eager_outputs):
    prompts, expected = eager_outputs
    # 48 requests of up to 340 tokens need about 600 blocks of 16; 64 force many preemptions.
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=64, num_gpu_blocks_override=64)
    assert _generate(llm, prompts, 40) == expected
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    llm.shutdown()


def test_prefix_caching_on_gpu_keeps_outputs(model_dir):
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shared = random_prompts(vocab_size, [200], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(vocab_size, [3, 40, 17, 90], seed=6)]
    results = {}
    for caching in (False, True):
        llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=caching, num_gpu_blocks_override=512)
        _generate(llm, prompts[:1], 8)  # fills the cache with the shared prefix
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in outputs]
        cached = [o.num_cached_tokens for o in outputs]
        assert all(c >= 192 for c in cached) if caching else all(c == 0 for c in cached)
        llm.shutdown()
    assert results[True] == results[False]


def _count_replays(llm: LLM) -> dict[str, int]:
    """Counts the graph replays of ``llm``'s runner by kind, from now on."""
    graphs = llm.llm_engine.engine_core.executor.driver_worker.model_runner.graphs
    counts = {"decode": 0, "mixed": 0}
    replay = graphs.replay

    def counting(key):
        counts[key.kind] += 1
        return replay(key)

    graphs.replay = counting
    return counts


def test_mixed_graph_steps_equal_transformers(model_dir):
    """Chunked prefill (64-token steps), a shared prefix and preemption (few blocks), through captured
    mixed steps: greedy tokens equal transformers' (float32)."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shared = random_prompts(vocab_size, [70], seed=11)[0]
    prompts = [shared + tail for tail in random_prompts(vocab_size, [3, 50, 17, 90, 1, 33], seed=12)]
    prompts += random_prompts(vocab_size, [120, 9], seed=13)
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=16,
              max_cudagraph_capture_size=64)
    counts = _count_replays(llm)
    ours = _generate(llm, prompts, 24)
    stats = llm.llm_engine.get_stats()
    llm.shutdown()
    assert counts["mixed"] > 0 and counts["decode"] > 0, counts
    assert stats.num_preemptions_total > 0
    for prompt, out in zip(prompts, ours):
        assert out == hf_greedy(model_dir, prompt, 24, torch.float32, "cuda")


def test_graphs_on_and_off_give_the_same_tokens_for_512_requests_under_continuous_admission(model_dir):
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(21)
    prompts = random_prompts(vocab_size, rng.integers(1, 200, size=512).tolist(), seed=21)
    max_tokens = rng.integers(1, 48, size=512).tolist()
    results = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="float32", enforce_eager=eager, max_num_seqs=64, max_num_batched_tokens=512,
                  num_gpu_blocks_override=2048)
        counts = None if eager else _count_replays(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
                               use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outputs]
        llm.shutdown()
    assert counts["mixed"] > 0 and counts["decode"] > 0, counts
    assert results[False] == results[True]


def _kernel_variants() -> dict[str, set[str]]:
    """The compiled variants (specialization keys) of each attention, sampler and step-input kernel,
    on every device."""
    decode_ops = importlib.import_module("novainfer.attention.ops.decode_attention")
    prefill_ops = importlib.import_module("novainfer.attention.ops.prefill_attention")
    sample_ops = importlib.import_module("novainfer.sample.ops")
    sample_topk = importlib.import_module("novainfer.sample.topk")
    input_ops = importlib.import_module("novainfer.worker.input_ops")
    kernels = {"decode": decode_ops._decode_attention_kernel, "reduce": decode_ops._reduce_splits_kernel,
               "prefill": prefill_ops._prefill_attention_kernel, "draw": sample_ops._draw_kernel,
               "combine": sample_ops._combine_chunks_kernel, "candidates": sample_ops._draw_candidates_kernel,
               "noise": sample_ops._exponential_noise_kernel, "top_k_maxima": sample_topk._group_maxima_kernel,
               "top_k_threshold": sample_topk._row_threshold_kernel,
               "top_k_collect": sample_topk._collect_candidates_kernel, "top_k_merge": sample_topk._top_k_merge_kernel,
               "finish_inputs": input_ops._finish_inputs_kernel}
    return {name: {str(key) for cache in kernel.device_caches.values() for key in cache[0]}
            for name, kernel in kernels.items()}


SAMPLING_SETTINGS = [
    dict(temperature=0), dict(temperature=0.8), dict(temperature=0.8, seed=3), dict(temperature=0, logprobs=3),
    dict(temperature=0.7, top_k=20, top_p=0.9), dict(temperature=0.7, top_k=20, seed=4),
    dict(temperature=0.8, repetition_penalty=1.2), dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
    dict(temperature=0.9, min_tokens=4, logprobs=2), dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.9, min_p=0.1, seed=5), dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_start_up_compiles_every_kernel_a_workload_launches(model_dir, dtype):
    """Eager steps beyond the captured bound, with few and many decodes of short and long contexts
    (so every split count), and every kind of sampling setting, alone and mixed in a step, launch
    no attention, sampler or step-input kernel variant that start-up did not compile."""
    llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=64, max_num_batched_tokens=2048,
              max_cudagraph_capture_size=16, num_gpu_blocks_override=2048)
    compiled = _kernel_variants()
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompts = _prompts(vocab_size, 96, seed=5) + random_prompts(vocab_size, [1500, 1800], seed=6)
    _generate(llm, prompts, max_tokens=24)
    for settings in SAMPLING_SETTINGS:  # each alone, then all in one batch
        params = SamplingParams(max_tokens=6, ignore_eos=True, **settings)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    mixed = [SamplingParams(max_tokens=6, ignore_eos=True, **settings) for settings in SAMPLING_SETTINGS]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:len(mixed)]], mixed, use_tqdm=False)
    llm.shutdown()
    new = {name: keys - compiled[name] for name, keys in _kernel_variants().items()}
    assert not any(new.values()), new
