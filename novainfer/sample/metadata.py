"""Batched description of one sampling step: one row per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from novainfer.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request.

    Create it once when the request arrives and pass the same object at every
    step: its state advances as the request samples, which is what makes a
    seeded request reproducible whatever else shares the batch. It must live
    on the device the logits are on.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingMetadata:
    """Everything the Sampler needs for a [B, V] logits tensor, as device tensors.

    The `no_*` / `all_*` flags let the sampler skip stages that no row uses.
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] float32, as requested (greedy rows hold ~0)
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor  # [B] int64 in [1, V]; "disabled" is stored as V
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    # Row index -> that row's own generator; only random (non-greedy) rows.
    generators: dict[int, torch.Generator]
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    no_penalties: bool
    # [B, V] int32 occurrences of each token in the output; None when no_penalties.
    output_token_counts: torch.Tensor | None
    # [B, V] bool, token occurs in the prompt; None when no row has repetition_penalty != 1.
    prompt_token_mask: torch.Tensor | None
    # (row indices, token ids) of stop tokens forbidden because the row has
    # produced fewer than min_tokens tokens; None when there are none.
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None
    # Largest `logprobs` asked for by any row; None when no row asks.
    max_num_logprobs: int | None

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        vocab_size: int,
        num_output_tokens: list[int] | None = None,
    ) -> SamplingMetadata:
        """Build the metadata for one step; list index i describes logits row i.

        Token ids must be in [0, vocab_size). A row whose params have a seed
        (and are not greedy) must come with its generator (see make_generator).
        ``num_output_tokens`` counts each row's generated tokens for ``min_tokens``
        (default: the lengths of ``output_token_ids``, which may lack a token
        still being sampled when no row has penalties).
        """
        batch_size = len(params)
        for name, values in (
            ("output_token_ids", output_token_ids),
            ("prompt_token_ids", prompt_token_ids),
            ("generators", generators),
            ("num_output_tokens", output_token_ids if num_output_tokens is None else num_output_tokens),
        ):
            if len(values) != batch_size:
                raise ValueError(
                    f"len({name}) must equal len(params) ({batch_size}), got {len(values)}"
                )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        greedy = [p.is_greedy for p in params]
        random_rows = [i for i in range(batch_size) if not greedy[i]]

        row_generators: dict[int, torch.Generator] = {}
        for i in random_rows:
            if generators[i] is not None:
                row_generators[i] = generators[i]
            elif params[i].seed is not None:
                raise ValueError(
                    f"generators[{i}] must be a torch.Generator because the request has "
                    f"seed={params[i].seed}, got None"
                )

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        no_penalties = all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            for p in params
        )
        output_token_counts = None
        prompt_token_mask = None
        if not no_penalties:
            output_token_counts = _token_counts(output_token_ids, vocab_size, device)
            if any(p.repetition_penalty != 1.0 for p in params):
                prompt_token_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0

        requested = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            vocab_size=vocab_size,
            temperature=floats([p.temperature for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=not random_rows,
            all_random=len(random_rows) == batch_size,
            top_k=torch.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                dtype=torch.int64,
                device=device,
            ),
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            # Only random rows matter: greedy rows never reach these stages.
            no_top_k=all(not 0 < params[i].top_k < vocab_size for i in random_rows),
            no_top_p=all(params[i].top_p >= 1.0 for i in random_rows),
            no_min_p=all(params[i].min_p <= 0.0 for i in random_rows),
            generators=row_generators,
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            no_penalties=no_penalties,
            output_token_counts=output_token_counts,
            prompt_token_mask=prompt_token_mask,
            min_tokens_block=_min_tokens_block(
                params,
                [len(ids) for ids in output_token_ids] if num_output_tokens is None else num_output_tokens,
                vocab_size,
                device,
            ),
            max_num_logprobs=max(requested) if requested else None,
        )


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] int32 count of each token id per row, built with one scatter_add."""
    batch_size = len(token_ids)
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad ragged rows with an extra, out-of-vocabulary column that is dropped afterwards.
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device).reshape(batch_size, max_len)
    counts = torch.zeros(batch_size, vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab_size]


def _min_tokens_block(
    params: list[SamplingParams],
    num_output_tokens: list[int],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, num_out) in enumerate(zip(params, num_output_tokens)):
        if num_out < p.min_tokens:
            # Ids beyond the logits width can never be sampled, so there is nothing to block.
            ids = sorted(t for t in p.all_stop_token_ids if t < vocab_size)
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )
