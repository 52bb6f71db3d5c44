"""llama.cpp's context shift through core_api (kv_seq_rm of n_discard tokens after the first n_keep,
then kv_seq_add of the rest by -n_discard), against a fresh decode and transformers."""

from __future__ import annotations

import pytest
import torch

from novainfer.core_api import KvStatus, Model
from tests.core_api_utils import decode_seqs
from tests.utils import hf_logits, random_ids, tiny_model

ATOL = 1e-4


def fill(model: Model, seq: int, tokens: list[int]) -> None:
    code, _ = decode_seqs(model, {seq: tokens})
    assert code == 0, model.last_error


@pytest.mark.parametrize("n_keep,n_discard", [(4, 8), (0, 5)])
@pytest.mark.parametrize("attention", ["auto", "masked"])
def test_context_shift_equals_a_fresh_decode_of_the_kept_tokens(vocab_size, attention, n_keep, n_discard):
    """llama.cpp's context shift, exact on a one-layer model: there the kept tokens' cached K/V
    depend only on each token and its position. (In deeper layers they also carry what the tokens
    attended to, the discarded ones included, so a shifted cache only approximates a fresh one.)"""
    path = tiny_model(num_hidden_layers=1)
    model = Model.from_pretrained(path, device="cpu", n_ctx=64, n_seq_max=2, attention=attention)
    tokens = random_ids(19, 20, vocab_size)
    fill(model, 0, tokens)
    n = len(tokens)
    assert model.kv_seq_rm(0, n_keep, n_keep + n_discard) == KvStatus.OK
    assert model.kv_seq_add(0, n_keep + n_discard, n, -n_discard) == KvStatus.OK
    assert model.kv_seq_pos_max(0) == n - n_discard - 1
    assert decode_seqs(model, {0: [42]})[0] == 0
    shifted = model.get_logits_ith(0).clone()
    kept = tokens[:n_keep] + tokens[n_keep + n_discard:]
    fill(model, 1, kept + [42])  # a fresh decode of the kept tokens at their new positions
    torch.testing.assert_close(shifted, model.get_logits_ith(-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(shifted, hf_logits(path, kept + [42])[-1], atol=ATOL, rtol=0)
