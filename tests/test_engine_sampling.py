"""Sampling through the whole engine: seeded reproducibility, truncation to greedy, logprobs.

Greedy results and logprobs are checked against transformers (the oracle); seeded random
results are checked against the same request run alone.
"""

from __future__ import annotations

import functools

import pytest
import torch

from novainfer import LLM, SamplingParams
from tests.utils import SMALL_KV, hf_greedy, hf_logits, random_ids


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def llm(model_dir, request):
    """Each test runs with each step fetched before the next is scheduled, and pipelined."""
    return LLM(str(model_dir), block_size=4, kv_cache_memory_bytes=SMALL_KV, async_scheduling=request.param)


@pytest.fixture(scope="module")
def reference(model_dir):
    @functools.lru_cache(maxsize=None)
    def ref(prompt: tuple[int, ...], n: int) -> list[int]:
        return hf_greedy(model_dir, list(prompt), n)

    return lambda prompt, n: ref(tuple(prompt), n)


def token_ids(outputs) -> list[list[int]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert not engine.engine_core.scheduler.requests and not engine.has_unfinished_requests()


# ---------------------------------------------------------------- seeded sampling

SEEDED = {
    "plain": SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True),
    "truncated": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=99, max_tokens=16,
                                ignore_eos=True),
    "penalised": SamplingParams(temperature=1.2, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
                                repetition_penalty=1.2, max_tokens=16, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(SEEDED))
def test_seeded_sampling_does_not_depend_on_the_batch(model_dir, llm, vocab_size, name):
    params = SEEDED[name]
    target = {"prompt_token_ids": random_ids(10, 10, vocab_size)}
    alone = llm.generate(target, params, use_tqdm=False)
    assert len(alone[0].outputs[0].token_ids) == 16
    assert llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids == alone[0].outputs[0].token_ids

    others = [
        ({"prompt_token_ids": random_ids(11, 3, vocab_size)}, SamplingParams(temperature=1.0, max_tokens=20)),
        ({"prompt_token_ids": random_ids(12, 25, vocab_size)},
         SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
        ({"prompt_token_ids": random_ids(13, 17, vocab_size)},
         SamplingParams(temperature=0.9, seed=1234, max_tokens=12, ignore_eos=True)),  # same seed, other prompt
        ({"prompt_token_ids": random_ids(14, 6, vocab_size)},
         SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ]
    prompts = [p for p, _ in others[:2]] + [target] + [p for p, _ in others[2:]]
    params_list = [s for _, s in others[:2]] + [params] + [s for _, s in others[2:]]
    batched = llm.generate(prompts, params_list, use_tqdm=False)
    assert batched[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_no_leaks(llm)

    # Another engine: chunked prefill under a tiny budget and a cache small enough to preempt.
    small = LLM(str(model_dir), block_size=4, max_num_batched_tokens=6, num_gpu_blocks_override=16)
    squeezed = small.generate(prompts, params_list, use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions_total > 0
    assert squeezed[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    # Greedy neighbours are not disturbed by the random ones either.
    assert squeezed[1].outputs[0].token_ids == batched[1].outputs[0].token_ids
    assert squeezed[4].outputs[0].token_ids == batched[4].outputs[0].token_ids
    assert_no_leaks(small)


def test_unseeded_requests_differ_but_seeded_ones_repeat(llm, vocab_size):
    prompt = {"prompt_token_ids": random_ids(20, 8, vocab_size)}
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = token_ids(llm.generate([prompt] * 3, params, use_tqdm=False))
    assert len({tuple(r[0]) for r in runs}) > 1, "unseeded random sampling repeated itself three times"
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    runs = token_ids(llm.generate([prompt] * 3, seeded, use_tqdm=False))
    assert runs[0] == runs[1] == runs[2]


# ---------------------------------------------------------------- truncation to one token = greedy


def test_truncation_to_one_token_equals_greedy(llm, vocab_size, reference):
    prompts = [random_ids(30 + i, n, vocab_size) for i, n in enumerate((4, 13, 21, 7))]
    params = [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=1.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=2.0, top_k=1, seed=3, max_tokens=12, ignore_eos=True),
    ]
    # A plain random request shares the batch and must not disturb the others.
    inputs = [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[0]}]
    outputs = llm.generate(inputs, params + [SamplingParams(temperature=1.0, max_tokens=12)], use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == reference(prompt, 12)
    assert_no_leaks(llm)


# ---------------------------------------------------------------- logprobs


def check_logprobs(model_dir, prompt, completion, num_logprobs, greedy):
    ids = completion.token_ids
    assert completion.logprobs is not None and len(completion.logprobs) == len(ids)
    # transformers' log-softmax at the position that predicted each generated token.
    logits = hf_logits(model_dir, prompt + ids[:-1])[len(prompt) - 1:]
    expected = torch.log_softmax(logits.double(), dim=-1)
    total = 0.0
    for pos, (token, entry) in enumerate(zip(ids, completion.logprobs)):
        assert token in entry, f"position {pos}: the sampled token is missing from the logprobs"
        assert len(entry) <= num_logprobs + 1
        row = expected[pos]
        for tid, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[tid].item(), abs=1e-4), f"position {pos}, token {tid}"
        # Rank: 1 + the number of strictly more likely tokens (bracketed by the tolerance).
        value = row[token].item()
        assert 1 + int((row > value + 1e-4).sum()) <= entry[token].rank <= 1 + int((row > value - 1e-4).sum())
        if greedy:
            assert entry[token].rank == 1
        # The alternatives are transformers' top num_logprobs tokens.
        if num_logprobs:
            top_values, top_ids = row.topk(num_logprobs)
            kth = top_values[-1].item()
            for tid, top_value in zip(top_ids.tolist(), top_values.tolist()):
                if top_value > kth + 1e-4:
                    assert tid in entry, f"position {pos}: top token {tid} missing"
            assert all(row[tid].item() >= kth - 1e-4 for tid in entry if tid != token)
            assert len(entry) >= num_logprobs
        else:
            assert list(entry) == [token]
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("with_random", [True, False], ids=["beside-a-random-row", "greedy-rows-only"])
def test_logprobs_match_transformers(model_dir, llm, vocab_size, reference, with_random):
    """Beside a random row the step runs the sampler; with greedy rows only, the argmax and the
    logprobs come straight off the logits."""
    prompts = [random_ids(40 + i, n, vocab_size) for i, n in enumerate((9, 3, 17))]
    params = [
        SamplingParams(logprobs=3, temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),  # asks for none
        SamplingParams(logprobs=0, temperature=1.0, seed=8, max_tokens=10, ignore_eos=True),
    ][:3 if with_random else 2]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:len(params)]], params, use_tqdm=False)
    first, second = outputs[0].outputs[0], outputs[1].outputs[0]

    assert first.token_ids == reference(prompts[0], 10)
    check_logprobs(model_dir, prompts[0], first, 3, greedy=True)
    assert second.logprobs is None and second.cumulative_logprob is None
    assert second.token_ids == reference(prompts[1], 10)
    if with_random:
        # logprobs=0: only the sampled token (raw model distribution, even when sampling at temperature 1).
        third = outputs[2].outputs[0]
        check_logprobs(model_dir, prompts[2], third, 0, greedy=False)
        assert all(len(entry) == 1 for entry in third.logprobs)
    assert_no_leaks(llm)


def test_logprobs_with_chunked_prefill_and_many_alternatives(model_dir, vocab_size):
    prompt = random_ids(50, 19, vocab_size)
    small = LLM(str(model_dir), block_size=4, max_num_batched_tokens=5, num_gpu_blocks_override=32)
    [out] = small.generate({"prompt_token_ids": prompt},
                           SamplingParams(logprobs=20, temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    check_logprobs(model_dir, prompt, out.outputs[0], 20, greedy=True)


# ---------------------------------------------------------------- penalties against a reference


def reference_penalized_greedy(model_dir, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """transformers' logits at each step, penalized by a plain loop over the prompt and every
    token generated so far, then argmax."""
    output: list[int] = []
    for _ in range(n):
        logits = hf_logits(model_dir, prompt + output)[-1].double()
        for token in set(prompt) | set(output):
            x = logits[token].item()
            logits[token] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        for token in set(output):
            logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
        output.append(int(logits.argmax()))
    return output


def test_greedy_penalties_match_a_reference_over_the_whole_history(model_dir, llm, vocab_size):
    """Penalty counts kept on the device (prompt at admission, outputs added after each sampled
    token, with steps pipelined) against the reference; chunked prefill and preemption too."""
    prompts = [random_ids(60 + i, n, vocab_size) for i, n in enumerate((7, 15, 4))]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.8, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=1.0,
                       max_tokens=14, ignore_eos=True),
    ]
    expected = [reference_penalized_greedy(model_dir, p, s, 14) for p, s in zip(prompts, params)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    assert token_ids(llm.generate(inputs, params, use_tqdm=False)) == [[e] for e in expected]
    small = LLM(str(model_dir), block_size=4, max_num_batched_tokens=5, num_gpu_blocks_override=10,
                async_scheduling=True)
    assert token_ids(small.generate(inputs, params, use_tqdm=False)) == [[e] for e in expected]
    assert small.llm_engine.get_stats().num_preemptions_total > 0
    assert_no_leaks(small)
