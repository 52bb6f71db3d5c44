"""Helpers of the core_api tests: filling batches, and transformers' logits at chosen positions."""

from __future__ import annotations

from pathlib import Path

import torch

from novainfer.core_api import Batch, Model
from tests.utils import hf_model


def decode_seqs(model: Model, seqs: dict[int, list[int]], start: dict[int, int] | None = None,
                logits: str = "last") -> tuple[int, dict[int, list[int]]]:
    """Decodes ``{seq: tokens}`` in one batch, tokens interleaved across sequences; positions from
    ``start`` (default: after what the sequence holds). ``logits``: "last" or "all" per sequence.
    Returns decode's code and each sequence's batch indices."""
    start = {s: (start or {}).get(s, model.kv_seq_pos_max(s) + 1) for s in seqs}
    batch = Batch.init(sum(len(t) for t in seqs.values()), 1)
    where: dict[int, list[int]] = {s: [] for s in seqs}
    for i in range(max(len(t) for t in seqs.values())):
        for s, tokens in seqs.items():
            if i < len(tokens):
                where[s].append(batch.n_tokens)
                batch.add(tokens[i], start[s] + i, [s], logits == "all" or i == len(tokens) - 1)
    return model.decode(batch), where


@torch.inference_mode()
def hf_logits_at(path: Path, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len, vocab] of one sequence whose tokens sit at ``positions``."""
    model = hf_model(path)
    # An explicit mask: without one, transformers reads a jump in position_ids as the start of
    # another packed sequence.
    out = model(torch.tensor([token_ids]), position_ids=torch.tensor([positions]),
                attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
    return out.logits[0].float()
