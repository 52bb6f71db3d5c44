"""Token embedding and LM head, optionally split over the vocabulary (seed 000, section 7.1.9).

The vocabulary is cut into ``tp_size`` contiguous ranges of ``ceil(V / tp_size)`` rows; the last
range is padded with zero rows. Embedding: each rank looks up the ids in its range, zeros the
rest, and an all-reduce sums the partial embeddings. LM head: each rank computes the logits of its
range and an all-gather concatenates them; greedy decoding needs less: each rank finds the best
token of its range and an all-gather of one (logit, id) pair per row picks the best of all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.distributed import ProcessGroup, get_tp_group
from novainfer.layers.sharding import WeightShardError

# Integers up to here are exact in float32 (greedy sends token ids in a float32 pair).
_EXACT_FLOAT32_IDS = 2 ** 24


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype | None = None,
                 tp_group: ProcessGroup | None = None, prefix: str = "") -> None:
        super().__init__()
        self.tp_group = tp_group if tp_group is not None else get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.world_size
        self.prefix = prefix
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        # Clamped: with a tiny vocabulary the last ranks' ranges can lie wholly past its end (then empty).
        self.vocab_start_index = min(self.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_name = f"{prefix}.weight"

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None,
                      weight_name: str | None = None) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise WeightShardError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {expected}",
                weight_name=weight_name or param.weight_name, global_shape=tuple(loaded_weight.shape),
                local_shape=tuple(param.shape), tp_size=self.tp_size, tp_rank=self.tp_rank)
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index:self.vocab_end_index])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        self.tp_group.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, per_partition={self.num_embeddings_per_partition}, "
                f"dim={self.embedding_dim}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> vocabulary logits. ``tie_weights`` shares the weight of an embedding (tied embeddings)."""

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie {self.prefix!r} {tuple(self.weight.shape)} to "
                             f"{embedding.prefix!r} {tuple(embedding.weight.shape)}")
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] over the whole vocabulary, on every rank."""
        return self.gather_logits(self.local_logits(hidden_states))

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [T, V / tp_size] of this rank's range (padding columns included); no collective."""
        return F.linear(hidden_states, self.weight)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Every rank's :meth:`local_logits` concatenated into [T, V] (one all-gather)."""
        if self.tp_size == 1:
            return local_logits
        gathered = torch.empty((self.tp_size, *local_logits.shape), dtype=local_logits.dtype,
                               device=local_logits.device)
        self.tp_group.all_gather(gathered.view(-1, local_logits.shape[-1]), local_logits.contiguous())
        # [tp, T, V/tp] -> [T, tp * V/tp], then drop the padding rows of the last range.
        return gathered.permute(1, 0, 2).reshape(local_logits.shape[0], -1)[:, :self.num_embeddings]

    def greedy_tokens(self, local_logits: torch.Tensor) -> torch.Tensor:
        """``gather_logits(local_logits).argmax(-1)`` (ties to the lowest id) without gathering the
        logits: each rank's best (logit, id) per row, gathered, and the best of those."""
        if self.tp_size == 1:
            return local_logits.argmax(dim=-1)
        if self.num_embeddings > _EXACT_FLOAT32_IDS:
            raise ValueError(f"greedy over a split vocabulary sends token ids as float32, exact below "
                             f"{_EXACT_FLOAT32_IDS}; {self.prefix!r} has {self.num_embeddings}")
        num_rows, width = local_logits.shape[0], self.vocab_end_index - self.vocab_start_index
        pairs = torch.empty(num_rows, 2, dtype=torch.float32, device=local_logits.device)
        if width == 0:  # a range wholly past the end of a tiny vocabulary
            pairs[:, 0], pairs[:, 1] = float("-inf"), 0.0
        else:
            own = local_logits[:, :width]
            best = own.argmax(dim=-1, keepdim=True)
            pairs[:, :1] = own.gather(-1, best)
            pairs[:, 1:] = best + self.vocab_start_index
        gathered = torch.empty(self.tp_size, num_rows, 2, dtype=torch.float32, device=local_logits.device)
        self.tp_group.all_gather(gathered.view(-1, 2), pairs)
        # argmax takes the first maximum: the lowest rank, whose range holds the lowest ids.
        best_rank = gathered[:, :, 0].argmax(dim=0, keepdim=True)
        return gathered[:, :, 1].gather(0, best_rank).squeeze(0).long()
