"""The architecture registry: Qwen2, Llama and the mock model load through the same engine path."""

from __future__ import annotations

import json

import pytest

from novainfer import LLM, SamplingParams
from novainfer.models import ModelRegistry, UnsupportedArchitectureError
from novainfer.tiny_model import write_mock_model


def test_registry_lists_qwen2_llama_and_mock():
    assert {"Qwen2ForCausalLM", "LlamaForCausalLM", "NovaInferMockForCausalLM"} <= set(
        ModelRegistry.get_supported_archs())


def test_mock_model_runs_through_the_engine(tmp_path):
    llm = LLM(str(write_mock_model(tmp_path)), block_size=4, num_gpu_blocks_override=32)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[5, 9, 100], [vocab - 2], [1, 2, 3, 4, 5, 6, 7]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = [(prompt[-1] + i) % vocab for i in range(1, 7)]
        assert out.outputs[0].token_ids == expected
    assert llm.llm_engine.engine_core.kv_cache_manager.num_free_blocks == llm.llm_engine.engine_core.kv_cache_manager.num_blocks


def test_unregistered_architecture_names_it_and_the_supported_ones(tmp_path):
    model_dir = write_mock_model(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as info:
        LLM(str(model_dir))
    message = str(info.value)
    assert "GPTBigCodeForCausalLM" in message and "Qwen2ForCausalLM" in message
    assert isinstance(info.value.__cause__ or info.value, UnsupportedArchitectureError)
