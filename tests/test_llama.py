"""LlamaForCausalLM against transformers (float32, CPU), on tiny random models that transformers
itself builds and saves: GQA, biases on attention and MLP, tied and untied embeddings, ``llama3``
and ``linear`` RoPE scaling, a head_dim other than hidden_size / heads; through the engine with
chunked prefill and prefix caching, and split over two ranks (``uni`` and ``mp``).
"""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.entrypoints.cli.main import main as cli_main
from novainfer.executor import WorkerError
from novainfer.layers.rotary_embedding import RopeScaling, rope_inv_freq
from novainfer.models.config_utils import get_rope_scaling, get_rope_theta
from tests.utils import hf_greedy, random_ids, transformers_llama

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
VARIANTS = {
    "gqa4-tied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "bias-untied": dict(attention_bias=True, mlp_bias=True),
    # Prompts run past original_max_position_embeddings (32); with head_dim 16 and base 1e4 the
    # wavelengths 6.3 (kept), 20 (interpolated) and 63+ (slowed) cover all three bands.
    "llama3": dict(rope_scaling=LLAMA3),
    "linear-head_dim32": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, head_dim=32),
}
# Everything at once, split over two ranks: biases on both row-parallel projections (o_proj,
# down_proj), which must be added once, not once per rank.
TP_VARIANT = dict(attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3, head_dim=32)
# Chunked prefill: the two longest prompts need several steps; they share a 12-token prefix.
ENGINE = dict(device="cpu", block_size=4, max_model_len=96, max_num_batched_tokens=24, num_gpu_blocks_override=160,
              max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def llama_prompts(model_dir) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shared = random_ids(7, 12, vocab)
    return [random_ids(1, 5, vocab), shared + random_ids(2, 38, vocab), random_ids(3, 19, vocab),
            shared + random_ids(4, 48, vocab)]


def engine_greedy(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(name):
    model_dir = transformers_llama(**VARIANTS[name])
    prompts = llama_prompts(model_dir)
    expected = [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(model_dir), **ENGINE)
    try:
        assert type(llm.llm_engine.engine_core.executor.driver_worker.model_runner.model).__name__ == "LlamaForCausalLM"
        assert tokens(engine_greedy(llm, prompts)) == expected
        # Again, now from the prefix cache: the same tokens from cached KV blocks.
        again = engine_greedy(llm, prompts)
        assert tokens(again) == expected
        assert all(out.num_cached_tokens > 0 for out in again[1:])
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_tensor_parallel_greedy_matches_transformers(backend):
    model_dir = transformers_llama(**TP_VARIANT)
    prompts = llama_prompts(model_dir)
    expected = [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend=backend, **ENGINE)
    try:
        assert tokens(engine_greedy(llm, prompts)) == expected
    finally:
        llm.llm_engine.shutdown()


def with_config(source, tmp_path, **overrides):
    """A copy of ``source`` whose config.json has ``overrides`` (None removes a key)."""
    target = tmp_path / "model"
    shutil.copytree(source, target)
    config = {**json.loads((target / "config.json").read_text()), **overrides}
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return target


def test_indivisible_heads_fail_at_start_up_naming_the_architecture(tmp_path):
    model = with_config(transformers_llama(**TP_VARIANT), tmp_path, num_key_value_heads=1, intermediate_size=90)
    with pytest.raises(WorkerError) as info:
        LLM(str(model), tensor_parallel_size=4, **ENGINE)
    message = str(info.value)
    for fragment in ("LlamaForCausalLM cannot be split over tensor_parallel_size=4", "num_key_value_heads=1",
                     "intermediate_size=90", "local_nkvh=0.25"):
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("rope", [
    # transformers 5 spelling, and the older one (a "type" key, rope_theta beside it).
    dict(rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
                          "rope_theta": 10000.0}),
    dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=10000.0),
])
def test_unsupported_rope_scaling_is_refused_naming_it(tmp_path, rope):
    model = with_config(transformers_llama(), tmp_path, **rope)
    rope_type = "yarn" if rope.get("rope_parameters") else "dynamic"
    with pytest.raises(WorkerError) as info:
        LLM(str(model), **ENGINE)
    assert info.value.method == "load_model" and isinstance(info.value.__cause__, NotImplementedError)
    message = str(info.value)
    assert f"rope_scaling type {rope_type!r} is not supported" in message, message
    assert "['default', 'linear', 'llama3']" in message, message


# The real Llama 3.1 RoPE settings, as config.json spells them.
LLAMA_31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}


@pytest.mark.parametrize("rope_scaling", [LLAMA_31_ROPE, {"type": "linear", "factor": 2.5}, None])
def test_inverse_frequencies_equal_transformers(rope_scaling):
    """Both config spellings (transformers 5's ``rope_parameters``; ``rope_theta`` and
    ``rope_scaling`` attributes of older versions) give transformers' own inverse frequencies."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072)
    config = LlamaConfig(rope_theta=500000.0, rope_scaling=dict(rope_scaling) if rope_scaling else None, **fields)
    old_style = SimpleNamespace(rope_theta=500000.0, rope_scaling=rope_scaling, **fields)
    scalings = {get_rope_scaling(config), get_rope_scaling(old_style)}
    assert len(scalings) == 1 and {get_rope_theta(config), get_rope_theta(old_style)} == {500000.0}
    ours = rope_inv_freq(128, 500000.0, scalings.pop())
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        assert attention_factor == 1.0  # cos and sin are not rescaled
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    if rope_type == "llama3":  # the highest frequencies are kept, the lowest slowed by the factor
        plain = rope_inv_freq(128, 500000.0)
        assert ours[0] == plain[0] and math.isclose(ours[-1], plain[-1] / 8, rel_tol=1e-6)


def test_bad_llama3_parameters_name_them():
    with pytest.raises(ValueError, match="low_freq_factor=4.0, high_freq_factor=4.0"):
        RopeScaling("llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    with pytest.raises(ValueError, match="needs a 'factor'"):
        get_rope_scaling(SimpleNamespace(rope_scaling={"rope_type": "linear"}, rope_theta=1e4))


def test_cli_tiny_llama_matches_transformers(tmp_path, capsys):
    """``novainfer tiny-model --arch llama``: a Llama that transformers loads, and that the engine
    runs to transformers' greedy tokens past its original (pre-scaling) context of 256."""
    assert cli_main(["tiny-model", "--arch", "llama", "--out", str(tmp_path / "llama")]) == 0
    model_dir = tmp_path / "llama"
    assert capsys.readouterr().out.strip() == str(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_scaling"]["rope_type"] == "llama3"
    prompts = [random_ids(30 + i, n, config["vocab_size"]) for i, n in enumerate((4, 23, 270))]
    expected = [hf_greedy(model_dir, p, 6) for p in prompts]
    llm = LLM(str(model_dir), device="cpu", block_size=16, max_model_len=288, max_num_batched_tokens=128,
              num_gpu_blocks_override=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert tokens(outputs) == expected
    finally:
        llm.llm_engine.shutdown()
