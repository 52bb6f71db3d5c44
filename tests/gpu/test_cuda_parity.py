"""bfloat16 parity with transformers on CUDA, with the reference and the Triton attention backends.

bf16 tolerance: our logits may differ from transformers' bf16 logits, but must be about as close to
the float32 truth as transformers' own bf16 logits are (within 2x their error plus 0.05 absolute).
Greedy tokens must be equal until a near-tie: where they first differ, the two candidate tokens'
float32 logits must lie closer to each other than twice transformers' own bf16 logit error there
(a tie within the precision's noise).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_model_parity import block_tables_for, greedy_with_runner, make_runner, random_prompts
from tests.utils import hf_greedy, hf_logits, tiny_model

pytestmark = pytest.mark.gpu

CONFIGS = {
    "tiny": {},
    # The tiny Llama: llama3 RoPE scaling, head_dim 32 with hidden 64 and 4 heads; here with biases.
    "tiny-llama-bias": dict(arch="llama", attention_bias=True, mlp_bias=True),
    "ratio7-hd64": dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_size=896,
                        intermediate_size=4864, num_hidden_layers=4, tie_word_embeddings=True, std=0.05),
    "ratio6-hd128": dict(num_attention_heads=12, num_key_value_heads=2, head_dim=128, hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=4, tie_word_embeddings=False, std=0.05),
}


BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_logits_close_to_transformers(name, backend):
    model_dir = tiny_model(**CONFIGS[name])
    runner = make_runner(model_dir, block_size=16, num_blocks=64, device="cuda", dtype="bfloat16",
                         attention_backend=backend)
    prompts = random_prompts(runner.model_config.vocab_size, [5, 33, 120], seed=7)
    tables = block_tables_for([len(p) for p in prompts], runner.block_size)
    ours = runner.forward(_seqs(prompts, tables)).cpu()
    offset = 0
    for prompt in prompts:
        truth = hf_logits(model_dir, prompt, torch.float32, "cuda").cpu()
        theirs = hf_logits(model_dir, prompt, torch.bfloat16, "cuda").cpu()
        mine = ours[offset:offset + len(prompt)]
        offset += len(prompt)
        our_err = (mine - truth).abs().max().item()
        their_err = (theirs - truth).abs().max().item()
        print(f"{name} {backend} len={len(prompt)}: our bf16 err {our_err:.4f}, transformers bf16 err {their_err:.4f}")
        assert our_err <= 2 * their_err + 0.05


def _seqs(prompts, tables):
    from novainfer.worker.model_runner import SequenceInput

    return [SequenceInput(p, 0, t, "all") for p, t in zip(prompts, tables)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_greedy_equal_until_near_tie(name, backend):
    model_dir = tiny_model(**CONFIGS[name])
    runner = make_runner(model_dir, block_size=16, num_blocks=64, device="cuda", dtype="bfloat16",
                         attention_backend=backend)
    prompts = random_prompts(runner.model_config.vocab_size, [4, 17, 60], seed=8)
    ours = greedy_with_runner(runner, prompts, 32, chunk_size=25, stagger=1)
    for prompt, out in zip(prompts, ours):
        ref = hf_greedy(model_dir, prompt, 32, torch.bfloat16, "cuda")
        diverge = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        print(f"{name} {backend} prompt len {len(prompt)}: equal for {diverge if diverge is not None else 32}/32 tokens")
        if diverge is None:
            continue
        context = prompt + out[:diverge]
        truth = hf_logits(model_dir, context, torch.float32, "cuda")[-1]
        bf16_noise = (hf_logits(model_dir, context, torch.bfloat16, "cuda")[-1] - truth).abs().max().item()
        gap = abs(truth[out[diverge]] - truth[ref[diverge]]).item()
        print(f"  diverged at token {diverge}: float32 gap {gap:.4f}, transformers bf16 noise {bf16_noise:.4f}")
        assert gap < 2 * bf16_noise, f"diverged at token {diverge} with a float32 logit gap of {gap}"
