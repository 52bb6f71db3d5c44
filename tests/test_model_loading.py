"""Loading Hugging Face checkpoints: sharded files, bad checkpoints, architectures, dtypes, tied heads, EOS ids.

Checkpoints are random tiny Qwen2 models written by ``write_random_qwen2`` into temporary
directories and then edited with safetensors directly, the way a broken download would look.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from novainfer.config import CacheConfig, ModelConfig
from novainfer.layers.sharding import WeightShardError
from novainfer.model_loader import WeightLoadingError, load_model
from novainfer.models import ModelRegistry, UnsupportedArchitectureError
from novainfer.tiny_model import write_random_qwen2
from novainfer.worker.model_runner import ModelRunner, SequenceInput

PROMPTS = [[5, 17, 300, 2, 99, 250, 7], [42, 8]]  # ids below the tiny vocabulary (740)
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def tokenizer_source(tmp_path_factory) -> Path:
    """A directory with our tokenizer, trained once and copied into every checkpoint below."""
    return write_random_qwen2(tmp_path_factory.mktemp("tokenizer-source"))


@pytest.fixture
def write(tokenizer_source, tmp_path):
    """``write(name, **kwargs)``: a random Qwen2 checkpoint in ``tmp_path / name``."""
    def _write(name: str, **kwargs) -> Path:
        return write_random_qwen2(tmp_path / name, tokenizer_dir=tokenizer_source, **kwargs)
    return _write


def load(model_dir: Path, **model_config_kwargs):
    mc = ModelConfig(str(model_dir), **model_config_kwargs)
    return load_model(mc.model, mc.hf_config, mc.torch_dtype, torch.device("cpu"))


def logits_of(model_dir: Path, **model_config_kwargs) -> torch.Tensor:
    runner = ModelRunner(ModelConfig(str(model_dir), **model_config_kwargs), CacheConfig(block_size=4),
                         torch.device("cpu"))
    runner.load_model()
    runner.allocate_kv_cache(8)
    return runner.forward([SequenceInput(PROMPTS[0], 0, [0, 1], "all"), SequenceInput(PROMPTS[1], 0, [5], "all")])


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of the directory (read directly)."""
    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        part = load_file(str(path))
        assert not set(part) & set(state)
        state.update(part)
    return state


def rewrite_single_file(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def expected_parameters(state: dict[str, torch.Tensor], num_layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """What each of our parameters must hold, built by hand from the checkpoint names."""
    expected = {}
    for name, tensor in state.items():
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if any(f".{p}." in name for p in parts):
                break
        else:
            expected[name] = tensor
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for suffix in ("weight", "bias"):
            expected[f"{p}.self_attn.qkv_proj.{suffix}"] = torch.cat(
                [state[f"{p}.self_attn.{x}_proj.{suffix}"] for x in "qkv"])
        expected[f"{p}.mlp.gate_up_proj.weight"] = torch.cat(
            [state[f"{p}.mlp.gate_proj.weight"], state[f"{p}.mlp.up_proj.weight"]])
    if tied:
        expected["lm_head.weight"] = state["model.embed_tokens.weight"]
    return expected


# ---- (a) sharded checkpoints --------------------------------------------------------------------
def test_sharded_checkpoint_with_and_without_index_matches_single_file(write):
    single = write("single", seed=3, tie_word_embeddings=False)
    sharded = write("sharded", seed=3, tie_word_embeddings=False, num_shards=3)
    shard_files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shard_files) == 3
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shard_files

    # Every parameter holds exactly its checkpoint tensor(s).
    state = checkpoint(sharded)
    model = load(sharded)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = expected_parameters(state, model.config.num_hidden_layers, tied=False)
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name

    reference = logits_of(single)
    assert torch.equal(logits_of(sharded), reference)
    (sharded / "model.safetensors.index.json").unlink()
    assert torch.equal(logits_of(sharded), reference)
    assert reference.abs().max() > 0


def test_index_naming_a_missing_shard_file_is_an_error(write):
    sharded = write("sharded", num_shards=3)
    lost = sharded / "model-00002-of-00003.safetensors"
    lost_names = sorted(load_file(str(lost)))
    assert lost_names
    lost.unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        load(sharded)
    # Without the index, the two files left are loaded and every tensor of the lost one is named.
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(WeightLoadingError, match="missing") as exc:
        load(sharded)
    assert all(name in str(exc.value) for name in lost_names)


# ---- (b) bad checkpoints ------------------------------------------------------------------------
def test_missing_weight_is_named(write):
    model_dir = write("missing")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_single_file(model_dir, lambda state: state.pop(name))
    with pytest.raises(WeightLoadingError) as exc:
        load(model_dir)
    msg = str(exc.value)
    assert "missing" in msg and name in msg
    assert "unexpected" not in msg


def test_missing_bias_and_norm_are_named(write):
    model_dir = write("missing2")
    names = ["model.layers.0.self_attn.v_proj.bias", "model.norm.weight"]
    rewrite_single_file(model_dir, lambda state: [state.pop(n) for n in names])
    with pytest.raises(WeightLoadingError) as exc:
        load(model_dir)
    assert all(n in str(exc.value) for n in names)


def test_unexpected_weight_is_named(write):
    model_dir = write("unexpected")
    extra = "model.layers.0.mlp.extra_proj.weight"
    rewrite_single_file(model_dir, lambda state: state.update({extra: torch.zeros(3, 5), "vision.tower": torch.ones(2)}))
    with pytest.raises(WeightLoadingError) as exc:
        load(model_dir)
    msg = str(exc.value)
    assert "unexpected" in msg and extra in msg and "vision.tower" in msg
    assert "missing" not in msg


def test_derived_rotary_inv_freq_in_checkpoint_is_ignored(write):
    model_dir = write("inv-freq")
    reference = logits_of(model_dir)
    rewrite_single_file(model_dir, lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert torch.equal(logits_of(model_dir), reference)


def test_mis_shaped_k_proj_names_weight_and_both_shapes(write):
    model_dir = write("misshaped")  # hidden 64, 2 kv heads of 16: k_proj is (32, 64)
    rewrite_single_file(model_dir, lambda state: state.update({K_PROJ: torch.zeros(48, 64)}))
    with pytest.raises(WeightShardError) as exc:
        load(model_dir)
    msg = str(exc.value)
    assert K_PROJ in msg
    assert str((48, 64)) in msg and str((32, 64)) in msg


def test_mis_shaped_norm_names_weight_and_both_shapes(write):
    model_dir = write("misshaped-norm")
    name = "model.layers.1.post_attention_layernorm.weight"
    rewrite_single_file(model_dir, lambda state: state.update({name: torch.ones(65)}))
    with pytest.raises(WeightLoadingError) as exc:
        load(model_dir)
    msg = str(exc.value)
    assert name in msg and str((65,)) in msg and str((64,)) in msg


def test_mis_shaped_embedding_names_weight_and_both_shapes(write):
    model_dir = write("misshaped-embed")
    state = load_file(str(model_dir / "model.safetensors"))
    vocab = state["model.embed_tokens.weight"].shape[0]
    rewrite_single_file(model_dir, lambda s: s.update({"model.embed_tokens.weight": torch.zeros(vocab - 1, 64)}))
    with pytest.raises(WeightShardError) as exc:
        load(model_dir)
    msg = str(exc.value)
    assert "model.embed_tokens.weight" in msg
    assert str((vocab - 1, 64)) in msg and str((vocab, 64)) in msg


# ---- (c) architectures --------------------------------------------------------------------------
def test_unsupported_architecture_is_named_with_supported_list(write):
    model_dir = write("unsupported-arch")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    config_path.write_text(json.dumps(config))
    assert "Qwen2ForCausalLM" in ModelRegistry.get_supported_archs()
    with pytest.raises(UnsupportedArchitectureError) as exc:
        load(model_dir)
    msg = str(exc.value)
    assert "GPTBigCodeForCausalLM" in msg and "Qwen2ForCausalLM" in msg
    runner = ModelRunner(ModelConfig(str(model_dir)), CacheConfig(), torch.device("cpu"))
    with pytest.raises(UnsupportedArchitectureError, match="GPTBigCodeForCausalLM"):
        runner.load_model()


def test_first_supported_architecture_is_used(write):
    model_dir = write("multi-arch")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["SomethingElse", "Qwen2ForCausalLM"]
    config_path.write_text(json.dumps(config))
    assert type(load(model_dir)).__name__ == "Qwen2ForCausalLM"


# ---- (d) dtypes ---------------------------------------------------------------------------------
def test_dtype_from_config_and_overrides(write):
    model_dir = write("bf16", dtype="bfloat16")
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    state = checkpoint(model_dir)
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16

    for kwargs, dtype in (({}, torch.bfloat16), ({"dtype": "float16"}, torch.float16),
                          ({"dtype": "float32"}, torch.float32)):
        assert ModelConfig(str(model_dir), **kwargs).torch_dtype == dtype
        model = load(model_dir, **kwargs)
        params = dict(model.named_parameters())
        assert {p.dtype for p in params.values()} == {dtype}, kwargs
        # Values are the checkpoint's, converted to the wanted dtype.
        assert torch.equal(params["model.embed_tokens.weight"], state["model.embed_tokens.weight"].to(dtype))
        assert torch.equal(params["model.layers.1.self_attn.o_proj.weight"],
                           state["model.layers.1.self_attn.o_proj.weight"].to(dtype))

    logits = logits_of(model_dir)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # bfloat16 and float32 runs of the same (bf16-exact) weights agree to bfloat16 accuracy
    # (observed: max 3%, mean 0.4% of the largest logit).
    reference = logits_of(model_dir, dtype="float32")
    scale = reference.abs().max()
    assert (logits - reference).abs().max() <= 0.08 * scale
    assert (logits - reference).abs().mean() <= 0.01 * scale


def test_float32_checkpoint_with_bfloat16_override(write):
    model_dir = write("fp32")
    model = load(model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(str(model_dir), dtype="int8")


# ---- (e) tied and untied LM heads ---------------------------------------------------------------
def test_tied_lm_head_is_the_embedding(write):
    model_dir = write("tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in checkpoint(model_dir)
    model = load(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, checkpoint(model_dir)["model.embed_tokens.weight"])
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


def test_tied_checkpoint_that_also_stores_lm_head_loads(write):
    model_dir = write("tied-with-head", tie_word_embeddings=True)
    reference = logits_of(model_dir)
    embed = checkpoint(model_dir)["model.embed_tokens.weight"]
    rewrite_single_file(model_dir, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    model = load(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed)
    assert torch.equal(logits_of(model_dir), reference)


def test_untied_lm_head_is_its_own_tensor(write):
    model_dir = write("untied", tie_word_embeddings=False)
    state = checkpoint(model_dir)
    model = load(model_dir)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    rewrite_single_file(model_dir, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(WeightLoadingError, match="lm_head.weight"):
        load(model_dir)


# ---- (f) EOS ids --------------------------------------------------------------------------------
def test_generation_config_eos_token_ids(write):
    from tokenizers import Tokenizer

    model_dir = write("eos")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert im_end is not None and endoftext is not None and im_end != endoftext
    assert ModelConfig(str(model_dir)).generation_eos_token_ids() == [im_end, endoftext]

    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = 7
    gen_path.write_text(json.dumps(gen))
    assert ModelConfig(str(model_dir)).generation_eos_token_ids() == [7]

    # Without an EOS in generation_config.json (or without the file) the model config's is used.
    del gen["eos_token_id"]
    gen_path.write_text(json.dumps(gen))
    assert ModelConfig(str(model_dir)).generation_eos_token_ids() == [endoftext]
    gen_path.unlink()
    assert ModelConfig(str(model_dir)).generation_eos_token_ids() == [endoftext]


def test_edit_helpers_change_only_the_copy(write, tmp_path):
    """Sanity for the helpers above: edits go to the copy only."""
    model_dir = write("orig")
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    rewrite_single_file(copy, lambda s: s.pop(K_PROJ))
    assert K_PROJ in checkpoint(model_dir) and K_PROJ not in checkpoint(copy)
