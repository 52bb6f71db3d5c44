"""Batched description of one sampling step: one row per request, as device tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from novainfer.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Everything the Sampler needs for a [B, V] logits tensor.

    Built by :meth:`novainfer.sample.state.SamplingStateTable.gather` from the persistent
    per-request table: the tensors are gathered on the device, and the plain flags (which stages
    some row of the step uses) come from the table's host mirror, so building it never waits for
    the device.
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] float32; 1.0 for greedy rows (their random draw is discarded)
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor  # [B] int64 in [1, V]; "disabled" is stored as V
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    # Largest top_k of the random rows when every random row has one: sampling then only looks
    # at each row's top max_top_k candidates instead of sorting the vocabulary. None otherwise.
    max_top_k: int | None
    # Largest top_k among the random rows that have one; None when none has.
    largest_top_k: int | None
    # Counter-based noise keys (see novainfer.sample.rng) of this step's draw, [B] int64: a seeded
    # row's from its seed and output position, the others' fresh; None when every row is greedy.
    noise_keys: torch.Tensor | None
    is_seeded: torch.Tensor | None  # [B] bool; None when no random row is seeded
    all_random_seeded: bool  # every random row draws counter-based noise (no global draw needed)
    # [B] float32; None when no row of the step has that penalty (the stage is skipped).
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor  # [B] float32 (read only where seen_token_mask is set)
    no_penalties: bool
    # The sampling table's [table rows, V] int32 occurrences of each token in the output (None when
    # no row has a frequency or presence penalty) and bool mask of the tokens in the prompt or the
    # output (None when no row has a repetition penalty), whose row ``rows[b]`` is row b's: read in
    # place by the fused draw, gathered into [B, V] copies by :attr:`output_token_counts` and
    # :attr:`seen_token_mask` for the torch stages (at 1,024 rows of Qwen2's vocabulary the counts'
    # copy alone is 622 MB).
    counts_table: torch.Tensor | None
    seen_table: torch.Tensor | None
    # [B, V] bool: stop tokens forbidden because the row has produced fewer than min_tokens
    # tokens; None when no row of the step is below its min_tokens.
    min_tokens_mask: torch.Tensor | None
    # Largest `logprobs` asked for by any row; None when no row asks.
    max_num_logprobs: int | None
    # The table rows of the step (device, [B] int64): where its rows' counts and masks are.
    rows: torch.Tensor | None = None
    # The [B, V] copies gathered so far (by name); a copy may be changed in place (speculative
    # verification adds each position's preceding drafts to it) and is what every later reader sees.
    _gathered: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def output_token_counts(self) -> torch.Tensor | None:
        """[B, V] int32 occurrences of each token in row b's output; None without frequency or
        presence penalties."""
        return self._rows_of("counts_table")

    @property
    def seen_token_mask(self) -> torch.Tensor | None:
        """[B, V] bool: the token occurs in row b's prompt or output; None without repetition penalties."""
        return self._rows_of("seen_table")

    def _rows_of(self, name: str) -> torch.Tensor | None:
        table = getattr(self, name)
        if table is None:
            return None
        if name not in self._gathered:
            self._gathered[name] = table[self.rows]
        return self._gathered[name]

    def table_rows(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(``name``'s table or its gathered copy, the row of it that each step row reads): the
        table and :attr:`rows` until a copy was gathered, then the copy and None (row b is b's);
        (None, None) without the table."""
        table = getattr(self, name)
        if table is None or name in self._gathered:
            return self._gathered.get(name), None
        return table, self.rows

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        device: torch.device | str,
        vocab_size: int,
        num_output_tokens: list[int] | None = None,
    ) -> SamplingMetadata:
        """The metadata of one step of requests held nowhere else (tests, one-off batches): they
        are added to a fresh table, row i for list index i, and gathered.

        Token ids must be in [0, vocab_size). ``num_output_tokens`` is each row's output position
        (the number of tokens it generated before this one; default: the lengths of
        ``output_token_ids``): it keys the row's seeded noise and counts towards ``min_tokens``.
        """
        from novainfer.sample.state import SamplingStateTable

        batch_size = len(params)
        positions = [len(ids) for ids in output_token_ids] if num_output_tokens is None else num_output_tokens
        for name, values in (("output_token_ids", output_token_ids), ("prompt_token_ids", prompt_token_ids),
                             ("num_output_tokens", positions)):
            if len(values) != batch_size:
                raise ValueError(f"len({name}) must equal len(params) ({batch_size}), got {len(values)}")
        table = SamplingStateTable(vocab_size, torch.device(device))
        rows = list(range(batch_size))
        table.add_requests(rows, params, prompt_token_ids, output_token_ids)
        return table.gather(np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64))
