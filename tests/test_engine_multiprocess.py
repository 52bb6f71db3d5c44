"""``LLM(..., multiprocess=True)``: the engine core in a process of its own under the offline API
gives the same outputs as the in-process engine, and its process ends with ``shutdown`` or, for a
script that never calls it, when the script exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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


def test_script_without_shutdown_exits(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        from novainfer import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM({str(tiny_model())!r}, kv_cache_memory_bytes={KV_BYTES}, multiprocess=True)
            out = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
            print(llm.llm_engine.engine_core.pid, len(out[0].outputs[0].token_ids), flush=True)
    """))
    # Without the exit handler this never returns: multiprocessing waits for the core, the core for us.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    core_pid, num_tokens = map(int, done.stdout.split())
    assert num_tokens == 3
    with pytest.raises(ProcessLookupError):  # the core process is gone (and reaped) as well
        os.kill(core_pid, 0)
