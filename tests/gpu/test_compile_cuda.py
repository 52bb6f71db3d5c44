"""torch.compile of the model forward (``compilation_level`` 1, and 2 with inductor's C++ wrapper) on
CUDA: the same greedy tokens as the eager forward in float32, for eager steps (chunked prefill, mixed
and decode steps, decodes with one and with several splits) and for steps replayed from CUDA graphs
captured over the compiled forward. The Triton backend's attention is traced into the compiled graph
(``novainfer::triton_attention``)."""

from __future__ import annotations

import pytest
import torch

from novainfer.config import CacheConfig, ModelConfig
from novainfer.worker.model_runner import ModelRunner
from tests.test_model_parity import greedy_with_runner, random_prompts
from tests.utils import tiny_model

pytestmark = pytest.mark.gpu

CONFIG = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_size=896, intermediate_size=4864,
              num_hidden_layers=4, tie_word_embeddings=True, std=0.05)


def make_runner(model_dir, compilation_level: int, capture: bool) -> ModelRunner:
    runner = ModelRunner(ModelConfig(str(model_dir), dtype="float32", compilation_level=compilation_level,
                                     max_cudagraph_capture_size=64),
                         CacheConfig(block_size=16), torch.device("cuda"))
    runner.load_model()
    runner.allocate_kv_cache(256)
    if capture:
        runner.capture_model(8, 64)
    return runner


@pytest.mark.parametrize("level", [1, 2], ids=["python-wrapper", "cpp-wrapper"])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "cuda-graphs"])
def test_compiled_forward_gives_the_eager_tokens_on_cuda(capture, level):
    model_dir = tiny_model(**CONFIG)
    eager = make_runner(model_dir, 0, False)
    # 130 tokens of context over 4 sequences: the decodes run in two splits (choose_num_splits).
    prompts = random_prompts(eager.model_config.vocab_size, [5, 70, 130, 17], seed=4)
    expected = greedy_with_runner(eager, prompts, 12, chunk_size=48, stagger=2)
    runner = make_runner(model_dir, level, False)
    traced = []  # whether each compiled call (captured ones included) took the traced attention's inputs
    forward = runner.model.model.compiled_forward
    runner.model.model.compiled_forward = lambda *args: traced.append(len(args) == 3) or forward(*args)
    if capture:
        runner.capture_model(8, 64)
    assert greedy_with_runner(runner, prompts, 12, chunk_size=48, stagger=2) == expected
    assert traced and all(traced), "the Triton attention was not traced into the compiled forward"
    # One graph per kind of step (decode-only or not, one split or several) and inductor's size
    # guards, fewer when an earlier test of this process compiled the same model structure.
    assert 1 <= forward.num_compilations <= 8
