"""``LLM(..., multiprocess=True)``: the engine core in a process of its own under the offline API
gives the same outputs as the in-process engine, and its process ends with ``shutdown``."""

from __future__ import annotations

import pytest

from novainfer import LLM, SamplingParams
from tests.utils import tiny_model

KV_BYTES = 8 << 20


def test_multiprocess_llm_equals_in_process():
    prompts = ["Hello there", "A seeded sample", "Logprobs too"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    local = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES)
    try:
        expected = local.generate(prompts, params, use_tqdm=False)
    finally:
        local.shutdown()
    remote = LLM(str(tiny_model()), kv_cache_memory_bytes=KV_BYTES, multiprocess=True)
    core = remote.llm_engine.engine_core
    try:
        assert core.pid is not None and core.is_alive()
        got = remote.generate(prompts, params, use_tqdm=False)
        streamed = "".join(o.outputs[0].delta_text for o in remote.generate_stream(prompts[0], params[0]))
    finally:
        remote.shutdown()
    assert not core.is_alive()
    for g, e in zip(got, expected):
        assert [(c.text, c.token_ids, c.finish_reason) for c in g.outputs] == \
            [(c.text, c.token_ids, c.finish_reason) for c in e.outputs]
    # Equal up to float32 rounding: the core's process may batch and thread its matmuls differently.
    assert [lp[t].logprob for t, lp in zip(got[2].outputs[0].token_ids, got[2].outputs[0].logprobs)] == \
        pytest.approx([lp[t].logprob for t, lp in zip(expected[2].outputs[0].token_ids,
                                                        expected[2].outputs[0].logprobs)], abs=1e-4)
    assert streamed == expected[0].outputs[0].text
