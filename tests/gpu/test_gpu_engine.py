"""The GPU fast path end to end: CUDA graphs against eager steps, preemption and prefix caching.

Float32 models keep numerical noise (about 1e-6) far below the logit gaps of greedy choices, so
graph and eager runs, and runs with and without preemption or prefix caching, must produce the
same tokens exactly. Logits of one graph-replayed decode step are compared with the same step
run eagerly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from novainfer import LLM, SamplingParams
from tests.test_model_parity import block_tables_for, make_runner, random_prompts
from tests.utils import tiny_model

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


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 37])
def test_graph_replay_matches_eager_decode_step(model_dir, num_seqs):
    from novainfer.worker.model_runner import SequenceInput

    runner = make_runner(model_dir, block_size=16, num_blocks=1024, device="cuda", dtype="float32",
                         attention_backend="triton")
    runner.capture_model(max_batch_size=64, max_num_tokens=4096)
    assert runner.graphs.padded_size(num_seqs) is not None
    prompts = _prompts(runner.model_config.vocab_size, num_seqs, seed=num_seqs)
    tables = block_tables_for([len(p) + 1 for p in prompts], runner.block_size)
    runner.forward([SequenceInput(p, 0, t, "none") for p, t in zip(prompts, tables)])
    decode = [SequenceInput([7], len(p), t, "last") for p, t in zip(prompts, tables)]
    with torch.inference_mode():
        graph_input = runner._load(runner._stage(*runner._flatten(decode)))
        assert graph_input.graph_size == runner.graphs.padded_size(num_seqs)
        graph_logits = runner._compute_logits(graph_input).float().clone()
        eager_logits = runner._compute_logits(runner.prepare_inputs(decode)).float()
    assert graph_logits.shape == eager_logits.shape == (num_seqs, runner.model_config.vocab_size)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=1e-4)


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
    runner = llm.llm_engine.executor.driver_worker.model_runner
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
