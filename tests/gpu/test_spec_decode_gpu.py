"""Speculative decoding on the GPU: steps with drafts replay mixed-step CUDA graphs where they fit
one (eager otherwise), and greedy outputs equal those of plain decoding with async scheduling and
graphs (the GPU defaults), and transformers' for one request; with n-gram drafts and with a draft
model (whose steps replay graphs of its own). Drafts at every batch size (no
``disable_by_batch_size`` cut-off), so that large steps with drafts run too."""

from __future__ import annotations

import random

import pytest

from novainfer import LLM, SamplingParams
from tests.test_spec_decode_draft import truncated_copy
from tests.utils import hf_greedy, random_ids, tiny_model

pytestmark = pytest.mark.gpu

MAX_TOKENS = 64


def _prompts(vocab_size: int) -> list[list[int]]:
    """Prompts with repeated phrases and random ones, 96 in all (more logits rows than a mixed graph has
    when every request drafts 4: such steps run eagerly)."""
    rng = random.Random(3)
    prompts = []
    for i in range(96):
        phrase = random_ids(rng, 3 + i % 7, vocab_size)
        prompts.append(random_ids(rng, 5, vocab_size) + phrase * 3 if i % 2 else random_ids(rng, 5 + i, vocab_size))
    return prompts


@pytest.mark.parametrize("max_num_seqs", [8, 256])
def test_greedy_speculative_outputs_on_gpu_equal_plain_ones(max_num_seqs):
    model = tiny_model(std=0.1)
    prompts = _prompts(700)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(model), device="cuda", max_num_seqs=max_num_seqs).generate(inputs, params, use_tqdm=False)
    llm = LLM(str(model), device="cuda", max_num_seqs=max_num_seqs,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None})
    spec = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    assert spec[1].outputs[0].token_ids == hf_greedy(model, prompts[1], MAX_TOKENS, device="cuda")


@pytest.mark.parametrize("draft", ["itself", "first_layer"])
@pytest.mark.parametrize("max_num_seqs", [8, 256])
def test_greedy_draft_model_outputs_on_gpu_equal_plain_ones(max_num_seqs, draft):
    """The target drafting for itself has (nearly) every draft accepted: its draft cache must hold
    what the target's holds; only a near-tie that the draft's one-token steps and the target's
    verification steps (other kernels, other summation orders) break differently may be rejected.
    Its first layer alone has part of them accepted."""
    model = tiny_model(std=0.1)
    draft_dir = model if draft == "itself" else truncated_copy(model, 1)
    prompts = _prompts(700)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(model), device="cuda", max_num_seqs=max_num_seqs).generate(inputs, params, use_tqdm=False)
    llm = LLM(str(model), device="cuda", max_num_seqs=max_num_seqs,
              speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 4,
                                  "disable_by_batch_size": None})
    spec = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.get_stats()
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < drafted if draft == "first_layer" else 0 < accepted >= 0.99 * drafted
    assert llm.llm_engine.engine_core.executor.driver_worker.draft_runner.graphs, "the draft captured no graphs"
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_draft_model_with_async_scheduling_on_gpu_equals_plain_decoding():
    """With async scheduling, the steps above the cut-off are left in flight and the draft catches
    up from their tokens on the device; the rest verify drafts. The target drafting for itself keeps
    (nearly) every draft accepted, so the draft's cache stays that of the requests' tokens."""
    model = tiny_model(std=0.1)
    prompts = _prompts(700)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS - i % 48)
              for i in range(len(prompts))]  # requests end at different steps: the batch shrinks past the cut-off
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(model), device="cuda").generate(inputs, params, use_tqdm=False)
    llm = LLM(str(model), device="cuda", async_scheduling=True,
              speculative_config={"method": "draft_model", "model": str(model), "num_speculative_tokens": 4,
                                  "disable_by_batch_size": 16})
    spec = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.get_stats()
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert 0 < accepted >= 0.99 * drafted


def test_greedy_logprobs_and_penalties_with_speculation_on_gpu_equal_plain_ones():
    """Logprobs of accepted tokens and a frequency penalty that changes with every draft a position
    counts: the same tokens and logprobs (to float tolerance) as plain decoding with graphs."""
    model = tiny_model(std=0.1)
    inputs = [{"prompt_token_ids": p} for p in _prompts(700)[:32]]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, logprobs=3, frequency_penalty=0.1)
    plain = LLM(str(model), device="cuda").generate(inputs, params, use_tqdm=False)
    llm = LLM(str(model), device="cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                             "disable_by_batch_size": None})
    spec = llm.generate(inputs, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    for p, s in zip(plain, spec):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids
        for p_entries, s_entries in zip(p.outputs[0].logprobs, s.outputs[0].logprobs):
            assert set(s_entries) == set(p_entries)
            for token_id, entry in p_entries.items():
                assert s_entries[token_id].logprob == pytest.approx(entry.logprob, abs=1e-3)
