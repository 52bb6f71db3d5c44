"""A mock causal LM for engine tests: its next token is always ``(last token + 1) % vocab_size``.

It has the interface of a real model (a registry entry, one checkpoint tensor, an attention layer
that writes the paged KV cache) so that everything around the model can be tested with an
output anyone can predict, independently of the numerics of a real architecture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.attention import Attention, AttentionMetadata


class MockForCausalLM(nn.Module):
    packed_modules_mapping: dict = {}
    ignored_checkpoint_suffixes: tuple = ()
    head_size = 8

    def __init__(self, config, dtype: torch.dtype, vocab_parallel: bool = False) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        # The one weight: a scale for the logits, so the loader has something to check.
        self.logit_scale = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.logit_scale.weight_name = "logit_scale"
        self.attn = Attention(1, self.head_size, 1.0, 1, prefix="attn")
        self.tie_word_embeddings = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = torch.zeros(input_ids.shape[0], self.head_size, dtype=self.logit_scale.dtype, device=input_ids.device)
        attended = self.attn(qkv, qkv, qkv, metadata)  # exercises the KV cache path; contributes zero
        return input_ids.unsqueeze(-1).to(attended.dtype) + attended.sum(-1, keepdim=True) * 0

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        next_ids = (hidden_states[:, 0].round().long() + 1) % self.vocab_size
        return F.one_hot(next_ids, self.vocab_size).to(hidden_states.dtype) * 10 * self.logit_scale

    def attention_layers(self) -> list[Attention]:
        return [self.attn]
