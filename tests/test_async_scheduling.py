"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.

The oracle is the engine that fetches every step before scheduling the next (itself checked
against transformers elsewhere): seeded sampling does not depend on the batch or on the steps'
timing, so every request must get exactly the same tokens and logprobs either way.
"""

from __future__ import annotations

import random

import pytest

from novainfer import LLM, SamplingParams
from tests.utils import hf_greedy, random_ids

ENGINE = dict(block_size=4, num_gpu_blocks_override=48, max_num_batched_tokens=16, max_num_seqs=6)


@pytest.fixture(scope="module")
def engines(model_dir):
    sync, pipelined = (LLM(str(model_dir), async_scheduling=flag, **ENGINE) for flag in (False, True))
    yield sync, pipelined
    sync.llm_engine.shutdown()
    pipelined.llm_engine.shutdown()


def mixed_requests(vocab_size: int, penalties: bool) -> tuple[list[dict], list[SamplingParams]]:
    """Requests that use every sampling feature, some ending early on stop ids, with more requests
    than max_num_seqs and prompts longer than the token budget (chunked prefill)."""
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": random_ids(rng, n, vocab_size)} for n in (3, 21, 9, 40, 5, 14, 30, 2)]
    # Nine in ten tokens stop these requests: the output ends right after min_tokens, so a
    # min_tokens that counted a token in flight one step late would show.
    mostly_stops = [t for t in range(vocab_size) if t % 10]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, logprobs=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, min_tokens=7, max_tokens=16, stop_token_ids=mostly_stops),
        SamplingParams(temperature=0.8, min_p=0.05, seed=9, n=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=21, min_tokens=5, max_tokens=16, stop_token_ids=mostly_stops),
        SamplingParams(temperature=1.0, seed=8, max_tokens=16, stop_token_ids=list(range(1, vocab_size, 4))),
    ]
    if penalties:
        params[3] = SamplingParams(temperature=1.1, seed=5, presence_penalty=0.4, frequency_penalty=0.2,
                                   repetition_penalty=1.3, max_tokens=10, ignore_eos=True)
    return prompts, params


def completions(outputs, expected: bool = False) -> list[list[tuple]]:
    """Per request and completion: tokens, finish and stop reasons, logprob ids and values. The
    batch shape may change the values' last bits: ``expected`` compares them approximately."""
    result = []
    for out in outputs:
        rows = []
        for c in out.outputs:
            entries = c.logprobs or []
            values = [lp.logprob for e in entries for lp in e.values()]
            rows.append((c.token_ids, c.finish_reason, c.stop_reason, [list(e) for e in entries],
                         pytest.approx(values, abs=1e-4) if expected else values))
        result.append(rows)
    return result


@pytest.mark.parametrize("penalties", [False, True])
def test_every_sampling_feature_matches_the_synchronous_engine(engines, vocab_size, penalties):
    sync, pipelined = engines
    prompts, params = mixed_requests(vocab_size, penalties)
    expected = completions(sync.generate(prompts, params, use_tqdm=False), expected=True)
    lengths = [(len(expected[i][0][0]), p.min_tokens) for i, p in enumerate(params) if p.min_tokens]
    assert lengths and all(n <= m + 2 for n, m in lengths), f"meant to stop just after min_tokens: {lengths}"
    steps = []
    execute = pipelined.llm_engine.engine_core.executor.execute_model

    def recording(scheduler_output, pipelined=False):
        steps.append(pipelined)
        return execute(scheduler_output, pipelined)

    pipelined.llm_engine.engine_core.executor.execute_model = recording
    try:
        assert completions(pipelined.generate(prompts, params, use_tqdm=False)) == expected
    finally:
        del pipelined.llm_engine.engine_core.executor.execute_model
    # Every step is left in flight (penalties included: their counts are kept on the device),
    # except the last one.
    assert sum(steps) == len(steps) - 1, steps
    assert pipelined.llm_engine.engine_core.kv_cache_manager.usage == 0.0
    assert not pipelined.llm_engine.has_unfinished_requests()


def test_length_limits_end_requests_without_a_step_past_them(model_dir, vocab_size):
    """Once a request's last allowed token is in flight, the next step leaves it out: every
    request computes its prompt and its outputs but the last, and not one token more."""
    llm = LLM(str(model_dir), async_scheduling=True, max_model_len=24, **ENGINE)
    scheduled = {}
    execute = llm.llm_engine.engine_core.executor.execute_model

    def counting(scheduler_output, pipelined=False):
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            scheduled[rid] = scheduled.get(rid, 0) + n
        return execute(scheduler_output, pipelined)

    llm.llm_engine.engine_core.executor.execute_model = counting
    rng = random.Random(3)
    prompts = [random_ids(rng, n, vocab_size) for n in (20, 23, 6, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (64, 64, 3, 5)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs):
        [completion] = out.outputs
        assert completion.finish_reason == "length"
        assert completion.token_ids == hf_greedy(model_dir, prompt, min(p.max_tokens, 24 - len(prompt)))
        assert scheduled[out.request_id] == len(prompt) + len(completion.token_ids) - 1


def test_abort_and_reuse_of_an_id_while_its_step_is_in_flight(engines, model_dir, vocab_size):
    """A request aborted while a step that computes it is still running, then added again under
    the same id: the running step's token belongs to the old request and must not reach the new one."""
    _, llm = engines
    engine = llm.llm_engine
    rng = random.Random(5)
    old, new, other = (random_ids(rng, n, vocab_size) for n in (6, 11, 8))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    generated_before = engine.get_stats().generation_tokens_total  # (the engine is the module's)
    engine.add_request("other", {"prompt_token_ids": other}, greedy)
    engine.add_request("r", {"prompt_token_ids": old}, greedy)
    finished = {}
    for _ in range(3):
        for out in engine.step():
            assert out.request_id != "r" or not out.finished
    assert engine.engine_core._in_flight, "the test needs a step in flight"
    [aborted] = engine.abort_request("r")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    engine.add_request("r", {"prompt_token_ids": new}, greedy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {"r": hf_greedy(model_dir, new, 6), "other": hf_greedy(model_dir, other, 6)}
    assert engine.engine_core.kv_cache_manager.usage == 0.0 and not engine.engine_core._in_flight
    # Every token a request got is counted once, those of the step collected early for the new "r"
    # too (the old "r"'s token of that step went to no request).
    assert engine.get_stats().generation_tokens_total - generated_before == len(aborted.outputs[0].token_ids) + 12


# ---------------------------------------------------------------- each setting, under preemption

def _mostly_stops(vocab_size: int) -> list[int]:
    return [t for t in range(vocab_size) if t % 10]


SETTINGS = {
    "temperature_top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=20),
    "seed_whole_vocabulary": dict(temperature=1.0),
    "penalties": dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
    "min_p": dict(temperature=1.2, min_p=0.1),
    "min_tokens": dict(temperature=1.0, min_tokens=6),
    "logprobs": dict(temperature=1.0, top_k=30, logprobs=4),
}


@pytest.fixture(scope="module")
def squeezed(model_dir):
    """Pipelined, prompts chunked by a 6-token budget, and a KV cache of 64 tokens: preemption."""
    llm = LLM(str(model_dir), async_scheduling=True, block_size=4, max_num_batched_tokens=6,
              num_gpu_blocks_override=16)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_with_preemption_matches_the_synchronous_engine(engines, squeezed, vocab_size, name):
    """Seeded requests of one setting (plus two unseeded greedy neighbours) give the same tokens and
    logprobs on the synchronous engine and on a pipelined one that chunks prompts and preempts."""
    sync, _ = engines
    rng = random.Random(name)
    prompts = [{"prompt_token_ids": random_ids(rng, n, vocab_size)} for n in (5, 17, 9, 26, 12, 20)]
    extra = {"stop_token_ids": _mostly_stops(vocab_size)} if name == "min_tokens" else {"ignore_eos": True}
    params = [SamplingParams(seed=100 + i, max_tokens=12, **SETTINGS[name], **extra) for i in range(4)]
    params += [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 2
    expected = completions(sync.generate(prompts, params, use_tqdm=False), expected=True)
    before = squeezed.llm_engine.get_stats().num_preemptions_total
    assert completions(squeezed.generate(prompts, params, use_tqdm=False)) == expected
    assert squeezed.llm_engine.get_stats().num_preemptions_total > before, "the test needs preemption"
    if name == "min_tokens":
        assert all(len(e[0][0]) <= 8 for e in expected[:4]), "meant to stop just after min_tokens"
    assert squeezed.llm_engine.engine_core.kv_cache_manager.usage == 0.0
