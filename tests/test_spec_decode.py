"""Speculative decoding (n-gram drafts) end to end: greedy outputs equal those without it, token for
token, whatever the engine does to run the batch; sampled outputs keep the target's distribution;
unsupported settings are refused by name.

The model is a tiny random one with small weights (std 0.1): its greedy continuations settle into
runs of one token, which n-gram lookup proposes, and leave them now and then, where drafts are
rejected; so both the accepting and the rejecting paths run (each test checks that they did).
"""

from __future__ import annotations

import functools
import json
import logging
import random
import re

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.sched.request import Request
from novainfer.core.sched.scheduler import Scheduler, SchedulerConfig
from novainfer.engine.arg_utils import EngineArgs
from novainfer.outputs import StepLogprobs
from novainfer.worker import model_runner
from novainfer.worker.model_runner import ModelRunner
from tests.test_spec_decode_parts import reference_ngram
from tests.test_step_graphs import emulated_graphs  # noqa: F401 (a fixture)
from tests.utils import SMALL_KV, hf_greedy, hf_logits, random_ids, tiny_model

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def spec_model_dir():
    return tiny_model(std=0.1)


@pytest.fixture(scope="module")
def prompts(vocab_size):
    """Prompts with repeated phrases (drafts from the prompt) and plain random ones."""
    rng = random.Random(7)
    batch = []
    for n in (3, 5, 8):
        phrase = random_ids(rng, n, vocab_size)
        batch.append(random_ids(rng, 4, vocab_size) + phrase * 3 + random_ids(rng, 2, vocab_size) + phrase[:2])
    batch += [random_ids(rng, n, vocab_size) for n in (1, 9, 23)]
    return batch


def generate(model_dir, prompts, params, speculative_config=None, **engine_args):
    llm = LLM(str(model_dir), speculative_config=speculative_config, **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks still held after the batch"
    return [o.outputs[0] for o in outputs], llm.llm_engine.get_stats()


@pytest.fixture(scope="module")
def plain_greedy(spec_model_dir, prompts):
    """Outputs without speculative decoding (the oracle of the greedy tests), per max_tokens."""

    @functools.lru_cache(maxsize=None)
    def run(max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        completions, _ = generate(spec_model_dir, prompts, params, kv_cache_memory_bytes=SMALL_KV)
        return [c.token_ids for c in completions]

    return run


def ngram(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **extra}


def assert_both_paths_ran(stats) -> None:
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < drafted, f"drafted {drafted}, accepted {accepted}: both paths should run"


CONFIGS = {
    "default": dict(kv_cache_memory_bytes=SMALL_KV),
    # A step of 5 tokens: prompts are chunked, and drafts that do not fit are dropped.
    "chunked_prefill_budget_5": dict(block_size=4, max_num_batched_tokens=5, kv_cache_memory_bytes=SMALL_KV),
    # 20 blocks of 4 tokens: the batch does not fit, requests are preempted and recomputed.
    "preemption": dict(block_size=4, num_gpu_blocks_override=20),
    "no_prefix_caching": dict(block_size=4, enable_prefix_caching=False, kv_cache_memory_bytes=SMALL_KV),
}
# n-gram drafts only (the draft model's proposals need each step's tokens): steps without drafts left
# in flight, the next step's drafts looked up one token early.
NGRAM_CONFIGS = {
    **CONFIGS,
    "async_scheduling": dict(async_scheduling=True, kv_cache_memory_bytes=SMALL_KV),
    "async_scheduling_preemption": dict(async_scheduling=True, block_size=4, num_gpu_blocks_override=20),
}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("config", list(NGRAM_CONFIGS))
def test_greedy_outputs_equal_those_without_speculation(spec_model_dir, prompts, plain_greedy, config, k):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    completions, stats = generate(spec_model_dir, prompts, params, ngram(k, prompt_lookup_max=3),
                                  **NGRAM_CONFIGS[config])
    assert [c.token_ids for c in completions] == plain_greedy()
    assert all(c.finish_reason == "length" for c in completions)
    assert_both_paths_ran(stats)
    if config == "preemption":
        assert stats.num_preemptions_total > 0
    assert stats.generation_tokens_total == len(prompts) * MAX_TOKENS  # each accepted token counted once


def test_greedy_matches_transformers(spec_model_dir, prompts):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    completions, stats = generate(spec_model_dir, prompts[:3], params, ngram(4), kv_cache_memory_bytes=SMALL_KV)
    for prompt, completion in zip(prompts[:3], completions):
        assert completion.token_ids == hf_greedy(spec_model_dir, prompt, 24)
    assert_both_paths_ran(stats)


def test_prefix_cache_hits_after_speculation_are_sound(spec_model_dir, prompts, plain_greedy):
    """Blocks cached by speculative requests (rejected drafts included at some point in their
    slots) serve later requests with the same prefix correctly."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    llm = LLM(str(spec_model_dir), speculative_config=ngram(3), block_size=4, kv_cache_memory_bytes=SMALL_KV)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(inputs, params, use_tqdm=False)
    # Prompts extended by their own outputs: their prefix is in the cache, computed speculatively.
    extended = [p + o.outputs[0].token_ids[:30] for p, o in zip(prompts, first)]
    second = llm.generate([{"prompt_token_ids": p} for p in extended], SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == plain_greedy()
    assert all(o.num_cached_tokens > 0 for o in second)
    for prompt, out in zip(extended[:3], second[:3]):
        assert out.outputs[0].token_ids == hf_greedy(spec_model_dir, prompt, 8)
    assert_both_paths_ran(llm.llm_engine.get_stats())


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_is_never_exceeded(spec_model_dir, prompts, plain_greedy, max_tokens, async_scheduling):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    completions, _ = generate(spec_model_dir, prompts, params, ngram(5), kv_cache_memory_bytes=SMALL_KV,
                              async_scheduling=async_scheduling)
    assert [c.token_ids for c in completions] == [t[:max_tokens] for t in plain_greedy()]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_token_ids_end_requests_as_without_speculation(spec_model_dir, prompts, plain_greedy, async_scheduling):
    """Each request stops at the first occurrence of a token from the middle of its plain output (a
    stop inside one step's accepted tokens is checked on the scheduler below)."""
    expected, per_request = [], []
    for tokens in plain_greedy():
        stop = tokens[len(tokens) // 2]
        end = tokens.index(stop) + 1
        expected.append(tokens[:end])
        per_request.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    completions, stats = generate(spec_model_dir, prompts, per_request, ngram(5), kv_cache_memory_bytes=SMALL_KV,
                                  async_scheduling=async_scheduling)
    assert [c.token_ids for c in completions] == expected
    assert all(c.finish_reason == "stop" for c in completions)
    assert stats.spec_decode_num_accepted_tokens_total > 0


def assert_stop_strings_end_requests_as_without_speculation(model_dir, prompts, speculative_config) -> None:
    """A stop string (the front-end's, on the text) inside a step's accepted tokens ends the request
    where it ends without speculation, text and tokens."""
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    plain = LLM(str(model_dir), kv_cache_memory_bytes=SMALL_KV).generate(
        inputs, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS), use_tqdm=False)
    texts = [o.outputs[0].text for o in plain]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS,
                             stop=[t[len(t) // 2:len(t) // 2 + 3]]) for t in texts]
    expected = LLM(str(model_dir), kv_cache_memory_bytes=SMALL_KV).generate(inputs, params, use_tqdm=False)
    got = LLM(str(model_dir), speculative_config=speculative_config, kv_cache_memory_bytes=SMALL_KV).generate(
        inputs, params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert (g.outputs[0].text, g.outputs[0].token_ids) == (e.outputs[0].text, e.outputs[0].token_ids)
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason == "stop"


def test_stop_strings_end_requests_as_without_speculation(spec_model_dir, prompts):
    assert_stop_strings_end_requests_as_without_speculation(spec_model_dir, prompts, ngram(5))


def test_scheduler_applies_accepted_tokens_one_by_one_and_takes_back_rejected_drafts():
    """A step that verified 4 drafts: the output stops at the stop token (the tokens after it are
    dropped); on a request that goes on, rejected drafts' positions count as uncomputed again."""
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256), kv)
    for rid in ("stops", "goes-on"):
        scheduler.add_request(Request(rid, [10, 11, 12, 13, 14], SamplingParams(max_tokens=20, stop_token_ids=[99]),
                                      max_tokens=20))
    scheduler.schedule()
    scheduler.update_from_output(["stops", "goes-on"], [[20], [20]])
    for rid in ("stops", "goes-on"):
        scheduler.requests[rid].spec_token_ids = [21, 99, 23, 24]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"stops": 5, "goes-on": 5}
    assert so.scheduled_spec_decode_tokens == {"stops": [21, 99, 23, 24], "goes-on": [21, 99, 23, 24]}
    going_on = scheduler.requests["goes-on"]
    block = StepLogprobs.of(1, [21, 99, 23, 30], [-0.5, -0.25, -1.0, -2.0], [1, 1, 1, 1])
    stopped, went_on = scheduler.update_from_output(["stops", "goes-on"], [[21, 99, 23, 30], [21, 30]], block,
                                                    [0, -1], num_verified_drafts=[4, 4])
    assert stopped.new_token_ids == [21, 99] and stopped.finish_reason == "stop" and stopped.stop_reason == 99
    # Its logprobs are the block's rows from 0, one per token it kept: none of the dropped tokens.
    assert stopped.new_logprobs == (block, 0) and went_on.new_logprobs is None
    assert went_on.new_token_ids == [21, 30] and went_on.finish_reason is None
    # Prompt 5 + 3 outputs known; the newest (30) is not computed yet, nor the rejected drafts.
    assert going_on.all_token_ids == [10, 11, 12, 13, 14, 20, 21, 30] and going_on.num_computed_tokens == 7
    assert kv._requests["goes-on"].num_tokens == 7
    assert scheduler.make_stats().spec_decode_num_draft_tokens == 8
    assert scheduler.make_stats().spec_decode_num_accepted_tokens == 3 + 1


def test_scheduler_takes_back_only_the_drafts_a_step_verified():
    """A step left in flight without drafts comes back after the next step's drafts were proposed:
    its one token is applied as is, and only the verifying step's output takes back rejected drafts."""
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, async_scheduling=True), kv)
    scheduler.add_request(Request("r", [10, 11, 12, 13, 14], SamplingParams(max_tokens=20), max_tokens=20))
    scheduler.schedule()  # the prompt, left in flight
    request = scheduler.requests["r"]
    request.spec_token_ids = [21, 22, 23]  # looked up while the first token was in flight
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 4} and so.scheduled_spec_decode_tokens == {"r": [21, 22, 23]}
    [first] = scheduler.update_from_output(["r"], [[20]])
    assert first.new_token_ids == [20] and request.num_computed_tokens == 9
    [verified] = scheduler.update_from_output(["r"], [[21, 30]], num_verified_drafts=[3])
    # Prompt 5 + 3 outputs known; the newest (30) is not computed yet, nor the two rejected drafts.
    assert verified.new_token_ids == [21, 30] and request.all_token_ids == [10, 11, 12, 13, 14, 20, 21, 30]
    assert request.num_computed_tokens == 7 and kv._requests["r"].num_tokens == 7
    assert scheduler.make_stats().spec_decode_num_draft_tokens == 3


def _exact_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target distribution of one position with temperature and top-k, computed here."""
    top = logits.topk(top_k)
    probs = torch.zeros_like(logits)
    probs[top.indices] = torch.softmax(top.values / temperature, dim=-1)
    return probs


def _prompt_with_an_uncertain_repeat(model_dir, vocab_size: int, temperature: float, top_k: int) -> list[int]:
    """A random prompt ending in three copies of its greedy next token, after which (one more copy
    in) repeating it once more has a probability between 0.2 and 0.8: n-gram lookup then drafts
    the repeat, and verification must accept it part of the time."""
    rng = random.Random(0)
    for _ in range(20):
        prompt = random_ids(rng, 8, vocab_size)
        repeated = int(hf_logits(model_dir, prompt)[-1].argmax())
        prompt += [repeated] * 3
        probs = _exact_probs(hf_logits(model_dir, prompt + [repeated])[-1], temperature, top_k)
        if 0.2 < float(probs[repeated]) < 0.8:
            return prompt
    raise AssertionError("no prompt of the kind found")


@pytest.mark.parametrize("method", ["ngram", "ngram_async_scheduling", "draft_model"])
def test_seeded_sampling_keeps_the_target_distribution(spec_model_dir, vocab_size, method):
    """Output tokens 2 and 3 of many seeded requests follow the joint distribution transformers
    gives, although a draft (the repeated token; with a draft model, the target's own greedy token)
    is verified for token 2 and accepted only part of the time: rejection sampling must neither
    favour nor disfavour drafts. With async scheduling the prefill is left in flight, so token 2's
    drafts are looked up before token 1 is known."""
    temperature, top_k, n = 0.05, 4, 2000
    prompt = _prompt_with_an_uncertain_repeat(spec_model_dir, vocab_size, temperature, top_k)
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=seed, max_tokens=3, ignore_eos=True)
              for seed in range(n)]
    spec = ngram(3) if method != "draft_model" else {"method": method, "model": str(spec_model_dir),
                                                     "num_speculative_tokens": 3}
    spec["disable_by_batch_size"] = None  # thousands of requests run together: draft for them all
    completions, stats = generate(spec_model_dir, [prompt] * n, params, spec, max_num_seqs=512,
                                  kv_cache_memory_bytes=SMALL_KV, async_scheduling=method == "ngram_async_scheduling")
    assert_both_paths_ran(stats)
    first = max({c.token_ids[0] for c in completions}, key=[c.token_ids[0] for c in completions].count)
    pairs = [tuple(c.token_ids[1:]) for c in completions if c.token_ids[0] == first]
    context = prompt + [first]
    p2 = _exact_probs(hf_logits(spec_model_dir, context)[-1], temperature, top_k)
    expected = {}
    for t2 in p2.nonzero().flatten().tolist():
        p3 = _exact_probs(hf_logits(spec_model_dir, context + [t2])[-1], temperature, top_k)
        for t3 in p3.nonzero().flatten().tolist():
            expected[(t2, t3)] = len(pairs) * float(p2[t2] * p3[t3])
    assert set(pairs) <= set(expected), "a token outside the top-k was sampled"
    # Pearson's chi-square over the cells expected at least 5 times, the rest pooled. The seeds are
    # fixed, so the outcome is too; the threshold (p < 1e-4) leaves room for any fair set of seeds
    # and still fails a biased verifier: always accepting the draft, for one, moves about half of
    # the mass of token 2 and gives a statistic in the hundreds.
    counts = {cell: pairs.count(cell) for cell in expected}
    big = [cell for cell in expected if expected[cell] >= 5]
    observed = [counts[c] for c in big] + [len(pairs) - sum(counts[c] for c in big)]
    wanted = [expected[c] for c in big] + [len(pairs) - sum(expected[c] for c in big)]
    if wanted[-1] < 1e-9:
        observed, wanted = observed[:-1], wanted[:-1]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    dof = len(wanted) - 1
    assert dof >= 1 and len(pairs) > n // 2
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    assert p_value > 1e-4, f"chi-square {statistic:.1f} with {dof} degrees of freedom (p={p_value:.2g})"


@pytest.mark.parametrize("config, key", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
])
def test_bad_speculative_config_names_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        EngineArgs(model="tiny", device="cpu", speculative_config=config).create_engine_config()


@pytest.mark.parametrize("disable_by_batch_size", [None, 2])
def test_steps_without_drafts_are_left_in_flight(monkeypatch, spec_model_dir, prompts, plain_greedy,
                                                 disable_by_batch_size):
    """With async scheduling, a step without drafts is left in flight as without speculation (every
    step while more requests run than ``disable_by_batch_size``), and the drafts of the step after
    it are looked up one token early, past the lookup's guess of the token in flight; a step with
    drafts runs alone. The requests end at different lengths, so every kind of step occurs, and
    the tokens are plain greedy."""
    from novainfer.engine.core import EngineCore
    from novainfer.spec_decode.ngram_proposer import NgramProposer

    decisions = []
    can_pipeline = EngineCore._can_pipeline
    monkeypatch.setattr(EngineCore, "_can_pipeline",
                        lambda self, so: decisions.append(can_pipeline(self, so)) or decisions[-1])
    drafted_ahead = []  # drafts looked up while their request's newest token was in flight
    propose = NgramProposer.propose

    def recording_propose(self, request_ids, token_lists, num_ahead=None):
        proposals = propose(self, request_ids, token_lists, num_ahead)
        drafted_ahead.extend(d for d, ahead in zip(proposals, num_ahead or ()) if ahead and d)
        return proposals

    monkeypatch.setattr(NgramProposer, "propose", recording_propose)
    lengths = [MAX_TOKENS - 4 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lengths]
    completions, stats = generate(spec_model_dir, prompts, params,
                                  ngram(3, disable_by_batch_size=disable_by_batch_size), async_scheduling=True,
                                  max_num_seqs=len(prompts), kv_cache_memory_bytes=SMALL_KV)
    assert [c.token_ids for c in completions] == [out[:n] for out, n in zip(plain_greedy(), lengths)]
    assert True in decisions and False in decisions
    assert drafted_ahead and stats.spec_decode_num_accepted_tokens_total > 0


def test_greedy_logprobs_equal_those_without_speculation(spec_model_dir, prompts):
    """Each token's logprob entries (its own, its rank, the top 3) come from the target's logits at
    its position, accepted draft or not: the same as without speculation, to float tolerance."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, logprobs=3)
    plain, _ = generate(spec_model_dir, prompts, params, kv_cache_memory_bytes=SMALL_KV)
    spec, stats = generate(spec_model_dir, prompts, params, ngram(4), kv_cache_memory_bytes=SMALL_KV)
    assert_both_paths_ran(stats)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and len(s.logprobs) == len(p.logprobs) == MAX_TOKENS
        for token, p_entries, s_entries in zip(p.token_ids, p.logprobs, s.logprobs):
            assert list(s_entries) == list(p_entries) and token in s_entries and len(s_entries) in (3, 4)
            for token_id, entry in p_entries.items():
                assert s_entries[token_id].rank == entry.rank
                assert s_entries[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert s.cumulative_logprob == pytest.approx(p.cumulative_logprob, abs=1e-3)


# Small enough that greedy outputs still repeat themselves (drafts get accepted); the frequency
# penalty changes with every draft a row counts, so a verifier that scored every draft with the
# counts of the step's start would give other tokens (the presence and repetition penalties of a
# draft copied from the request's own tokens rarely or never change; their per-row state is checked
# on its own in test_spec_decode_parts).
def test_sampled_logprobs_are_the_targets_at_each_position(spec_model_dir, prompts):
    """Seeded sampling (near-greedy, so that drafts get accepted) with speculation: each token's
    logprob is transformers' log-softmax at its position, and the top entries are its best tokens."""
    params = [SamplingParams(temperature=0.05, seed=seed, ignore_eos=True, max_tokens=16, logprobs=2)
              for seed in range(3)]
    completions, stats = generate(spec_model_dir, prompts[:3], params, ngram(3), kv_cache_memory_bytes=SMALL_KV)
    assert stats.spec_decode_num_accepted_tokens_total > 0
    for prompt, completion in zip(prompts[:3], completions):
        logits = hf_logits(spec_model_dir, prompt + completion.token_ids)
        want = logits[len(prompt) - 1:-1].float().log_softmax(dim=-1)
        for i, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert entries[token].logprob == pytest.approx(float(want[i, token]), abs=1e-4)
            top = want[i].topk(2).indices.tolist()
            assert set(top) <= set(entries) and entries[top[0]].rank == 1


PENALTIES = {
    "frequency": dict(frequency_penalty=0.1),
    "presence": dict(presence_penalty=0.3),
    "repetition": dict(repetition_penalty=1.2),
    "all": dict(frequency_penalty=0.05, presence_penalty=0.3, repetition_penalty=1.05),
}


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_greedy_with_penalties_equals_the_run_without_speculation(spec_model_dir, prompts, penalty):
    """A draft at position j is scored with the penalty state counting the drafts before it (the
    tokens it follows when it is used): greedy outputs stay those without speculation."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, **PENALTIES[penalty])
    plain, _ = generate(spec_model_dir, prompts, params, kv_cache_memory_bytes=SMALL_KV)
    spec, stats = generate(spec_model_dir, prompts, params, ngram(4), kv_cache_memory_bytes=SMALL_KV)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert_both_paths_ran(stats)


@pytest.mark.parametrize("max_extra_keys", [8192, 0])
def test_speculative_steps_replay_graphs(request, monkeypatch, spec_model_dir, prompts, plain_greedy,
                                         max_extra_keys):
    """With (CPU-emulated) CUDA graphs, steps with drafts replay a decode graph with a row per token
    (or, where the rows would re-read too much context, a mixed-step graph), and the tokens stay
    those of plain greedy decoding."""
    replayed = request.getfixturevalue("emulated_graphs")
    monkeypatch.setattr(model_runner, "DECODE_ROWS_MAX_EXTRA_KEYS", max_extra_keys)
    staged_kinds = []  # (several query tokens after context: a verification, the graph the step ran as)
    stage = ModelRunner._stage

    def recording(self, input_ids, query_lens, start_pos, *args, **kwargs):
        staged = stage(self, input_ids, query_lens, start_pos, *args, **kwargs)
        verifies = int(query_lens.max()) > 1 and bool((start_pos > 0).all())
        staged_kinds.append((verifies, staged.graph_key and staged.graph_key.kind))
        return staged

    monkeypatch.setattr(ModelRunner, "_stage", recording)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    completions, stats = generate(spec_model_dir, prompts, params, ngram(2), device="cpu", max_num_seqs=16,
                                  max_cudagraph_capture_size=64, kv_cache_memory_bytes=SMALL_KV)
    assert [c.token_ids for c in completions] == plain_greedy()
    assert_both_paths_ran(stats)
    assert (True, "decode" if max_extra_keys else "mixed") in staged_kinds and replayed


def test_disable_by_batch_size(spec_model_dir, prompts, plain_greedy):
    """Nothing is drafted while more requests run than ``disable_by_batch_size``."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    completions, stats = generate(spec_model_dir, prompts, params, ngram(3, disable_by_batch_size=1),
                                  max_num_seqs=len(prompts), kv_cache_memory_bytes=SMALL_KV)
    assert [c.token_ids for c in completions] == plain_greedy()
    # All requests run together to the end (same max_tokens): never one alone.
    assert stats.spec_decode_num_draft_tokens_total == 0
    _, alone = generate(spec_model_dir, prompts[:1], params, ngram(3, disable_by_batch_size=1),
                        kv_cache_memory_bytes=SMALL_KV)
    assert alone.spec_decode_num_draft_tokens_total > 0


# ---- metrics ---------------------------------------------------------------------------------------
def recount_speculation(prompts: list[list[int]], outputs: list[list[int]], k: int, max_n: int,
                        max_tokens: int) -> tuple[int, int, int, list[int]]:
    """(drafts, draft tokens, accepted tokens, accepted tokens per position) of a greedy run, replayed
    from its non-speculative outputs: after each step a request proposes what the reference n-gram
    search finds in its known tokens (cut to the tokens it may still emit after the next one), and
    accepts the drafts that agree with the output, up to the first that does not."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    for prompt, output in zip(prompts, outputs):
        known = 1  # the prefill step emits the first token
        while known < max_tokens:
            proposal = reference_ngram(prompt + output[:known], 1, max_n, k)[:max_tokens - known - 1]
            num_accepted = 0
            while num_accepted < len(proposal) and proposal[num_accepted] == output[known + num_accepted]:
                per_pos[num_accepted] += 1
                num_accepted += 1
            drafts += bool(proposal)
            draft_tokens += len(proposal)
            accepted += num_accepted
            known += num_accepted + 1
    return drafts, draft_tokens, accepted, per_pos


def test_speculation_counters_equal_a_recount_from_the_outputs(spec_model_dir, prompts, plain_greedy, caplog):
    k, max_n = 4, 3
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    with caplog.at_level(logging.INFO, logger="novainfer.engine.core"):
        completions, stats = generate(spec_model_dir, prompts, params, ngram(k, prompt_lookup_max=max_n),
                                      kv_cache_memory_bytes=SMALL_KV, log_stats_interval=0.0)
    assert [c.token_ids for c in completions] == plain_greedy()
    drafts, draft_tokens, accepted, per_pos = recount_speculation(prompts, plain_greedy(), k, max_n, MAX_TOKENS)
    assert 0 < accepted < draft_tokens and drafts > 0
    assert (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total,
            stats.spec_decode_num_accepted_tokens_per_pos_total) == (drafts, draft_tokens, accepted, per_pos)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculative decoding:")]
    assert lines, "no speculative decoding line in the step log"
    # log_stats_interval=0: each line covers the steps since the one before; together, the whole run.
    logged = [tuple(int(x) for x in re.search(r"drafts=(\d+) draft_tokens=(\d+) accepted_tokens=(\d+)", line).groups())
              for line in lines]
    assert tuple(map(sum, zip(*logged))) == (drafts, draft_tokens, accepted)
    rate, length = re.search(r"acceptance rate ([\d.]+)%, mean accepted length ([\d.]+)", lines[0]).groups()
    first_drafts, first_draft_tokens, first_accepted = logged[0]
    assert float(rate) == pytest.approx(100 * first_accepted / first_draft_tokens, abs=0.05)
    assert float(length) == pytest.approx(1 + first_accepted / first_drafts, abs=0.005)


def test_metrics_endpoint_exposes_the_speculation_counters(spec_model_dir, prompts):
    """/metrics of a server whose engine speculates, parsed with prometheus_client's parser, gives the
    engine's counters under vLLM's names (the counters themselves are checked against a recount above)."""
    import asyncio

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from novainfer.engine.async_llm_engine import AsyncLLMEngine
    from novainfer.entrypoints.openai.api_server import build_app
    from novainfer.entrypoints.openai.served_models import ModelRegistry

    k = 3
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(spec_model_dir), kv_cache_memory_bytes=SMALL_KV,
                                                        speculative_config=ngram(k)), name="m", multiprocess=False)
    app = build_app(registry=ModelRegistry.from_engines({"m": engine}))

    async def main() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            for prompt in prompts[:3]:
                response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                                      "temperature": 0, "ignore_eos": True})
                assert response.status_code == 200
            return (await client.get("/metrics")).text

    try:
        text = asyncio.run(main())
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("novainfer:spec_decode"):
                samples[(sample.name, sample.labels.get("position"))] = sample.value
    assert stats.spec_decode_num_accepted_tokens_total > 0
    expected = {(f"novainfer:spec_decode_{name}_total", None): getattr(stats, f"spec_decode_{name}_total")
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    expected |= {("novainfer:spec_decode_num_accepted_tokens_per_pos_total", str(i)): n
                 for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos_total)}
    assert len(stats.spec_decode_num_accepted_tokens_per_pos_total) == k
    assert samples == expected


def test_streamed_choices_of_an_n_request_equal_plain_greedy_text(spec_model_dir, prompts):
    """Served with speculation, a streamed completion with n=2 delivers each choice in deltas of
    possibly several tokens that concatenate to the text plain greedy decoding gives offline."""
    import asyncio

    import httpx

    from novainfer.engine.async_llm_engine import AsyncLLMEngine
    from novainfer.entrypoints.openai.api_server import build_app
    from novainfer.entrypoints.openai.served_models import ModelRegistry

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    plain, _ = generate(spec_model_dir, prompts[:3], params, kv_cache_memory_bytes=SMALL_KV)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(spec_model_dir), kv_cache_memory_bytes=SMALL_KV,
                                                        speculative_config=ngram(3)), name="m", multiprocess=False)
    app = build_app(registry=ModelRegistry.from_engines({"m": engine}))

    async def stream(client: httpx.AsyncClient, prompt: list[int]) -> dict[int, str]:
        texts: dict[int, str] = {}
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "n": 2,
                "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[len("data: "):])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        return texts

    async def main() -> list[dict[int, str]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts[:3]))

    try:
        streamed = asyncio.run(main())
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert streamed == [{0: c.text, 1: c.text} for c in plain]
    assert stats.spec_decode_num_accepted_tokens_total > 0
