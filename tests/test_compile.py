"""torch.compile of the model forward (``compilation_level=1``) against the eager forward on CPU.

The compiled forward must give the same greedy tokens as the eager one through chunked prefill,
decodes and mixed steps (inductor reorders float32 arithmetic, so logits may differ in their last
bits but the argmax of a random tiny model's logits has a wide margin), compile once for every step
of two or more tokens, and write its artifacts to the NovaInfer cache directory.
"""

from __future__ import annotations

import logging

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.config import CacheConfig, ModelConfig
from novainfer.engine.arg_utils import EngineArgs
from novainfer.worker.model_runner import ModelRunner
from tests.test_model_parity import greedy_with_runner, random_prompts
from tests.utils import tiny_model

pytestmark = pytest.mark.slow


def make_runner(model_dir, compilation_level: int) -> ModelRunner:
    runner = ModelRunner(ModelConfig(str(model_dir), compilation_level=compilation_level), CacheConfig(block_size=4),
                         torch.device("cpu"))
    runner.load_model()
    runner.allocate_kv_cache(128)
    return runner


def test_compiled_forward_gives_the_eager_tokens(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOVAINFER_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    model_dir = tiny_model(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                           num_hidden_layers=2)
    eager, compiled = make_runner(model_dir, 0), make_runner(model_dir, 1)
    prompts = random_prompts(eager.model_config.vocab_size, [5, 11, 3], seed=3)
    expected = greedy_with_runner(eager, prompts, 6, chunk_size=4, stagger=1)
    with caplog.at_level(logging.INFO, logger="novainfer.models.compile"):
        got = greedy_with_runner(compiled, prompts, 6, chunk_size=4, stagger=1)
    assert got == expected
    forward = compiled.model.model.compiled_forward
    # Steps of 1 to 12 tokens ran: one graph for every size >= 2, one for single-token steps.
    assert forward.num_compilations == 2, [r.message for r in caplog.records]
    assert any("compiled the Qwen2ForCausalLM forward" in r.message for r in caplog.records)
    assert any(p.is_file() for p in (tmp_path / "torchinductor").rglob("*")), "nothing in the inductor cache"


def test_start_up_compiles_every_kind_of_step(tmp_path, monkeypatch):
    """An engine with compilation compiles its graphs while it starts (here on CPU, whose attention is
    the opaque op: one graph for single-token steps, one for the rest), so that a run's first steps of
    each kind compile nothing; its greedy tokens are the uncompiled engine's."""
    monkeypatch.setenv("NOVAINFER_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    model_dir = str(tiny_model(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                               num_hidden_layers=2))
    compiled = LLM(model=model_dir, device="cpu", compilation_level=1, max_num_batched_tokens=64)
    forward = compiled.llm_engine.engine_core.executor.driver_worker.model_runner.model.model.compiled_forward
    assert forward.num_compilations == 2
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts(200, [1, 9, 70, 33], seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [out.outputs[0].token_ids for out in compiled.generate(prompts, params)]
    assert forward.num_compilations == 2  # chunked prefill, mixed and decode steps: no new graph
    eager = LLM(model=model_dir, device="cpu", max_num_batched_tokens=64)
    assert got == [out.outputs[0].token_ids for out in eager.generate(prompts, params)]


def test_compilation_level_is_checked():
    with pytest.raises(ValueError, match="compilation_level"):
        ModelConfig(str(tiny_model()), compilation_level=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineArgs(model=str(tiny_model()), device="cpu", compilation_level=1,
                   tensor_parallel_size=2).create_engine_config()
