"""End-to-end correctness of the engine against transformers (the oracle).

Every request of a batch must produce, under greedy decoding, exactly the tokens that
transformers' ``generate`` produces for that prompt alone, whatever the engine does to run the
batch: chunked prefill under a tiny token budget, prefix caching, preemption and recomputation.
After every run the engine must hold nothing: no KV blocks, no requests.
"""

from __future__ import annotations

import functools
import random

import pytest

from novainfer import LLM, SamplingParams
from novainfer.core.sched.request import RequestStatus
from tests.utils import SMALL_KV, hf_greedy, random_ids

MAX_TOKENS = 16
# Prompt lengths of the batch: a one-token prompt, short ones, and ones spanning many blocks.
LENGTHS = (1, 5, 9, 14, 23, 31, 42)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(vocab_size):
    rng = random.Random(1234)
    batch = [random_ids(rng, n, vocab_size) for n in LENGTHS]
    # One more request shares its first 16 tokens (4 blocks of 4) with the longest prompt, so
    # that prefix caching finds something inside the batch too.
    batch.append(batch[-1][:16] + random_ids(rng, 7, vocab_size))
    return batch


@pytest.fixture(scope="module")
def reference(model_dir):
    """hf_greedy memoised per prompt: several configurations check the same prompts."""

    @functools.lru_cache(maxsize=None)
    def ref(prompt: tuple[int, ...], n: int = MAX_TOKENS) -> list[int]:
        return hf_greedy(model_dir, list(prompt), n)

    return lambda prompt, n=MAX_TOKENS: ref(tuple(prompt), n)


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks still held"
    assert kv.usage == 0.0
    sched = engine.engine_core.scheduler
    assert not sched.requests and not sched.running and not sched.waiting
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.output_processor.parents and not engine.output_processor.children


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_matches_reference(outputs, prompts, reference, max_tokens=MAX_TOKENS):
    assert len(outputs) == len(prompts)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out.finished
        assert out.prompt_token_ids == prompt
        assert len(out.outputs) == 1
        completion = out.outputs[0]
        expected = reference(prompt, max_tokens)
        assert completion.token_ids == expected, (
            f"request {i} (prompt of {len(prompt)} tokens) diverged from transformers at token "
            f"{first_difference(completion.token_ids, expected)}"
        )
        assert completion.finish_reason == "length"


# ---------------------------------------------------------------- batches vs the oracle

BATCH_CONFIGS = {
    "default": dict(kv_cache_memory_bytes=SMALL_KV),
    "chunked_prefill_budget_5": dict(block_size=4, max_num_batched_tokens=5, kv_cache_memory_bytes=SMALL_KV),
    "max_num_seqs_2": dict(block_size=4, max_num_seqs=2, kv_cache_memory_bytes=SMALL_KV),
    # 20 blocks of 4 tokens: the longest request (42 + 16 tokens) fits alone, the batch does not.
    "preemption": dict(block_size=4, num_gpu_blocks_override=20),
    "preemption_chunked_no_prefix_cache": dict(block_size=4, num_gpu_blocks_override=20,
                                               max_num_batched_tokens=7, enable_prefix_caching=False),
}
# The same with each step scheduled and launched before the previous one's tokens are fetched.
BATCH_CONFIGS.update({f"{name}_async": dict(config, async_scheduling=True) for name, config in list(BATCH_CONFIGS.items())
                      if name != "default"})


@pytest.mark.parametrize("config", list(BATCH_CONFIGS), ids=list(BATCH_CONFIGS))
def test_batch_matches_transformers(model_dir, prompts, reference, config):
    llm = LLM(str(model_dir), **BATCH_CONFIGS[config])
    outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, prompts, reference)
    stats = llm.llm_engine.get_stats()
    if config.startswith("preemption"):
        assert stats.num_preemptions_total > 0, "the KV cache was meant to be too small for the batch"
    assert stats.finished_requests_total["length"] == len(prompts)
    assert_no_leaks(llm)  # after preemption too
    # The engine serves a second batch just as well (blocks recycled, prefix cache warm).
    again = llm.generate(as_inputs(prompts[::-1]), GREEDY, use_tqdm=False)
    assert_matches_reference(again, prompts[::-1], reference)
    assert_no_leaks(llm)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prefix_caching_on_and_off(model_dir, prompts, reference, enable_prefix_caching):
    llm = LLM(str(model_dir), block_size=4, enable_prefix_caching=enable_prefix_caching,
              num_gpu_blocks_override=256)
    first = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False)
    assert_matches_reference(first, prompts, reference)
    assert_no_leaks(llm)
    # Every prompt again, after its blocks went back to the pool: with caching on, they are hits.
    second = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False)
    assert_matches_reference(second, prompts, reference)
    assert_no_leaks(llm)
    stats = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
    cached = [out.num_cached_tokens for out in second]
    if enable_prefix_caching:
        assert stats.hits > 0
        # A prompt of L tokens can reuse at most its full blocks before its last token.
        for prompt, num_cached in zip(prompts, cached):
            assert num_cached == (len(prompt) - 1) // 4 * 4
    else:
        assert stats.hits == 0
        assert cached == [0] * len(prompts)


def test_shared_prefix_is_reused_and_gives_the_same_output(model_dir, vocab_size, reference):
    rng = random.Random(99)
    prefix = random_ids(rng, 40, vocab_size)
    first = prefix + random_ids(rng, 3, vocab_size)
    second = prefix + random_ids(rng, 5, vocab_size)
    assert first[40:43] != second[40:43]

    llm = LLM(str(model_dir), block_size=4, enable_prefix_caching=True, num_gpu_blocks_override=64)
    out_first = llm.generate({"prompt_token_ids": first}, GREEDY, use_tqdm=False)[0]
    assert out_first.num_cached_tokens == 0  # nothing cached yet
    assert out_first.outputs[0].token_ids == reference(first)
    out_second = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    # 40 shared tokens are exactly 10 full blocks of 4.
    assert out_second.num_cached_tokens == 40
    assert out_second.outputs[0].token_ids == reference(second)
    assert_no_leaks(llm)

    uncached = LLM(str(model_dir), block_size=4, enable_prefix_caching=False, num_gpu_blocks_override=64)
    out_uncached = uncached.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    assert out_uncached.num_cached_tokens == 0
    assert out_uncached.outputs[0].token_ids == out_second.outputs[0].token_ids


# ---------------------------------------------------------------- abort


def test_abort_frees_everything_and_spares_the_others(model_dir, prompts, reference):
    llm = LLM(str(model_dir), block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
              num_gpu_blocks_override=128)
    engine = llm.llm_engine
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request("siblings", {"prompt_token_ids": prompts[3]},
                       SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True))
    for _ in range(3):
        for out in engine.step():
            assert not out.finished
    running = [rid for rid in ids if engine.engine_core.scheduler.requests[rid].status == RequestStatus.RUNNING]
    waiting = [rid for rid in ids if engine.engine_core.scheduler.requests[rid].status == RequestStatus.WAITING]
    assert running and waiting, "the test needs both running and waiting requests to abort"
    to_abort = [running[0], waiting[-1], "siblings"]
    aborted = engine.abort_request(to_abort)
    assert [out.request_id for out in aborted] == to_abort
    for out in aborted:
        assert out.finished
        assert all(c.finish_reason == "abort" for c in out.outputs)
    assert engine.abort_request(to_abort) == []  # aborting again is a no-op
    assert engine.abort_request(["no-such-request"]) == []

    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in to_abort, "an aborted request produced output"
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == sorted(set(ids) - set(to_abort))
    for rid, prompt in zip(ids, prompts):
        if rid in finished:
            assert finished[rid].outputs[0].token_ids == reference(prompt)
    assert engine.get_stats().finished_requests_total["abort"] == 4  # 2 requests + 2 siblings
    assert_no_leaks(llm)
    # The workers forget aborted requests too (told on the next step).
    runner = engine.engine_core.executor.driver_worker.model_runner
    assert not set(runner.requests) & {*to_abort, "0_siblings", "1_siblings"}


def test_closing_a_stream_early_aborts_its_requests(model_dir, prompts, reference):
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks_override=128)
    stream = llm.generate_stream(as_inputs(prompts[:4]), GREEDY)
    for _ in range(5):
        next(stream)
    assert llm.llm_engine.has_unfinished_requests()
    stream.close()
    assert_no_leaks(llm)
    out = llm.generate({"prompt_token_ids": prompts[4]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(prompts[4])
    assert_no_leaks(llm)


# ---------------------------------------------------------------- n > 1


def test_n_siblings_with_prefix_caching(model_dir, vocab_size):
    prompt = random_ids(5, 12, vocab_size)  # 3 full blocks of 4
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    llm = LLM(str(model_dir), block_size=4, enable_prefix_caching=True, num_gpu_blocks_override=64)
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out.finished and out.prompt_token_ids == prompt
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert all(0 <= t < vocab_size for t in c.token_ids)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "siblings must not share one random stream"
    # The siblings share the prompt's full blocks instead of computing them three times.
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_no_leaks(llm)

    # Same seeds without prefix caching: the same completions.
    plain = LLM(str(model_dir), block_size=4, enable_prefix_caching=False, num_gpu_blocks_override=64)
    [again] = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_greedy_siblings_sharing_blocks_match_transformers(model_dir, prompts, reference):
    prompt = prompts[4]  # 23 tokens: 5 full blocks shared by the siblings
    llm = LLM(str(model_dir), block_size=4, enable_prefix_caching=True, num_gpu_blocks_override=64)
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert c.token_ids == reference(prompt)
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_no_leaks(llm)
