"""What a compiled forward receives for the Triton backend's traced attention
(``TritonAttentionBackend.traced_inputs``): the step's own metadata tensors, the kind of step, and
a split-K workspace whose split dimension is the number of splits the eager step would use
(``choose_num_splits``). The kernels themselves run on CUDA only (tests/gpu/test_compile_cuda.py);
the plan is host code, checked here on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from novainfer.attention.ops import choose_num_splits
from novainfer.attention.ops.common import num_sms
from novainfer.config import CacheConfig, ModelConfig
from novainfer.worker.model_runner import ModelRunner, SequenceInput
from tests.utils import tiny_model

pytest.importorskip("triton")
from novainfer.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    model_dir = tiny_model(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                           hidden_size=64, num_hidden_layers=2)
    runner = ModelRunner(ModelConfig(model_dir), CacheConfig(block_size=BLOCK), torch.device("cpu"),
                         attn_backend=TritonAttentionBackend())
    runner.load_model()
    runner.allocate_kv_cache(512)
    return runner


def traced_inputs(runner: ModelRunner, seqs: list[SequenceInput]):
    metadata = runner.prepare_inputs(seqs).metadata
    attn = runner.model.attention_layers()[0]
    return metadata, metadata.backend.traced_inputs(metadata, attn.num_heads, attn.k_cache)


def sequence(index: int, num_new: int, context: int) -> SequenceInput:
    blocks = -(-(context + num_new) // BLOCK)
    return SequenceInput([1 + index] * num_new, context, list(range(index * 64, index * 64 + blocks)), "last")


@pytest.mark.parametrize("context", [3, 200], ids=["short", "long"])
def test_a_decode_only_step_passes_its_tensors_and_the_eager_split_count(runner, context):
    metadata, inputs = traced_inputs(runner, [sequence(i, 1, context) for i in range(3)])
    assert inputs.decode_only and inputs.backend is metadata.backend
    for name in ("slot_mapping", "seq_lens", "block_tables", "query_start_loc"):
        assert getattr(inputs, name) is getattr(metadata, name), name
    splits = choose_num_splits(3, KV_HEADS, HEAD_DIM, context + 1, num_sms(torch.device("cpu")))
    assert inputs.split_lse.shape[2] == inputs.split_out.shape[2] == splits
    if splits > 1:  # the workspace the eager decode kernel would use: [B, Hq, S, Dpad] and [B, Hq, S]
        assert inputs.split_out.shape[:2] == inputs.split_lse.shape[:2] == (3, HEADS)
    assert (splits > 1) == (context == 200)


def test_a_step_with_prompt_tokens_is_not_decode_only(runner):
    _, mixed = traced_inputs(runner, [sequence(0, 5, 0), sequence(1, 1, 200)])
    assert not mixed.decode_only
    # The decodes' split count follows the decodes alone (one sequence of 201 tokens here).
    assert mixed.split_lse.shape[2] == choose_num_splits(1, KV_HEADS, HEAD_DIM, 201, num_sms(torch.device("cpu")))
    _, prefill = traced_inputs(runner, [sequence(0, 5, 0), sequence(1, 7, 0)])
    assert not prefill.decode_only and prefill.split_lse.shape[2] == 1
