"""core_api decode against transformers (float32, CPU): single- and multi-sequence batches, both
attention paths (paged through the engine's backend, and masked over cells), greedy parity.

Tolerance: 1e-4 absolute on logits of magnitude O(1)-O(10) (summation order only).
"""

from __future__ import annotations

import functools

import pytest
import torch

from novainfer.core_api import Batch, Model
from tests.core_api_utils import decode_seqs
from tests.utils import hf_greedy, hf_logits, random_ids, tiny_model

ATOL = 1e-4
PATHS = ["auto", "masked"]


@pytest.fixture(scope="module")
def path():
    return tiny_model()


@pytest.fixture(scope="module", params=PATHS)
def model(request, path):
    return Model.from_pretrained(path, device="cpu", n_ctx=256, n_seq_max=8, attention=request.param)


@pytest.fixture(autouse=True)
def _empty_cache(model):
    model.kv_clear()


def test_single_sequence_prompt_then_decode_with_get_one(model, path, vocab_size):
    prompt = random_ids(0, 9, vocab_size)
    assert model.decode(Batch.get_one(prompt)) == 0, model.last_error
    tokens = list(prompt)
    for _ in range(4):
        tokens.append(int(model.get_logits_ith(-1).argmax()))
        assert model.decode(Batch.get_one(tokens[-1:])) == 0, model.last_error
    assert model.kv_seq_pos_max(0) == len(tokens) - 1
    torch.testing.assert_close(model.get_logits_ith(-1), hf_logits(path, tokens)[-1], atol=ATOL, rtol=0)


def test_multi_sequence_batch_every_row_matches_each_sequence_alone(model, path, vocab_size):
    prompts = {0: random_ids(1, 7, vocab_size), 3: random_ids(2, 2, vocab_size), 5: random_ids(3, 11, vocab_size)}
    code, where = decode_seqs(model, prompts, logits="all")
    assert code == 0, model.last_error
    for seq, tokens in prompts.items():
        expected = hf_logits(path, tokens)
        got = torch.stack([model.get_logits_ith(i) for i in where[seq]])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_greedy_parity_in_mixed_batches(model, path, vocab_size):
    """Prompts of several lengths; sequence 2 joins while the others decode (prefill + decode in
    one batch), and its prompt is split over two batches. Next tokens equal transformers' greedy."""
    prompts = [random_ids(10 + i, n, vocab_size) for i, n in enumerate([5, 12, 8])]
    num_new = 6
    expected = [_hf_greedy(path, tuple(p), num_new) for p in prompts]
    outputs: list[list[int]] = [[], [], []]
    pending = {0: prompts[0], 1: prompts[1]}
    step = 0
    while any(len(o) < num_new for o in outputs):
        if step == 2:
            pending[2] = prompts[2][:3]
        if step == 3:
            pending[2] = prompts[2][3:]
        code, where = decode_seqs(model, pending)
        assert code == 0, model.last_error
        for seq in list(pending):
            finished_prompt = seq != 2 or step >= 3
            if finished_prompt and len(outputs[seq]) < num_new:
                outputs[seq].append(int(model.get_logits_ith(where[seq][-1]).argmax()))
        pending = {s: [o[-1]] for s, o in enumerate(outputs) if o and len(o) < num_new}
        step += 1
    assert outputs == expected


@functools.cache
def _hf_greedy(path, prompt: tuple[int, ...], num_new: int) -> list[int]:
    return hf_greedy(path, list(prompt), num_new)


def test_tokens_listed_in_any_order_across_sequences(model, path, vocab_size):
    """Batch order is free across sequences: sequence 1's tokens first, then 0's, then 1's again."""
    a, b = random_ids(20, 4, vocab_size), random_ids(21, 4, vocab_size)
    batch = Batch.init(8, 1)
    for i in range(2):
        batch.add(b[i], i, [1])
    for i in range(4):
        batch.add(a[i], i, [0], logits=i == 3)
    for i in range(2, 4):
        batch.add(b[i], i, [1], logits=i == 3)
    assert model.decode(batch) == 0, model.last_error
    torch.testing.assert_close(model.get_logits_ith(5), hf_logits(path, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.get_logits_ith(7), hf_logits(path, b)[-1], atol=ATOL, rtol=0)
