"""GGUF checkpoints: config, tokenizer and dequantized weights against transformers' GGUF loading.

transformers reads GGUF files on its own (``load_gguf_checkpoint``, ``from_pretrained(gguf_file=...)``),
which makes it the oracle: the tiny files are written here from random Hugging Face checkpoints the
way llama.cpp's converter writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from novainfer import LLM, SamplingParams
from novainfer.config import ModelConfig, preferred_dtype
from novainfer.model_loader import gguf as gguf_module
from novainfer.model_loader.gguf import GGUFError, iterate_gguf_weights, load_gguf_config
from novainfer.models.registry import ModelRegistry
from novainfer import tokenizer as tokenizer_module
from novainfer.tokenizer import get_tokenizer
from tests.gguf_utils import hf_state_dict, write_gguf, write_tiny_llama
from tests.utils import SMALL_KV, hf_greedy, random_ids, tiny_model

Q = gguf.GGMLQuantizationType
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints: Qwen2 (tied LM head, Q/K/V biases) and Llama (untied, no biases)."""
    qwen2 = tiny_model()
    return {"qwen2": qwen2, "llama": write_tiny_llama(tmp_path_factory.mktemp("llama"), qwen2),
            # Llama 3's RoPE scaling: with head_dim 16 and theta 1e4 the 8 frequencies fall in all
            # three bands (kept, blended, divided by the factor)
            "llama3": write_tiny_llama(tmp_path_factory.mktemp("llama3"), qwen2, rope_scaling=LLAMA3_ROPE,
                                       max_position_embeddings=4096)}


@pytest.fixture(scope="module")
def gguf_file(hf_dirs, tmp_path_factory):
    """``gguf_file(arch, qtype)``: the tiny checkpoint of ``arch`` as a GGUF file (written once)."""
    out = tmp_path_factory.mktemp("gguf")
    written: dict[tuple[str, Q], Path] = {}

    def make(arch: str, qtype: Q) -> Path:
        if (arch, qtype) not in written:
            written[arch, qtype] = write_gguf(hf_dirs[arch], out / f"{arch}-{qtype.name}.gguf", qtype)
        return written[arch, qtype]

    return make


def _transformers_tensors(path: Path, hf_dir: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantized (and, for llama, un-permuted) tensors of a GGUF file."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_config_from_metadata(hf_dirs, gguf_file, arch):
    path = gguf_file(arch, Q.Q8_0)
    ours = ModelConfig(str(path)).hf_config
    source = json.loads((hf_dirs[arch] / "config.json").read_text())
    theirs = load_gguf_checkpoint(str(path))["config"]
    assert ours.architectures == source["architectures"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert getattr(ours, key) == source[key] == theirs[key], key
    assert ours.head_dim == source["head_dim"]
    assert ours.rms_norm_eps == pytest.approx(source["rms_norm_eps"], rel=1e-6)
    assert ours.rms_norm_eps == theirs["rms_norm_eps"]
    assert ours.rope_parameters["rope_theta"] == theirs["rope_theta"] == 10000.0
    assert ours.eos_token_id == theirs["eos_token_id"]


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_keeps_a_float_files_type_and_picks_the_devices_for_a_quantized_one(gguf_file, monkeypatch,
                                                                                      native_bf16):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cpu = torch.device("cpu")
    assert preferred_dtype(cpu) == (torch.bfloat16 if native_bf16 else torch.float32)
    for qtype, own in ((Q.F32, torch.float32), (Q.F16, torch.float16), (Q.BF16, torch.bfloat16)):
        assert ModelConfig(str(gguf_file("qwen2", qtype)), device=cpu).torch_dtype == own, qtype.name
    for qtype in (Q.Q8_0, Q.Q4_1):
        path = str(gguf_file("qwen2", qtype))
        assert ModelConfig(path, device=cpu).torch_dtype == preferred_dtype(cpu), qtype.name
        assert ModelConfig(path, device=cpu, dtype="float32").torch_dtype == torch.float32  # asked: kept


def test_rope_scaling_metadata(hf_dirs, tmp_path):
    """llama.cpp's rope.scaling keys become the config's RoPE scaling (which the model then implements or refuses)."""
    def add_yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    config = ModelConfig(str(write_gguf(hf_dirs["llama"], tmp_path / "yarn.gguf", add_metadata=add_yarn))).hf_config
    assert config.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                      "rope_theta": 10000.0}


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_weights_match_transformers(hf_dirs, gguf_file, arch, qtype):
    path = gguf_file(arch, qtype)
    ours = dict(iterate_gguf_weights(path))
    theirs = _transformers_tensors(path, hf_dirs[arch])
    source = hf_state_dict(hf_dirs[arch])
    assert set(ours) == set(theirs) == set(source)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name
    if qtype == Q.F32:  # lossless: the converter's Q/K row order is exactly undone
        for name, tensor in ours.items():
            assert torch.equal(tensor, source[name]), name
    elif qtype in (Q.F16, Q.BF16):  # matrices rounded to the half type, 1-D tensors kept in float32
        half = torch.float16 if qtype == Q.F16 else torch.bfloat16
        for name, tensor in ours.items():
            expected = source[name] if tensor.ndim == 1 else source[name].to(half).float()
            assert torch.equal(tensor, expected), name


def test_tokenizer_and_chat_template_from_metadata(hf_dirs, gguf_file):
    ours = get_tokenizer(gguf_file("qwen2", Q.F32))
    reference = AutoTokenizer.from_pretrained(str(hf_dirs["qwen2"]))
    texts = ["Hello, world! How are you today?", "你好，世界！", "def f(x):\n    return x + 1",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert ours.eos_token_id == reference.eos_token_id


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_derived_config_is_kept_and_loads_as_derived(gguf_file, arch, tmp_path, monkeypatch):
    path = gguf_file(arch, Q.Q8_0)
    monkeypatch.setenv("NOVAINFER_CACHE", str(tmp_path / "cache"))
    derived = gguf_module.GGUFCheckpoint(path).hf_config()
    parses = []
    checkpoint = gguf_module.GGUFCheckpoint
    monkeypatch.setattr(gguf_module, "GGUFCheckpoint", lambda p: parses.append(p) or checkpoint(p))
    first, second = load_gguf_config(path), load_gguf_config(path)
    assert len(parses) == 1  # the second load reads the cache, not the file's metadata
    for config in (first, second):
        assert type(config) is type(derived) and config.to_dict() == derived.to_dict()


@pytest.mark.parametrize("qtype", [Q.F32, Q.BF16, Q.Q4_1], ids=["F32", "BF16", "Q4_1"])
def test_a_kept_tensor_index_loads_the_same_weights_without_parsing(gguf_file, qtype, tmp_path, monkeypatch):
    """The first load of a file's weights keeps where its tensors lie; the next maps them from there
    without parsing the metadata, and both give the weights the parsed file gives."""
    path = gguf_file("llama", qtype)
    monkeypatch.setenv("NOVAINFER_CACHE", str(tmp_path / "cache"))
    expected = {name: tensor for name, tensor in gguf_module._weights_of_index(
        path, gguf_module.GGUFCheckpoint(path).tensor_index())}
    parses = []
    checkpoint = gguf_module.GGUFCheckpoint
    monkeypatch.setattr(gguf_module, "GGUFCheckpoint", lambda p: parses.append(p) or checkpoint(p))
    for load in range(2):
        loaded = dict(iterate_gguf_weights(path))
        assert len(parses) == 1  # only the first load parsed the file
        assert loaded.keys() == expected.keys()
        for name, tensor in loaded.items():
            assert torch.equal(tensor, expected[name]), (load, name)


def test_a_converted_tokenizer_is_kept_and_loads_as_a_fresh_conversion(gguf_file, tmp_path, monkeypatch):
    """The first load converts the file's tokenizer and keeps it in the cache; later loads read it
    from there (no conversion) and give what a fresh conversion gives; a changed file is converted
    anew; without a writable cache the tokenizer is converted in place."""
    path = gguf_file("qwen2", Q.F32)
    monkeypatch.setenv("NOVAINFER_CACHE", str(tmp_path / "cache"))
    conversions = []
    convert = tokenizer_module._convert_gguf_tokenizer
    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", lambda p: conversions.append(p) or convert(p))
    first, second = get_tokenizer(path), get_tokenizer(path)
    assert len(conversions) == 1
    fresh = convert(path)
    texts = ["Hello, world!", "你好，世界！", "<|im_start|>user\nhi<|im_end|>", "  two  spaces\n\n"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    for tok in (first, second):
        for text in texts:
            ids = tok.encode(text)
            assert ids == fresh.encode(text) and tok.decode(ids) == fresh.decode(ids)
            assert tok.encode(text, add_special_tokens=False) == fresh.encode(text, add_special_tokens=False)
        assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        assert (tok.eos_token_id, tok.bos_token_id, tok.all_special_ids) == (fresh.eos_token_id, fresh.bos_token_id,
                                                                            fresh.all_special_ids)
    entries = list((tmp_path / "cache" / "gguf").iterdir())
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    get_tokenizer(path)
    assert len(conversions) == 2
    # The changed file's entry replaced the old one's.
    assert [e for e in (tmp_path / "cache" / "gguf").iterdir()] != entries
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NOVAINFER_CACHE", str(blocker / "cache"))  # under a file: cannot be created
    assert get_tokenizer(path).encode(texts[0]) == fresh.encode(texts[0]) and len(conversions) == 3


def _greedy_parity(path: Path, prompts: list[list[int]], max_tokens: int, reference: Path | None = None,
                   **engine_args) -> None:
    """The engine on the GGUF file against transformers on ``reference`` (default: the same file)."""
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(reference or path, prompt, max_tokens)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_parity_with_transformers_gguf(gguf_file, arch, qtype):
    architecture = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    if architecture not in ModelRegistry.get_supported_archs():
        pytest.skip(f"{architecture} is not a registered model")
    path = gguf_file(arch, qtype)
    _greedy_parity(path, [random_ids(seed, n, 740) for seed, n in ((0, 5), (1, 17))], max_tokens=8)


def test_llama3_rope_factors_become_the_configs_rope_scaling(hf_dirs, gguf_file):
    config = ModelConfig(str(gguf_file("llama3", Q.F32))).hf_config
    source = json.loads((hf_dirs["llama3"] / "config.json").read_text())
    source_rope = source.get("rope_scaling") or source["rope_parameters"]
    for key in LLAMA3_ROPE:
        assert config.rope_parameters[key] == source_rope[key] == LLAMA3_ROPE[key], key
    assert "rope_freqs.weight" not in dict(iterate_gguf_weights(gguf_file("llama3", Q.F32)))


def test_llama3_rope_scaling_greedy_matches_transformers_on_the_source_checkpoint(hf_dirs, gguf_file):
    """transformers ignores the file's RoPE factors, so the oracle is the Hugging Face checkpoint itself.

    The scaled frequencies turn by less than a radian over a short prompt; a long one makes them count."""
    if "LlamaForCausalLM" not in ModelRegistry.get_supported_archs():
        pytest.skip("LlamaForCausalLM is not a registered model")
    _greedy_parity(gguf_file("llama3", Q.F32), [random_ids(3, 2000, 740)], max_tokens=4,
                   reference=hf_dirs["llama3"], max_model_len=2048)


def test_rope_factors_other_than_llama3s_are_refused(hf_dirs, tmp_path):
    factors = np.random.default_rng(0).uniform(1, 8, 8).astype(np.float32)
    path = write_gguf(hf_dirs["llama"], tmp_path / "rope.gguf", overrides={"rope_freqs.weight": (factors, Q.F32)})
    with pytest.raises(GGUFError, match=r"RoPE factors in rope_freqs\.weight do not follow Llama 3's scaling"):
        ModelConfig(str(path))


def test_tensor_parallel_ranks_shard_the_dequantized_weights(gguf_file):
    """Two ranks (threads) load the same file, each keeping its shard, vocabulary split too."""
    _greedy_parity(gguf_file("qwen2", Q.Q4_1), [random_ids(2, 9, 740)], max_tokens=6,
                   tensor_parallel_size=2, enable_vocab_parallel=True)


def test_text_generation_through_the_gguf_tokenizer(hf_dirs, gguf_file):
    """A text prompt is tokenized by the tokenizer from the file: same ids, same output as the HF directory."""
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    from_gguf = LLM(model=str(gguf_file("qwen2", Q.F32)), dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV)
    from_dir = LLM(model=str(hf_dirs["qwen2"]), dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV)
    prompt = "The quick brown fox"
    ours, reference = (llm.generate(prompt, sampling)[0] for llm in (from_gguf, from_dir))
    assert ours.prompt_token_ids == reference.prompt_token_ids
    assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
    assert ours.outputs[0].text == reference.outputs[0].text


def test_unsupported_architecture_is_named(hf_dirs, tmp_path):
    path = write_gguf(hf_dirs["qwen2"], tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(GGUFError, match=r"architecture 'phi3' is not supported.*\['llama', 'qwen2'\]"):
        ModelConfig(str(path))


def test_unsupported_tensor_type_is_named(hf_dirs, tmp_path):
    # Q8_1 is llama.cpp's intermediate type for activations: gguf.quants cannot dequantize it.
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1][1]
    packed = np.zeros((128, 64 // 32 * block_bytes), dtype=np.uint8)
    path = write_gguf(hf_dirs["qwen2"], tmp_path / "q8_1.gguf",
                      overrides={"blk.1.ffn_up.weight": (packed, Q.Q8_1)})
    with pytest.raises(GGUFError, match=r"Q8_1 \(1 tensors, e\.g\. blk\.1\.ffn_up\.weight\).*supported tensor types:"
                                        r" \[.*'Q4_0'.*'Q8_0'"):
        ModelConfig(str(path))


@pytest.mark.parametrize("name, message", [
    ("blk.0.attn_qkv.weight",
     r"GGUF tensor 'blk\.0\.attn_qkv\.weight' is not supported \(known tensors: .*'blk\.N\.attn_q'"),
    ("output_bias.weight", r"GGUF tensor 'output_bias\.weight' is not supported"),
])
def test_unknown_tensor_is_named(hf_dirs, tmp_path, name, message):
    path = write_gguf(hf_dirs["qwen2"], tmp_path / "extra.gguf",
                      overrides={name: (np.ones((8, 64), dtype=np.float32), Q.F32)})
    with pytest.raises(GGUFError, match=message):
        ModelConfig(str(path))


def test_missing_gguf_file(tmp_path):
    with pytest.raises(GGUFError, match="does not exist"):
        ModelConfig(str(tmp_path / "absent.gguf"))
