"""ModelRunner: turns a step's sequences into flat tensors, runs the model, returns logits.

A step is a list of :class:`SequenceInput`: each sequence computes some new tokens on top of
``start_pos`` tokens whose K/V are already in the paged cache. All sequences are flattened into
one varlen batch (no padding to [B, T]); logits are computed only for the rows that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from novainfer.attention import AttentionBackend, AttentionMetadata, TorchReferenceBackend
from novainfer.config import CacheConfig, ModelConfig
from novainfer.core.sched.output import SchedulerOutput
from novainfer.model_loader import load_model
from novainfer.sample import Sampler, SamplingMetadata, make_generator
from novainfer.sampling_params import SamplingParams


@dataclass
class SequenceInput:
    """One sequence's part of a forward step."""

    token_ids: Sequence[int]  # the new tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: Sequence[int]  # KV blocks of the whole sequence, in order
    logits: Literal["none", "last", "all"] = "last"


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


@dataclass
class CachedRequestState:
    """What a worker remembers about a running request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests whose whole known sequence was computed."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Per sampled request, when it asked for logprobs: (token ids, logprobs, rank of the sampled
    # token); index 0 of the lists is the sampled token, then the top alternatives.
    logprobs: list[tuple[list[int], list[float], int] | None] | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
                 attn_backend: AttentionBackend | None = None) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device
        self.block_size = cache_config.block_size
        self.attn_backend = attn_backend or TorchReferenceBackend()
        self.model: torch.nn.Module | None = None
        self.num_blocks = 0
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Kept across preemption so that a seeded request resumes its random stream.
        self.generators: dict[str, torch.Generator] = {}

    # ---- set-up -----------------------------------------------------------------------------
    def load_model(self) -> None:
        mc = self.model_config
        self.model = load_model(mc.model, mc.hf_config, mc.torch_dtype, self.device)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of K and V for one block across every layer of this rank."""
        layers = self.model.attention_layers()
        per_token = sum(2 * layer.num_kv_heads * layer.head_size for layer in layers)
        return per_token * self.block_size * torch.empty(0, dtype=self.model_config.torch_dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        dtype = self.model_config.torch_dtype
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.num_blocks = num_blocks

    def release_kv_cache(self) -> None:
        """Drops the KV cache tensors (after a profiling run)."""
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.num_blocks = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- one step ---------------------------------------------------------------------------
    def prepare_inputs(self, seqs: Sequence[SequenceInput]) -> ModelInput:
        if not seqs:
            raise ValueError("a forward step needs at least one sequence")
        bs = self.block_size
        query_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        if (query_lens < 1).any():
            raise ValueError(f"every sequence must compute at least one token, got query lengths {query_lens.tolist()}")
        start_pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        seq_lens = start_pos + query_lens
        cu_lens = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_lens[1:])
        num_tokens = int(cu_lens[-1])

        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = np.zeros((len(seqs), max(max_blocks, 1)), dtype=np.int64)
        for i, s in enumerate(seqs):
            if len(s.block_table) * bs < seq_lens[i]:
                raise ValueError(f"sequence {i}: {len(s.block_table)} blocks of {bs} tokens cannot hold "
                                 f"{int(seq_lens[i])} tokens")
            block_tables[i, :len(s.block_table)] = s.block_table

        seq_index = np.repeat(np.arange(len(seqs)), query_lens)
        positions = np.arange(num_tokens) - cu_lens[:-1][seq_index] + start_pos[seq_index]
        slot_mapping = block_tables[seq_index, positions // bs] * bs + positions % bs
        input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=num_tokens)

        logits_rows = []
        for i, s in enumerate(seqs):
            if s.logits == "last":
                logits_rows.append(np.array([cu_lens[i + 1] - 1]))
            elif s.logits == "all":
                logits_rows.append(np.arange(cu_lens[i], cu_lens[i + 1]))
            elif s.logits != "none":
                raise ValueError(f"logits must be 'none', 'last' or 'all', got {s.logits!r}")
        logits_indices = np.concatenate(logits_rows) if logits_rows else np.zeros(0, dtype=np.int64)

        dev = self.device
        metadata = AttentionMetadata(
            num_tokens=num_tokens, num_seqs=len(seqs), block_size=bs,
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(cu_lens.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, backend=self.attn_backend)
        self.attn_backend.prepare(metadata)
        return ModelInput(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metadata,
                          torch.from_numpy(logits_indices).to(dev))

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:
        """Runs one step; returns float32 logits [rows requested, vocab] in input order."""
        model_input = self.prepare_inputs(seqs)
        hidden = self.model(model_input.input_ids, model_input.positions, model_input.metadata)
        return self.model.compute_logits(hidden[model_input.logits_indices]).float()

    # ---- engine steps ------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                list(new.output_token_ids), params, list(new.block_ids), new.num_computed_tokens)
            if params.seed is not None and not params.is_greedy and new.req_id not in self.generators:
                self.generators[new.req_id] = make_generator(params.seed, self.device)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        seqs, sampling = [], []
        for rid, num_tokens in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            start = state.num_computed_tokens
            samples = start + num_tokens == len(state.token_ids)
            seqs.append(SequenceInput(state.token_ids[start:start + num_tokens], start, state.block_ids,
                                      "last" if samples else "none"))
            state.num_computed_tokens += num_tokens
            if samples:
                sampling.append(state)
        logits = self.forward(seqs)
        if not sampling:
            return ModelRunnerOutput([], [])
        metadata = SamplingMetadata.from_requests(
            [s.sampling_params for s in sampling], [s.output_token_ids for s in sampling],
            [s.prompt_token_ids if s.sampling_params.repetition_penalty != 1.0 else [] for s in sampling],
            [self.generators.get(s.req_id) for s in sampling], self.device,
            self.model_config.vocab_size)
        out = self.sampler(logits, metadata)
        tokens = out.sampled_token_ids.tolist()  # the step's one device-to-host sync
        for state, token in zip(sampling, tokens):
            state.token_ids.append(token)
            state.output_token_ids.append(token)
        return ModelRunnerOutput([s.req_id for s in sampling], tokens, self._logprobs_lists(sampling, out))

    @staticmethod
    def _logprobs_lists(sampling: list[CachedRequestState], out) -> list | None:
        if out.logprobs is None:
            return None
        ids = out.logprobs.token_ids.tolist()
        values = out.logprobs.logprobs.tolist()
        ranks = out.logprobs.sampled_token_ranks.tolist()
        result = []
        for row, state in enumerate(sampling):
            k = state.sampling_params.logprobs
            result.append(None if k is None else (ids[row][:k + 1], values[row][:k + 1], ranks[row]))
        return result
