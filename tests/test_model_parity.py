"""Our Qwen2 over the paged KV cache against transformers, float32 on CPU.

Tolerance: the truth is transformers in float64; our float32 logits may be off from it by at most a few
times what transformers' own float32 logits are off (float32 rounding, ~1e-5 of the logits' scale), which
only a different summation order can explain, never a wrong operation (those err by O(1)).
"""

from __future__ import annotations

import random

import pytest
import torch

from novainfer.config import CacheConfig, ModelConfig
from novainfer.worker.model_runner import ModelRunner, SequenceInput
from tests._tokenizers import QWEN2_TOKENIZER_DIR
from tests.utils import hf_greedy, hf_logits, qwen2_tokenizer_model, tiny_model

LOGITS_ATOL = 1e-4  # between two of our own float32 paths (graphs vs eager), which round alike
ROUNDING_FACTOR = 4
NUM_NEW_TOKENS = 32

CONFIGS = {
    # name: config overrides (heads / kv heads ratio, head_dim, tied or not)
    "ratio1-hd64-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64, hidden_size=64,
                             tie_word_embeddings=True),
    "ratio2-hd128-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, hidden_size=96,
                                tie_word_embeddings=False),
    "ratio7-hd64-untied": dict(num_attention_heads=7, num_key_value_heads=1, head_dim=64, hidden_size=112,
                               tie_word_embeddings=False, num_hidden_layers=3),
    "ratio7-hd128-tied": dict(num_attention_heads=14, num_key_value_heads=2, head_dim=128, hidden_size=128,
                              tie_word_embeddings=True),
}


def assert_matches_transformers(ours: torch.Tensor, model_dir, token_ids: list[int], rows=slice(None)) -> None:
    """``ours`` against transformers' float64 logits of ``token_ids`` (rows selected by ``rows``)."""
    truth = hf_logits(model_dir, token_ids, torch.float64)[rows]
    float32_error = (hf_logits(model_dir, token_ids)[rows].double() - truth).abs().max().item()
    error = (ours.double() - truth).abs().max().item()
    assert error <= ROUNDING_FACTOR * float32_error + 1e-6, \
        f"max |ours - float64 truth| = {error:.3g}; transformers in float32 is off by {float32_error:.3g}"


def make_runner(model_dir, block_size: int = 4, num_blocks: int = 256, device: str = "cpu",
                dtype: str = "auto", attention_backend: str | None = None) -> ModelRunner:
    runner = ModelRunner(ModelConfig(str(model_dir), dtype=dtype, attention_backend=attention_backend),
                         CacheConfig(block_size=block_size), torch.device(device))
    runner.load_model()
    runner.allocate_kv_cache(num_blocks)
    return runner


def block_tables_for(lengths: list[int], block_size: int) -> list[list[int]]:
    tables, next_block = [], 0
    for n in lengths:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy_with_runner(runner: ModelRunner, prompts: list[list[int]], max_new: int, *, chunk_size: int,
                       stagger: int) -> list[list[int]]:
    """Greedy decoding driven like a continuous-batching scheduler.

    Sequence i joins at step ``i * stagger``; its prompt is computed in chunks of ``chunk_size``
    tokens, so steps mix prefill chunks, chunk continuations over cached tokens, and decodes.
    """
    tables = block_tables_for([len(p) + max_new for p in prompts], runner.block_size)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < max_new for o in outputs):
        batch, owners = [], []
        for i in range(len(prompts)):
            if step < i * stagger or len(outputs[i]) >= max_new:
                continue
            new = tokens[i][computed[i]:computed[i] + chunk_size]
            finishes_prompt = computed[i] + len(new) == len(tokens[i])
            batch.append(SequenceInput(new, computed[i], tables[i], "last" if finishes_prompt else "none"))
            owners.append((i, len(new), finishes_prompt))
        if batch:
            logits = runner.forward(batch)
            row = 0
            for i, n, samples in owners:
                computed[i] += n
                if samples:
                    token = int(logits[row].argmax())
                    row += 1
                    tokens[i].append(token)
                    outputs[i].append(token)
        step += 1
    return outputs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_prefill_logits_match_transformers(name):
    model_dir = tiny_model(**CONFIGS[name])
    runner = make_runner(model_dir)
    prompts = random_prompts(runner.model_config.vocab_size, [1, 7, 16, 29], seed=1)
    tables = block_tables_for([len(p) for p in prompts], runner.block_size)
    logits = runner.forward([SequenceInput(p, 0, t, "all") for p, t in zip(prompts, tables)])
    offset = 0
    for prompt in prompts:
        assert_matches_transformers(logits[offset:offset + len(prompt)], model_dir, prompt)
        offset += len(prompt)
    assert offset == logits.shape[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_matches_transformers_generate(name):
    model_dir = tiny_model(**CONFIGS[name])
    runner = make_runner(model_dir)
    prompts = random_prompts(runner.model_config.vocab_size, [3, 11, 20, 6], seed=2)
    # All prompts prefilled in one step, then batched decodes.
    ours = greedy_with_runner(runner, prompts, NUM_NEW_TOKENS, chunk_size=10_000, stagger=0)
    for prompt, out in zip(prompts, ours):
        assert out == hf_greedy(model_dir, prompt, NUM_NEW_TOKENS)


def test_mixed_prefill_chunks_and_decodes_match_transformers():
    model_dir = tiny_model(**CONFIGS["ratio2-hd128-untied"])
    runner = make_runner(model_dir, block_size=8)
    prompts = random_prompts(runner.model_config.vocab_size, [23, 5, 17, 40, 9], seed=3)
    ours = greedy_with_runner(runner, prompts, NUM_NEW_TOKENS, chunk_size=6, stagger=3)
    for prompt, out in zip(prompts, ours):
        assert out == hf_greedy(model_dir, prompt, NUM_NEW_TOKENS)


def test_prefill_after_shared_cached_prefix_matches_transformers():
    """A second sequence reuses the first one's full KV blocks and computes only its suffix."""
    model_dir = tiny_model()
    runner = make_runner(model_dir, block_size=4)
    vocab = runner.model_config.vocab_size
    prefix = random_prompts(vocab, [12], seed=4)[0]
    first = prefix + [7, 8, 9]
    second = prefix + [100, 101, 102, 103, 104]
    runner.forward([SequenceInput(first, 0, [0, 1, 2, 3], "none")])
    # Blocks 0-2 hold the 12 shared tokens; the second sequence continues at position 12.
    logits = runner.forward([SequenceInput(second[12:], 12, [0, 1, 2, 10, 11], "all")])
    assert_matches_transformers(logits, model_dir, second, slice(12, None))


def test_logits_only_for_requested_rows():
    model_dir = tiny_model()
    runner = make_runner(model_dir)
    prompts = random_prompts(runner.model_config.vocab_size, [5, 9, 3], seed=5)
    tables = block_tables_for([len(p) for p in prompts], runner.block_size)
    logits = runner.forward([SequenceInput(prompts[0], 0, tables[0], "last"),
                             SequenceInput(prompts[1], 0, tables[1], "none"),
                             SequenceInput(prompts[2], 0, tables[2], "all")])
    assert logits.shape == (1 + 3, runner.model_config.vocab_size)
    assert_matches_transformers(logits[0], model_dir, prompts[0], -1)
    assert_matches_transformers(logits[1:], model_dir, prompts[2])


@pytest.mark.skipif(not QWEN2_TOKENIZER_DIR.is_dir(), reason="the shared Qwen2 tokenizer is not available")
def test_real_qwen2_tokenizer_with_chinese_prompts():
    from transformers import AutoTokenizer

    model_dir = qwen2_tokenizer_model(hidden_size=64, intermediate_size=128)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = ["你好，世界！今天天气很好。", "The capital of France is", "请用中文介绍一下大语言模型的推理过程。"]
    prompts = [tokenizer.encode(t) for t in texts]
    runner = make_runner(model_dir)
    tables = block_tables_for([len(p) for p in prompts], runner.block_size)
    logits = runner.forward([SequenceInput(p, 0, t, "all") for p, t in zip(prompts, tables)])
    offset = 0
    for prompt in prompts:
        assert_matches_transformers(logits[offset:offset + len(prompt)], model_dir, prompt)
        offset += len(prompt)
    ours = greedy_with_runner(runner, prompts, NUM_NEW_TOKENS, chunk_size=7, stagger=1)
    for prompt, out in zip(prompts, ours):
        assert out == hf_greedy(model_dir, prompt, NUM_NEW_TOKENS)
