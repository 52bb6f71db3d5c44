"""ModelRunner: turns a step's sequences into flat tensors, runs the model, samples.

A step is a set of sequences, each computing some new tokens on top of ``start_pos`` tokens
whose K/V are already in the paged cache. All sequences are flattened into one varlen batch
(no padding to [B, T]); logits are computed only for the rows that need them.

The hot path is lean: a step's integer inputs go to the device in one copy from a pinned
buffer (:mod:`novainfer.worker.input_buffers`), each running request keeps a row of a
persistent host block table that is only appended to, steps of up to
``max_cudagraph_capture_size`` tokens replay CUDA graphs (:mod:`novainfer.worker.cuda_graphs`), and
the sampled tokens go to the host in one asynchronous copy. A step may be launched before the host
has the previous step's tokens: its inputs then take them from the device (async scheduling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import logging

import numpy as np
import torch

from novainfer.attention import AttentionBackend, AttentionMetadata
from novainfer.attention.backends.selector import get_attn_backend
from novainfer.config import CacheConfig, ModelConfig
from novainfer.core.sched.output import DEVICE_DRAFT_TOKEN, SchedulerOutput
from novainfer.layers.vocab_parallel_embedding import ParallelLMHead
from novainfer.model_loader import load_model
from novainfer.models.compile import compile_model
from novainfer.outputs import StepLogprobs
from novainfer.sample import Sampler, SamplingStateTable
from novainfer.sample.metadata import SamplingMetadata
from novainfer.sample.rejection_sampler import (RejectionSamplerOutput, add_preceding_drafts, draft_rows,
                                                greedy_verify, greedy_verify_rows, rejection_sample)
from novainfer.sample.sampler import (LogprobsTensors, apply_min_tokens, apply_penalties, exponential_draws,
                                      gather_logprobs, greedy_with_logprobs, sampling_probs)
from novainfer.sample.state import copy_to_device
from novainfer.sampling_params import SamplingParams
from novainfer.worker.cuda_graphs import GraphKey, StepGraphs, cudagraph_capture_sizes
from novainfer.worker.input_buffers import BufferCapacity, LogitsShift, StepInputBuffers

logger = logging.getLogger(__name__)


@dataclass
class SequenceInput:
    """One sequence's part of a forward step."""

    token_ids: Sequence[int]  # the new tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: Sequence[int]  # KV blocks of the whole sequence, in order
    logits: Literal["none", "last", "all"] = "last"


@dataclass
class ModelInput:
    """A staged step: device views of its inputs, and how to run it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata | None  # None when the step replays a CUDA graph
    logits_indices: torch.Tensor
    num_seqs: int
    graph_key: GraphKey | None = None  # the graph to replay
    logits_are_all_rows: bool = False  # logits_indices == arange(num rows): no gather needed


@dataclass
class StagedStep:
    """A step written into a host staging buffer, before any device work.

    Any rank can run it: the driver rank of a ``uni`` executor stages each step once and every
    rank copies the same host bytes to its own device.
    """

    buffers: StepInputBuffers  # whose host side holds the step
    num_bytes: int  # the end of the buffer's part that the step uses
    block_table_shape: tuple[int, int]  # of the step's packed block tables (its real sequences')
    num_tokens: int
    num_seqs: int
    num_logits: int
    query_lens: np.ndarray
    seq_lens: np.ndarray
    graph_key: GraphKey | None  # the graph to replay
    logits_are_all_rows: bool
    # Whether the step ends in an argmax alone (its rows plain greedy, none asking for logprobs):
    # no sampler, and under a split LM head a gather of each rank's best token instead of the whole logits.
    greedy: bool = False
    # The previous step's sampled tokens (on the staging rank's device), when some inputs of this
    # step are among them: the buffer's ``token_sources`` region says which row each one takes.
    previous_tokens: torch.Tensor | None = None
    # Copies of ``previous_tokens`` on other ranks' devices (see :meth:`copy_previous_tokens`).
    previous_tokens_copies: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    # Moves the step's logits rows on the device (a draft's catch-up).
    logits_shift: LogitsShift | None = None

    def copy_previous_tokens(self, devices: Sequence[torch.device]) -> None:
        """Queues the copies of ``previous_tokens`` to other ranks' devices, from the staging rank's
        thread before it runs the step: a copy queued later, by another rank's thread, would wait
        on the staging device's stream behind the step's collectives, which wait for that rank."""
        if self.previous_tokens is not None:
            for device in devices:
                self.previous_tokens_copies[device] = self.previous_tokens.to(device, non_blocking=True)

    def previous_tokens_on(self, device: torch.device) -> torch.Tensor:
        if self.previous_tokens.device == device:
            return self.previous_tokens
        try:
            return self.previous_tokens_copies[device]
        except KeyError:
            raise RuntimeError(f"the step's previous tokens were not copied to {device}") from None


@dataclass
class CachedRequestState:
    """What a worker remembers about a running request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int
    row: int  # this request's row of the runner's persistent block table
    num_blocks: int = 0  # filled entries of that row
    # Greedy with nothing that needs the full sampler (penalties, logprobs): argmax is enough.
    plain_greedy: bool = False
    # Greedy without penalties but with logprobs: the argmax and the logprobs, both off the logits.
    greedy_with_logprobs: bool = False
    # Leading tokens whose K/V a draft model (speculative decoding) has computed in its own cache.
    num_draft_computed_tokens: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]


@dataclass
class SampledStep:
    """A launched step's sampled tokens: on the device, where the next step's inputs read them,
    and on their way to the host."""

    states: list[CachedRequestState]  # the requests that sampled, in row order
    device_tokens: torch.Tensor  # [len(states)] int64: each request's newest token
    # [len(states), P] int64: each request's new tokens (speculative decoding: the first
    # ``device_num_tokens`` of its row; the rest are -1); a draft model's catch-up reads them
    # before the host does.
    device_token_rows: torch.Tensor
    device_num_tokens: torch.Tensor | None  # [len(states)] int64, speculative decoding (else one each)
    rows: dict[str, int]  # req_id -> row
    # The step's results on the host, from one copy: the tokens [B]; with logprobs
    # LogprobsTensors.pack's [B, W] (W = 1 + 2 (n + 1)), whose column 1 holds the tokens; with
    # speculative decoding [B, 1 + P] (P = k + 1 positions): the number of tokens of each request,
    # then its tokens, and with logprobs P groups of W columns more, one per position.
    host_results: torch.Tensor
    has_logprobs: bool
    copied: torch.cuda.Event | None  # recorded after the copy to the host (CUDA only)
    num_positions: int = 1  # P
    num_drafts: list[int] | None = None  # speculative decoding: the drafts each request verified

    @property
    def speculative(self) -> bool:
        return self.num_drafts is not None

    @classmethod
    def start_copy(cls, states: list[CachedRequestState], tokens: torch.Tensor,
                   logprobs: LogprobsTensors | None, num_tokens: torch.Tensor | None = None,
                   num_drafts: list[int] | None = None) -> SampledStep:
        """Queues the copy of a step's tokens (and logprobs) to the host, without waiting.
        ``tokens`` is [B], or [B, P] with ``num_tokens`` [B] and ``num_drafts`` (speculative
        decoding: row b verified ``num_drafts[b]`` drafts and holds ``num_tokens[b]`` tokens;
        ``logprobs`` then has B * P rows, request-major)."""
        batch = tokens.shape[0]
        num_positions = 1 if num_tokens is None else tokens.shape[1]
        token_rows = tokens.unsqueeze(1) if num_tokens is None else tokens
        if num_tokens is None:
            # The packed logprobs hold the tokens already: copied as they are, without a cat.
            results = tokens if logprobs is None else logprobs.pack()
        else:
            parts = [num_tokens.unsqueeze(1), tokens] + ([] if logprobs is None else [logprobs.pack().view(batch, -1)])
            results = torch.cat(parts, dim=1)
            tokens = tokens.gather(1, (num_tokens - 1).unsqueeze(1)).squeeze(1)
        return cls._copied(states, tokens, token_rows, num_tokens, results, logprobs is not None, num_positions,
                           num_drafts)

    @classmethod
    def from_verified(cls, states: list[CachedRequestState], packed: torch.Tensor, last: torch.Tensor,
                      num_drafts: list[int]) -> SampledStep:
        """A greedy verification's step from what greedy_verify_rows returns: ``packed`` [B, 1 + P],
        laid out as a speculative step's host results, and each request's last token ``last`` [B]."""
        return cls._copied(states, last, packed[:, 1:], packed[:, 0], packed, False, packed.shape[1] - 1, num_drafts)

    @classmethod
    def _copied(cls, states: list[CachedRequestState], tokens: torch.Tensor, token_rows: torch.Tensor,
                num_tokens: torch.Tensor | None, results: torch.Tensor, has_logprobs: bool, num_positions: int,
                num_drafts: list[int] | None) -> SampledStep:
        """The step, with the copy of ``results`` to the host queued (see :attr:`host_results`)."""
        host_results = results.to("cpu", non_blocking=True)  # pinned: the copy is asynchronous
        copied = None
        if tokens.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(tokens.device))
        return cls(states, tokens, token_rows, num_tokens, {s.req_id: row for row, s in enumerate(states)},
                   host_results, has_logprobs, copied, num_positions, num_drafts)

    def wait(self) -> tuple[list[list[int]], tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """The tokens of each request, and the logprob arrays (token ids, logprobs, ranks) if any,
        once they are on the host: row b * P + j of the arrays is that of request b's token j."""
        if self.copied is not None:
            self.copied.synchronize()
        results = self.host_results.numpy()
        if results.ndim == 1:
            return [[token] for token in results.tolist()], None
        if not self.speculative:  # LogprobsTensors.pack's columns
            return [[token] for token in results[:, 1].tolist()], LogprobsTensors.unpack(results)
        width = 1 + self.num_positions
        tokens = [row[1:1 + row[0]] for row in results[:, :width].tolist()]
        if not self.has_logprobs:
            return tokens, None
        return tokens, LogprobsTensors.unpack(results[:, width:].reshape(len(tokens) * self.num_positions, -1))


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests whose whole known sequence was computed."""

    req_ids: list[str]
    # Per request, its new tokens: one, or with speculative decoding its accepted drafts and one more.
    sampled_token_ids: list[list[int]]
    # The logprobs of the new tokens of the requests that asked for them, one row per token, and
    # per request of ``req_ids`` the row of its first new token (-1: it asked for none).
    logprobs: StepLogprobs | None = None
    logprobs_rows: list[int] | None = None
    # Per request of ``req_ids``, how many drafts this step verified (None: a step without drafts).
    num_verified_drafts: list[int] | None = None
    # Per request of ``req_ids``, how many drafts a draft model proposed for its next step
    # (speculative decoding's "draft_model" method; None otherwise). Their values stay on the
    # device (the runner's ``device_drafts``); the next step names them DEVICE_DRAFT_TOKEN.
    num_draft_tokens: list[int] | None = None


@dataclass
class DeviceDrafts:
    """A draft model's proposals, left on the device: row i of ``token_ids`` [R, k] int64 holds the
    ``counts[i]`` drafts of ``req_ids[i]`` first (the entries after them mean nothing). The step that
    verifies them reads them there, so the host never waits for them."""

    req_ids: list[str]
    counts: list[int]
    token_ids: torch.Tensor
    rows: dict[str, int] = field(init=False)  # req_id -> its row

    def __post_init__(self) -> None:
        self.rows = {rid: row for row, rid in enumerate(self.req_ids)}


# A step whose sequences have several query tokens may run as one decode row per token, where each
# row reads its sequence's whole context again: at most this many extra key reads (per layer and
# KV head) over the step, e.g. 16 sequences verifying 4 drafts over 1,024 tokens of context. Measured
# on one H200 (benchmarks/results/spec_decode_cuda_*_budget*.json), decode rows beat the mixed step's
# prefill kernel at batch 16 for both the 0.5B and the 7B shapes at this budget, not only at 8,192.
DECODE_ROWS_MAX_EXTRA_KEYS = 65536


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
                 attn_backend: AttentionBackend | None = None) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device
        self.block_size = cache_config.block_size
        self.attn_backend = attn_backend or get_attn_backend(device, model_config.attention_backend)
        self.model: torch.nn.Module | None = None
        self.num_blocks = 0
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Sampling parameters and token statistics of each running request, on the device, in the
        # request's block-table row.
        self.sampling_table = SamplingStateTable(model_config.vocab_size, device, seed=model_config.seed)
        self.max_blocks_per_seq = -(-model_config.max_model_len // self.block_size)
        # The step buffers the CUDA graphs read (sized from the configuration at start-up), and
        # buffers of their own for the rare step larger than them (the low-level API's).
        self.buffers: StepInputBuffers | None = None
        self._oversized_buffers: StepInputBuffers | None = None
        # Row r holds the block ids of the request that owns row r (host only; a step copies its rows).
        self.block_table_rows = np.zeros((0, self.max_blocks_per_seq), dtype=np.int32)
        self._free_rows: list[int] = []
        self.graphs = StepGraphs()
        # Sequence slots (and logits rows) of every mixed-step graph.
        self.mixed_graph_seqs = 0
        # Forwards of each chain graph (a draft model's proposals, see greedy_chain); 0: none captured.
        self.chain_length = 0
        # The captured steps' metadata: its backend data (e.g. split-K workspaces) must live as
        # long as the graphs that use it.
        self._graph_metadata: dict[GraphKey, AttentionMetadata] = {}
        # An LM head split over the vocabulary: steps end with each rank's logits of its range,
        # gathered afterwards, or reduced to the greedy tokens without gathering the logits.
        self._split_lm_head: ParallelLMHead | None = None
        # The last step launched by execute_model whose tokens the host has not fetched yet.
        self._in_flight: SampledStep | None = None
        # The draft model's latest proposals (speculative decoding), which the next step verifies.
        self.device_drafts: DeviceDrafts | None = None
        # With a draft model: per KV block, whether the draft's cache holds the K/V of all its
        # positions (the draft skips steps after which it proposes nothing, so a block the prefix
        # cache shares may hold the target's K/V only).
        self.draft_kv_blocks: np.ndarray | None = None

    # ---- set-up -----------------------------------------------------------------------------
    def load_model(self) -> None:
        mc = self.model_config
        self.model = load_model(mc.model, mc.hf_config, mc.torch_dtype, self.device)
        compile_model(self.model, mc.compilation_level)
        head = getattr(self.model, "lm_head", None)
        self._split_lm_head = head if isinstance(head, ParallelLMHead) and head.tp_size > 1 else None

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
        self._clear_graphs()  # they point at the dropped caches
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def cuda_graphs_enabled(self) -> bool:
        return (self.device.type == "cuda" and not self.model_config.enforce_eager
                and getattr(self.attn_backend, "supports_cuda_graphs", False))

    def reserve_step_buffers(self, max_num_seqs: int, max_num_tokens: int) -> None:
        """Sizes the step buffers for the largest step the scheduler can make, once: buffers that
        grew later would move, and every graph reading them would have to go.

        With CUDA graphs there are two: the graphs' own (``buffers``), for steps of up to
        ``max_cudagraph_capture_size`` tokens, and the larger eager steps' (``_oversized_buffers``).
        A step's copy spans its buffers' token regions whole (see :class:`StepInputBuffers`), so
        the buffers most steps use are kept small: sized for a 32k-token context, they made every
        step copy 1.3 MB, about 27 us of the device's time before each step could start."""
        need = BufferCapacity(max(max_num_tokens, max_num_seqs), max_num_seqs, self.max_blocks_per_seq)
        if not self.cuda_graphs_enabled:
            if self.buffers is None or not self.buffers.capacity.covers(need):
                self._clear_graphs()
                self.buffers = StepInputBuffers(need, self.device)
            return
        captured = BufferCapacity(min(need.max_tokens, self.model_config.max_cudagraph_capture_size), max_num_seqs,
                                  self.max_blocks_per_seq)
        if self.buffers is None or self.buffers.capacity != captured:
            self._clear_graphs()
            if self.buffers is not None and self.buffers.capacity.covers(need):
                self._oversized_buffers = self.buffers  # (a profiling step's, as large as any step)
            self.buffers = StepInputBuffers(captured, self.device)
        if not any(b is not None and b.capacity.covers(need) for b in (self.buffers, self._oversized_buffers)):
            self._oversized_buffers = StepInputBuffers(need, self.device)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens a step holds without growing any step buffers."""
        return max(b.capacity.max_tokens for b in (self.buffers, self._oversized_buffers) if b is not None)

    @torch.inference_mode()
    def capture_model(self, max_num_seqs: int, max_num_tokens: int, chain_length: int = 0,
                      max_chain_seqs: int = 0) -> None:
        """Captures the step graphs (after the KV cache and the step buffers exist): decode steps of
        up to ``max_num_seqs`` sequences and mixed steps of up to ``max_num_tokens`` tokens, both
        bounded by ``max_cudagraph_capture_size``; with ``chain_length``, chains of that many
        forwards (see :meth:`greedy_chain`) of up to ``max_chain_seqs`` sequences."""
        if not self.cuda_graphs_enabled:
            return
        limit = self.model_config.max_cudagraph_capture_size
        decode_sizes = cudagraph_capture_sizes(min(max_num_seqs, limit))
        mixed_sizes = [t for t in cudagraph_capture_sizes(min(max_num_tokens, limit)) if t > 1]
        self.reserve_step_buffers(max_num_seqs, max_num_tokens)
        self.mixed_graph_seqs = min(max_num_seqs, limit)
        # A chain's argmax under a split LM head would put its collectives in the graph: not there.
        self.chain_length = chain_length if self._split_lm_head is None else 0
        chain_sizes = [s for s in decode_sizes if s <= max_chain_seqs
                       and s * self.chain_length <= self.buffers.capacity.max_tokens] if self.chain_length else []
        # Captured on inputs that are padding for both kinds: no KV slot, empty sequences.
        self.buffers.wait_until_writable()
        for name, array in self.buffers.host.items():
            array[...] = -1 if name == "slot_mapping" else 0
        self.buffers.copy_to_device(self.buffers.nbytes)
        views = self.buffers.device_views

        def run_step(key: GraphKey) -> torch.Tensor:
            metadata = self._graph_metadata[key] = self._static_metadata(key, views)
            if key.kind == "chain":
                return self._run_chain(key.size, self.chain_length, views, metadata)
            self.attn_backend.prepare(metadata)
            hidden = self.model(views["input_ids"][:key.size], views["positions"][:key.size], metadata)
            if key.kind == "mixed":
                hidden = hidden[views["logits_indices"][:self.mixed_graph_seqs]]
            return hidden

        keys = [GraphKey("decode", size) for size in decode_sizes] + [GraphKey("mixed", t) for t in mixed_sizes]
        keys += [GraphKey("chain", size) for size in chain_sizes]
        self.graphs.capture(keys, run_step, self.device)

    @torch.inference_mode()
    def warm_up_head(self, max_rows: int) -> None:
        """Runs the LM head once at every row count up to ``max_rows``. Graphs end before the head,
        which runs on however many rows a step samples, and on a GPU the first product at a new row
        count costs 0.1-3 ms (the library picks its kernel, and loads it on first use), which would
        otherwise land in a workload's first steps: about 30 of them at 2.5 ms in the first run of
        the 256-request benchmark."""
        head = getattr(self.model, "lm_head", None)
        if head is None or max_rows < 1:
            return
        hidden = torch.zeros(max_rows, head.weight.shape[-1], dtype=head.weight.dtype, device=self.device)
        for rows in range(1, max_rows + 1):
            self._head_output(hidden[:rows])

    # ---- staging a step ----------------------------------------------------------------------
    def _staging_buffers(self, need: BufferCapacity, exact: bool = False) -> StepInputBuffers:
        """The buffers a step that needs ``need`` is staged in (exactly ``need``, to share a layout
        with another rank's buffers): the reserved ones when it fits, else the oversized ones,
        grown as needed, so that a large step never moves the buffers the graphs read."""
        def fits(buffers: StepInputBuffers | None) -> bool:
            return buffers is not None and (buffers.capacity == need if exact else buffers.capacity.covers(need))

        def grown(buffers: StepInputBuffers | None) -> StepInputBuffers:
            capacity = need if buffers is None or exact else buffers.capacity.grown_to(need)
            return StepInputBuffers(capacity, self.device)

        if fits(self.buffers):
            return self.buffers
        if not self.graphs:  # nothing reads the reserved buffers' addresses yet
            self.buffers = grown(self.buffers)
            return self.buffers
        if not fits(self._oversized_buffers):
            self._oversized_buffers = grown(self._oversized_buffers)
            logger.info("a step larger than the reserved step buffers (%s) runs eagerly from buffers of its own",
                        self.buffers.capacity)
        return self._oversized_buffers

    def _clear_graphs(self) -> None:
        self.graphs.clear()
        self._graph_metadata.clear()
        self.mixed_graph_seqs = 0

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) of a padded decode batch: no KV slot, empty context."""
        host = self.buffers.host
        host["input_ids"][start:end] = 0
        host["positions"][start:end] = 0
        host["slot_mapping"][start:end] = -1
        host["seq_lens"][start:end] = 0
        host["query_start_loc"][start + 1:end + 1] = np.arange(start + 1, end + 1)
        host["logits_indices"][start:end] = np.arange(start, end)

    def _fill_mixed_padding(self, num_tokens: int, num_seqs: int, num_logits: int, key: GraphKey) -> None:
        """Pads a step to a mixed graph: tokens owned by no sequence and without a KV slot, then
        sequences without query tokens or context, and logits rows of token 0."""
        host, seqs = self.buffers.host, self.mixed_graph_seqs
        host["input_ids"][num_tokens:key.size] = 0
        host["positions"][num_tokens:key.size] = 0
        host["slot_mapping"][num_tokens:key.size] = -1
        host["query_start_loc"][num_seqs + 1:seqs + 1] = num_tokens
        host["seq_lens"][num_seqs:seqs] = 0
        host["logits_indices"][num_logits:seqs] = 0

    def _static_metadata(self, key: GraphKey, views: dict[str, torch.Tensor]) -> AttentionMetadata:
        """Metadata of a step shaped as the graph ``key`` (a captured step, or a chain's forwards): views
        of the buffers, lengths read on the device, and no host copies of them (the backend plans for
        any step of this shape). A chain's forwards are decode steps."""
        mixed = key.kind == "mixed"
        num_seqs = self.mixed_graph_seqs if mixed else key.size
        return AttentionMetadata(
            num_tokens=key.size, num_seqs=num_seqs, block_size=self.block_size,
            max_query_len=key.size if mixed else 1, max_seq_len=self.model_config.max_model_len,
            query_start_loc=views["query_start_loc"][:num_seqs + 1], seq_lens=views["seq_lens"][:num_seqs],
            block_tables=views["block_tables"][:num_seqs], slot_mapping=views["slot_mapping"][:key.size],
            query_lens_cpu=None, seq_lens_cpu=None, backend=self.attn_backend)

    def _stage(self, input_ids: np.ndarray, query_lens: np.ndarray, start_pos: np.ndarray,
               block_tables: np.ndarray, logits_indices: np.ndarray, allow_graph: bool = True,
               greedy: bool = False, token_sources: np.ndarray | None = None,
               previous_tokens: torch.Tensor | None = None) -> StagedStep:
        """Writes a step's inputs into the host staging buffer (no device work).

        ``block_tables`` is [num_seqs, n] with n >= every sequence's block count.
        ``token_sources``: per input token, -1 or the entry of ``previous_tokens`` (a device tensor,
        flattened) that holds it, for tokens not sampled yet when the step is staged.
        """
        max_query_len = int(query_lens.max())
        if allow_graph and max_query_len > 1 and self._runs_as_decode_rows(query_lens, start_pos):
            query_lens, start_pos, block_tables = self._decode_rows(query_lens, start_pos, block_tables)
            max_query_len = 1
        num_seqs, num_tokens, num_logits = len(query_lens), len(input_ids), len(logits_indices)
        buffers = self._staging_buffers(BufferCapacity(max(num_tokens, num_logits), num_seqs, block_tables.shape[1]))
        buffers.wait_until_writable()
        graph_key = self._graph_for(num_tokens, num_seqs, num_logits, max_query_len) \
            if allow_graph and buffers is self.buffers else None
        host, bs = buffers.host, self.block_size
        cu_lens = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_lens[1:])
        seq_lens = start_pos + query_lens
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - cu_lens[:-1][seq_index] + start_pos[seq_index]
        host["input_ids"][:num_tokens] = input_ids
        host["positions"][:num_tokens] = positions
        host["slot_mapping"][:num_tokens] = block_tables[seq_index, positions // bs] * bs + positions % bs
        host["logits_indices"][:len(logits_indices)] = logits_indices
        host["query_start_loc"][:num_seqs + 1] = cu_lens
        host["seq_lens"][:num_seqs] = seq_lens
        data_end = buffers.stage_block_tables(block_tables)
        if token_sources is not None:
            host["token_sources"][:num_tokens] = token_sources
        if graph_key is not None and graph_key.kind == "decode":
            self._fill_padding(num_seqs, graph_key.size)
        elif graph_key is not None:
            self._fill_mixed_padding(num_tokens, num_seqs, num_logits, graph_key)
        all_rows = num_logits == num_tokens and bool((logits_indices == np.arange(num_tokens)).all())
        # Only the real sequences' block-table rows are copied: padding sequences have no context,
        # so the kernels never read their rows, which keep older valid ids.
        return StagedStep(buffers, data_end, block_tables.shape, num_tokens, num_seqs, num_logits, query_lens,
                          seq_lens, graph_key, all_rows, greedy, previous_tokens if token_sources is not None else None)

    def _runs_as_decode_rows(self, query_lens: np.ndarray, start_pos: np.ndarray) -> bool:
        """Whether a step with several query tokens in some sequence, a few per sequence (a
        verification of drafts, a short prompt), runs as a decode step of one row per token (see
        :meth:`_decode_rows`): where a decode graph holds its tokens and the rows re-read little
        context."""
        if not self.graphs or self.graphs.padded_key("decode", int(query_lens.sum())) is None:
            return False
        return int(((query_lens - 1) * (start_pos + query_lens)).sum()) <= DECODE_ROWS_MAX_EXTRA_KEYS

    @staticmethod
    def _decode_rows(query_lens: np.ndarray, start_pos: np.ndarray,
                     block_tables: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step as one sequence per token: token t of a sequence becomes a row that attends to the
        sequence's first ``start + t + 1`` positions through the same block table. The KV of every
        token is stored before any row attends, so this is the causal attention of the step, run
        by the decode kernel (a mixed step's prefill kernel costs more for a few queries each).
        Returns the rows' query lengths, start positions and block tables."""
        seq_index = np.repeat(np.arange(len(query_lens)), query_lens)
        starts = np.cumsum(query_lens) - query_lens
        positions = np.arange(len(seq_index)) - starts[seq_index] + start_pos[seq_index]
        return np.ones(len(seq_index), np.int64), positions, block_tables[seq_index]

    def _graph_for(self, num_tokens: int, num_seqs: int, num_logits: int, max_query_len: int) -> GraphKey | None:
        """The captured graph a step runs as, or None to run it eagerly."""
        if not self.graphs:
            return None
        if max_query_len == 1:
            return self.graphs.padded_key("decode", num_seqs)
        if num_seqs <= self.mixed_graph_seqs and num_logits <= self.mixed_graph_seqs:
            return self.graphs.padded_key("mixed", num_tokens)
        return None

    def _load(self, staged: StagedStep) -> ModelInput:
        """Copies a staged step (this runner's or the driver rank's) to the device; returns its inputs."""
        buffers = staged.buffers
        if buffers is not self.buffers and buffers is not self._oversized_buffers:
            # A step staged by the driver rank: match its buffer layout, whose copy this is.
            buffers = self._staging_buffers(staged.buffers.capacity, exact=True)
            if staged.graph_key is not None and (staged.graph_key not in self.graphs or buffers is not self.buffers):
                raise RuntimeError(f"the driver rank runs the CUDA graph {staged.graph_key}, which {self.device} "
                                   f"did not capture (it has decode sizes {self.graphs.sizes('decode')} and "
                                   f"mixed sizes {self.graphs.sizes('mixed')})")
        views = self._copy_inputs(staged, buffers)
        num_tokens, num_seqs = staged.num_tokens, staged.num_seqs
        metadata = None
        if staged.graph_key is None:
            metadata = AttentionMetadata(
                num_tokens=num_tokens, num_seqs=num_seqs, block_size=self.block_size,
                max_query_len=int(staged.query_lens.max()), max_seq_len=int(staged.seq_lens.max()),
                query_start_loc=views["query_start_loc"][:num_seqs + 1], seq_lens=views["seq_lens"][:num_seqs],
                block_tables=views["block_tables"][:num_seqs], slot_mapping=views["slot_mapping"][:num_tokens],
                query_lens_cpu=staged.query_lens, seq_lens_cpu=staged.seq_lens, backend=self.attn_backend)
            self.attn_backend.prepare(metadata)
        return ModelInput(views["input_ids"][:num_tokens], views["positions"][:num_tokens], metadata,
                          views["logits_indices"][:staged.num_logits], num_seqs, staged.graph_key,
                          staged.logits_are_all_rows)

    def _copy_inputs(self, staged: StagedStep, buffers: StepInputBuffers) -> dict[str, torch.Tensor]:
        """Queues the copy of ``staged`` into ``buffers``' device side and what finishes its inputs
        there (block tables, the tokens it takes from ``previous_tokens``, its logits shift);
        returns the device views."""
        buffers.copy_to_device(staged.num_bytes, staged.buffers)
        previous = staged.previous_tokens_on(self.device) if staged.previous_tokens is not None else None
        buffers.finish_inputs(staged.block_table_shape, staged.num_tokens, previous, staged.logits_shift,
                              staged.num_logits)
        return buffers.device_views

    def prepare_inputs(self, seqs: Sequence[SequenceInput]) -> ModelInput:
        """Stages an explicit list of sequences (the low-level API); always an eager step."""
        return self._load(self._stage(*self._flatten(seqs), allow_graph=False))

    def _flatten(self, seqs: Sequence[SequenceInput]):
        if not seqs:
            raise ValueError("a forward step needs at least one sequence")
        bs = self.block_size
        query_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        if (query_lens < 1).any():
            raise ValueError(f"every sequence must compute at least one token, got query lengths {query_lens.tolist()}")
        start_pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        seq_lens = start_pos + query_lens
        block_tables = np.zeros((len(seqs), max(max(len(s.block_table) for s in seqs), 1)), dtype=np.int32)
        for i, s in enumerate(seqs):
            if len(s.block_table) * bs < seq_lens[i]:
                raise ValueError(f"sequence {i}: {len(s.block_table)} blocks of {bs} tokens cannot hold "
                                 f"{int(seq_lens[i])} tokens")
            block_tables[i, :len(s.block_table)] = s.block_table
        cu_lens = np.cumsum(query_lens)
        logits_rows = []
        for i, s in enumerate(seqs):
            if s.logits == "last":
                logits_rows.append(np.array([cu_lens[i] - 1]))
            elif s.logits == "all":
                logits_rows.append(np.arange(cu_lens[i] - query_lens[i], cu_lens[i]))
            elif s.logits != "none":
                raise ValueError(f"logits must be 'none', 'last' or 'all', got {s.logits!r}")
        logits_indices = np.concatenate(logits_rows) if logits_rows else np.zeros(0, dtype=np.int64)
        input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(cu_lens[-1]))
        return input_ids, query_lens, start_pos, block_tables, logits_indices

    # ---- running a step ----------------------------------------------------------------------
    def _head_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a step ends with: the logits, or this rank's range of them under a split LM head."""
        if self._split_lm_head is not None:
            return self._split_lm_head.local_logits(hidden)
        return self.model.compute_logits(hidden)

    def _full_logits(self, head_output: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary from a step's head output."""
        if self._split_lm_head is not None:
            return self._split_lm_head.gather_logits(head_output)
        return head_output

    def _greedy_tokens(self, head_output: torch.Tensor) -> torch.Tensor:
        if self._split_lm_head is not None:
            return self._split_lm_head.greedy_tokens(head_output)
        return head_output.argmax(dim=-1)

    def _compute_hidden(self, model_input: ModelInput) -> torch.Tensor:
        """The final hidden states of the rows requested (graphs end here: the LM head runs on the
        sampled rows only, and graphs keep no vocabulary-wide output alive)."""
        key = model_input.graph_key
        if key is not None:
            hidden = self.graphs.replay(key)
            if key.kind == "mixed":  # rows in logits_indices order already
                return hidden[:model_input.logits_indices.shape[0]]
            if model_input.logits_are_all_rows:
                return hidden[:model_input.num_seqs]
            return hidden.index_select(0, model_input.logits_indices)  # one launch, less host time than []
        hidden = self.model(model_input.input_ids, model_input.positions, model_input.metadata)
        return hidden if model_input.logits_are_all_rows else hidden.index_select(0, model_input.logits_indices)

    def _compute_logits(self, model_input: ModelInput) -> torch.Tensor:
        """The head output (see :meth:`_head_output`) of the rows requested, in the model's dtype."""
        return self._head_output(self._compute_hidden(model_input))

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:
        """Runs one step; returns float32 logits [rows requested, vocab] in input order.

        Steps that fit a captured graph replay it.
        """
        return self._full_logits(self._compute_logits(self._load(self._stage(*self._flatten(seqs))))).float()

    @torch.inference_mode()
    def greedy_step(self, input_ids: np.ndarray, query_lens: np.ndarray, start_pos: np.ndarray,
                    block_tables: np.ndarray, logits_indices: np.ndarray, token_sources: np.ndarray | None = None,
                    source_tokens: torch.Tensor | None = None,
                    logits_shift: LogitsShift | None = None) -> torch.Tensor:
        """Runs a step given as flat arrays (see :meth:`_stage`; ``token_sources`` names the inputs
        taken from ``source_tokens`` on the device, ``logits_shift`` moves the logits rows on the
        device) and returns the argmax token of each logits row, on the device, without waiting for
        it (a draft model's steps). Steps that fit a captured graph replay it."""
        staged = self._stage(input_ids, query_lens, start_pos, block_tables, logits_indices, greedy=True,
                             token_sources=token_sources, previous_tokens=source_tokens)
        staged.logits_shift = logits_shift
        return self._greedy_tokens(self._compute_logits(self._load(staged)))

    @torch.inference_mode()
    def greedy_chain(self, first_tokens: torch.Tensor, token_sources: np.ndarray, positions: np.ndarray,
                     num_forwards: np.ndarray, length: int, block_tables: np.ndarray) -> torch.Tensor:
        """``length`` one-token greedy forwards in a row over the same sequences, each fed the argmax
        of the one before (a draft model's proposals), with no host work between them.

        Row b first feeds ``first_tokens[token_sources[b]]`` (on the device) at ``positions[b]``,
        then each forward's token at the next position, writing K/V for ``num_forwards[b]`` forwards;
        after those it reads its last written position again without writing (its tokens are then
        meaningless). ``block_tables`` covers ``positions + num_forwards``. Returns the tokens
        [rows, length] on the device, without waiting: one replay of a chain graph where one fits;
        else decode-graph replays or eager forwards, each advanced to its position on the device.
        """
        staged = self._stage_chain(first_tokens, token_sources, positions, num_forwards, length, block_tables)
        buffers, size, rows = staged.buffers, staged.num_seqs, len(positions)
        views = self._copy_inputs(staged, buffers)
        key = staged.graph_key
        if key is not None and key.kind == "chain":
            return self.graphs.replay(key)[:rows]
        metadata = None if key is not None else self._static_metadata(GraphKey("decode", size), views)
        return self._run_chain(size, length, views, metadata)[:rows]

    def _stage_chain(self, first_tokens: torch.Tensor, token_sources: np.ndarray, positions: np.ndarray,
                     num_forwards: np.ndarray, length: int, block_tables: np.ndarray) -> StagedStep:
        """Stages a chain (see :meth:`greedy_chain`) as its first forward, a decode step of
        ``size`` rows (padded to a graph), followed in the token regions by every later forward's
        positions and KV slots: forward j's at ``j * size``."""
        rows = len(positions)
        key = self.graphs.padded_key("chain", rows) if length == self.chain_length else None
        key = key or self.graphs.padded_key("decode", rows)
        size = key.size if key is not None else rows
        buffers = self._staging_buffers(BufferCapacity(size * length, size, block_tables.shape[1]))
        if buffers is not self.buffers:
            key = None
        buffers.wait_until_writable()
        host, bs, steps = buffers.host, self.block_size, np.arange(length)
        # A row past its forwards stays at its last written position (reading valid context).
        pos = positions[:, None] - 1 + np.minimum(steps[None, :] + 1, num_forwards[:, None])
        slots = block_tables[np.arange(rows)[:, None], pos // bs] * bs + pos % bs
        slots[steps[None, :] >= num_forwards[:, None]] = -1
        for name, values, pad in (("positions", pos, 0), ("slot_mapping", slots, -1)):
            grid = host[name][:size * length].reshape(length, size)
            grid[:, :rows] = values.T
            grid[:, rows:] = pad
        host["input_ids"][:size] = 0
        host["token_sources"][:rows] = token_sources
        host["token_sources"][rows:size] = -1
        host["query_start_loc"][:size + 1] = np.arange(size + 1)
        host["seq_lens"][:rows] = pos[:, 0] + 1
        host["seq_lens"][rows:size] = 0
        return StagedStep(buffers, buffers.stage_block_tables(block_tables), block_tables.shape, size, size, 0,
                          np.ones(rows, np.int64), pos[:, 0] + 1, key, False, True, first_tokens)

    def _run_chain(self, size: int, length: int, views: dict[str, torch.Tensor],
                   metadata: AttentionMetadata | None) -> torch.Tensor:
        """The forwards of a chain staged in ``views`` (see :meth:`_stage_chain`): eager decode steps
        of ``size`` rows with ``metadata``, or replays of the decode graph of ``size`` rows (None).
        Before each forward after the first, its inputs are moved into place on the device: the
        tokens of the forward before, its positions and KV slots, and the context lengths they give.
        Returns the tokens [size, length]."""
        input_ids, positions = views["input_ids"][:size], views["positions"][:size]
        slots, seq_lens = views["slot_mapping"], views["seq_lens"][:size]
        tokens: list[torch.Tensor] = []
        for j in range(length):
            if j:
                input_ids.copy_(tokens[-1])
                positions.copy_(views["positions"][j * size:(j + 1) * size])
                slots[:size].copy_(slots[j * size:(j + 1) * size])
                seq_lens.copy_(torch.where(seq_lens > 0, positions + 1, 0))  # padding rows stay empty
            if metadata is None:
                hidden = self.graphs.replay(GraphKey("decode", size))
            else:
                # Planned again each time: a backend may plan from the lengths' values (the CPU one
                # does; a captured plan depends on shapes only and is only re-made).
                self.attn_backend.prepare(metadata)
                hidden = self.model(input_ids, positions, metadata)
            tokens.append(self._greedy_tokens(self._head_output(hidden[:size])))
        return torch.stack(tokens, dim=1)

    # ---- engine steps ------------------------------------------------------------------------
    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self.block_table_rows)
            grown = np.zeros((max(16, 2 * old), self.max_blocks_per_seq), dtype=np.int32)
            grown[:old] = self.block_table_rows
            self.block_table_rows = grown
            self._free_rows = list(range(len(grown) - 1, old - 1, -1))
        return self._free_rows.pop()

    def _draft_computed_of_hit(self, block_ids: Sequence[int], num_computed: int) -> int:
        """How many of a joining request's ``num_computed`` tokens (its prefix-cache hit) the draft's
        cache holds: those before its first hit block the draft did not compute. Its other blocks
        are new, the draft's K/V in them not yet computed."""
        if self.draft_kv_blocks is None:
            return num_computed
        num_hit = -(-num_computed // self.block_size)
        self.draft_kv_blocks[block_ids[num_hit:]] = False
        missing = np.flatnonzero(~self.draft_kv_blocks[block_ids[:num_hit]])
        return num_computed if not len(missing) else min(num_computed, int(missing[0]) * self.block_size)

    def mark_draft_kv_blocks(self, state: CachedRequestState, begin: int, end: int) -> None:
        """Records that the draft computed positions [begin, end) of ``state``: the blocks they fill."""
        first, last = begin // self.block_size, end // self.block_size
        if self.draft_kv_blocks is not None and last > first:
            self.draft_kv_blocks[self.block_table_rows[state.row, first:last]] = True

    def _drop_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def _append_blocks(self, state: CachedRequestState, block_ids: Sequence[int]) -> None:
        end = state.num_blocks + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"request {state.req_id} has {end} KV blocks, more than the "
                             f"{self.max_blocks_per_seq} that max_model_len={self.model_config.max_model_len} needs")
        self.block_table_rows[state.row, state.num_blocks:end] = block_ids
        state.num_blocks = end

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._drop_request(rid)
        joined: list[CachedRequestState] = []
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            greedy = params.is_greedy and not params.has_penalties
            self._drop_request(new.req_id)  # a resumed request may still hold a row
            state = CachedRequestState(
                new.req_id, new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                list(new.output_token_ids), params, new.num_computed_tokens, self._take_row(),
                plain_greedy=greedy and params.logprobs is None,
                greedy_with_logprobs=greedy and params.logprobs is not None,
                num_draft_computed_tokens=self._draft_computed_of_hit(new.block_ids, new.num_computed_tokens))
            self._append_blocks(state, new.block_ids)
            self.requests[new.req_id] = state
            joined.append(state)
        # Every joining request's row is written, plain greedy ones too: a step that mixes them
        # with others reads their (neutral) parameters.
        self.sampling_table.add_requests([s.row for s in joined], [s.sampling_params for s in joined],
                                         [s.prompt_token_ids for s in joined], [s.output_token_ids for s in joined])
        cached = so.scheduled_cached_reqs
        requests = self.requests
        for rid, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = requests[rid]
            if new_block_ids:
                self._append_blocks(state, new_block_ids)
                if self.draft_kv_blocks is not None:
                    self.draft_kv_blocks[new_block_ids] = False
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, on_staged: Callable[[StagedStep | None], None] | None = None,
                      pipelined: bool = False,
                      on_launched: Callable[[SampledStep | None], None] | None = None) -> list[ModelRunnerOutput]:
        """Runs a scheduled step; returns the outputs of the steps whose tokens this call fetched
        to the host, oldest first.

        The step left in flight by the previous call (``pipelined``) is fetched after this step
        is launched, so the device goes from one to the next without waiting for the host; this
        step's inputs take that step's tokens on the device. With ``pipelined`` this step is left
        in flight in turn, else it is fetched too. ``on_staged`` gets the staged step (None for an
        empty one) as soon as its inputs are in the host buffer, for other ranks to run it too;
        ``on_launched`` gets its sampled tokens, still on the device (None if nothing samples),
        once the step before is fetched and before this one is, to queue work that reads them.
        """
        self._update_states(so)
        previous, self._in_flight = self._in_flight, None
        current = self._launch(so, previous, on_staged)
        outputs = [self._fetch(previous)] if previous is not None else []
        if on_launched is not None:
            on_launched(current)
        if current is not None:
            if pipelined:
                self._in_flight = current
            else:
                outputs.append(self._fetch(current))
        return outputs

    def _launch(self, so: SchedulerOutput, previous: SampledStep | None,
                on_staged: Callable[[StagedStep | None], None] | None) -> SampledStep | None:
        """Stages, runs and samples a step without waiting for its tokens; None if nothing samples."""
        if so.is_empty:
            if on_staged is not None:
                on_staged(None)
            return None
        # Requests whose newest token the previous step is still sampling: their input is read
        # from that step's tokens on the device.
        in_flight_rows = previous.rows if previous is not None else {}
        num_seqs = len(so.num_scheduled_tokens)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        start_pos = np.empty(num_seqs, dtype=np.int64)
        rows = np.empty(num_seqs, dtype=np.int64)
        input_ids: list[int] = []
        sources: list[tuple[int, int]] = []  # (token index, row of the previous step's tokens)
        sampling: list[CachedRequestState] = []
        sampling_seqs: list[int] = []
        num_outputs: list[int] = []
        spec_tokens = so.scheduled_spec_decode_tokens
        num_drafts: list[int] = []  # per sampling request (speculative steps)
        device_drafts = self._device_drafts_of(spec_tokens)
        if device_drafts is not None and in_flight_rows:
            raise RuntimeError("a step verifying device drafts follows a step left in flight; speculative "
                               "steps are never pipelined")
        for i, (rid, num_tokens) in enumerate(so.num_scheduled_tokens.items()):
            state = self.requests[rid]
            drafts = spec_tokens.get(rid, ()) if spec_tokens else ()
            start = state.num_computed_tokens
            query_lens[i], start_pos[i], rows[i] = num_tokens, start, state.row
            num_known = len(state.token_ids)
            in_flight = rid in in_flight_rows
            if start == num_known:
                if not in_flight:
                    raise RuntimeError(f"request {rid} needs its token at position {start}, which no step "
                                       f"has sampled")
                sources.append((len(input_ids), in_flight_rows[rid]))
                input_ids.append(0)
                input_ids.extend(drafts)  # n-gram drafts proposed while that token was in flight
            elif num_tokens == 1:
                input_ids.append(state.token_ids[start])
            else:
                input_ids.extend(state.token_ids[start:start + num_tokens - len(drafts)])
                if device_drafts is not None and drafts:
                    # Read on the device: entry j of the request's row of the proposals.
                    first = device_drafts.rows[rid] * device_drafts.token_ids.shape[1]
                    sources += [(len(input_ids) + j, first + j) for j in range(len(drafts))]
                    input_ids.extend([0] * len(drafts))
                else:
                    input_ids.extend(drafts)
            state.num_computed_tokens = start + num_tokens
            if start + num_tokens - len(drafts) == num_known + in_flight:
                sampling.append(state)
                sampling_seqs.append(i)
                num_outputs.append(len(state.output_token_ids) + in_flight)
                num_drafts.append(len(drafts))
        max_blocks = -(-int((start_pos + query_lens).max()) // self.block_size)
        logits_indices = np.cumsum(query_lens)[sampling_seqs] - 1
        if spec_tokens:
            # A speculative step samples at the last known token and at each draft.
            counts = np.asarray(num_drafts, dtype=np.int64) + 1
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            logits_indices = np.repeat(logits_indices - counts + 1, counts) + offsets
        argmax_only = all(s.plain_greedy and n >= s.sampling_params.min_tokens for s, n in zip(sampling, num_outputs))
        num_logprobs = None  # of a greedy step with logprobs: the most any row asked for
        if not argmax_only and all((s.plain_greedy or s.greedy_with_logprobs) and n >= s.sampling_params.min_tokens
                                   for s, n in zip(sampling, num_outputs)):
            num_logprobs = max(s.sampling_params.logprobs for s in sampling if s.greedy_with_logprobs)
        token_sources = None
        if sources:
            token_sources = np.full(len(input_ids), -1, dtype=np.int64)
            index, source_rows = zip(*sources)
            token_sources[list(index)] = source_rows
        source_tokens = None  # what token_sources index: the step in flight's tokens, or device drafts
        if sources:
            source_tokens = previous.device_tokens if device_drafts is None else device_drafts.token_ids.view(-1)
        staged = self._stage(np.asarray(input_ids, dtype=np.int64), query_lens, start_pos,
                             self.block_table_rows[rows, :max_blocks], logits_indices, greedy=argmax_only,
                             token_sources=token_sources, previous_tokens=source_tokens)
        if on_staged is not None:
            on_staged(staged)
        head_output = self._compute_logits(self._load(staged))
        if not sampling:
            return None
        if spec_tokens:
            return self._verify_drafts(sampling, num_outputs, num_drafts, spec_tokens, head_output, argmax_only,
                                       device_drafts)
        if argmax_only:
            sampled, logprobs = self._greedy_tokens(head_output), None
        elif num_logprobs is not None:  # greedy with logprobs: both off the whole logits, without the sampler
            sampled, logprobs = greedy_with_logprobs(self._full_logits(head_output), num_logprobs)
        else:
            step_rows = rows if len(sampling_seqs) == num_seqs else rows[sampling_seqs]
            metadata = self.sampling_table.gather(step_rows, np.asarray(num_outputs, dtype=np.int64))
            # In the model's dtype: the sampler reads them as they are (no float32 copy on its fused path).
            out = self.sampler(self._full_logits(head_output), metadata, record=True)
            sampled, logprobs = out.sampled_token_ids, out.logprobs
            if not out.recorded:
                self.sampling_table.record_sampled(metadata, sampled)
        return SampledStep.start_copy(sampling, sampled, logprobs)

    def _device_drafts_of(self, spec_tokens: dict[str, list[int]]) -> DeviceDrafts | None:
        """The device drafts a step verifies, if its drafts are the draft model's (then every request's
        drafts are in them: one proposer serves a run)."""
        drafts = next((d for d in spec_tokens.values() if d), None) if spec_tokens else None
        if drafts is None or drafts[0] != DEVICE_DRAFT_TOKEN:
            return None
        device_drafts = self.device_drafts
        missing = [rid for rid in spec_tokens if device_drafts is None or rid not in device_drafts.rows]
        if missing:
            raise RuntimeError(f"requests {missing[:4]} verify device drafts that no proposal holds")
        return device_drafts

    def _verify_drafts(self, sampling: list[CachedRequestState], num_outputs: list[int], num_drafts: list[int],
                       spec_tokens: dict[str, list[int]], head_output: torch.Tensor,
                       plain_greedy: bool, device_drafts: DeviceDrafts | None) -> SampledStep:
        """Speculative decoding: rejection sampling of each request's drafts against the target's
        distributions at its rows of ``head_output`` (the last known token's, then one per draft).

        Every row is sampled with its request's settings at its own output position (seeded noise
        and min_tokens are per position). Each position's noise row also gives the acceptance
        uniform of that position's draft (see :func:`rejection_sample`). Steps whose requests are
        all greedy compare the drafts with the argmax only; ``plain_greedy`` ones (no penalties,
        logprobs or min_tokens either) also skip the sampling parameters.
        """
        counts = np.asarray(num_drafts, dtype=np.int64) + 1
        starts = np.cumsum(counts) - counts
        k = int(counts.max()) - 1
        # Request b's rows padded to k + 1 positions (the padding repeats its last row, never read).
        index_np = starts[:, None] + np.minimum(np.arange(k + 1)[None, :], counts[:, None] - 1)
        # Request b's drafts: the first num_drafts[b] of row proposal_rows[b] of the proposals (the
        # draft model's, cut to what the scheduler kept; or the host's, one row each).
        if device_drafts is None:
            drafts_np = np.full((len(sampling), k), -1, dtype=np.int64)
            for b, state in enumerate(sampling):
                drafts_np[b, :num_drafts[b]] = spec_tokens.get(state.req_id, ())
            rows_np = np.arange(len(sampling), dtype=np.int64)
            index, num_drafts_d, proposal_rows, proposals = copy_to_device([index_np, counts - 1, rows_np, drafts_np],
                                                                          self.device)
        else:
            rows_np = np.fromiter((device_drafts.rows.get(s.req_id, 0) for s in sampling), np.int64, len(sampling))
            index, num_drafts_d, proposal_rows = copy_to_device([index_np, counts - 1, rows_np], self.device)
            proposals = device_drafts.token_ids
        if plain_greedy:
            packed, last = greedy_verify_rows(self._greedy_tokens(head_output), index, proposals, proposal_rows,
                                              num_drafts_d)
            return SampledStep.from_verified(sampling, packed, last, num_drafts)
        drafts = draft_rows(proposals, proposal_rows, num_drafts_d, k)
        table_rows = np.repeat(np.fromiter((s.row for s in sampling), np.int64, len(sampling)), counts)
        positions = np.repeat(np.asarray(num_outputs, dtype=np.int64) - starts, counts) + np.arange(int(counts.sum()))
        metadata = self.sampling_table.gather(table_rows, positions)
        full_logits = self._full_logits(head_output).float()
        logits = apply_min_tokens(full_logits, metadata)
        if not metadata.no_penalties:
            add_preceding_drafts(metadata, drafts, counts - 1)
            logits = apply_penalties(logits, metadata)
        if metadata.all_greedy:
            out = greedy_verify(logits.argmax(dim=-1)[index], drafts)
        else:
            probs = sampling_probs(logits, metadata)
            probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalized
            noise = exponential_draws(probs, torch.arange(probs.shape[-1], device=probs.device), metadata)[index]
            uniform = torch.exp(-noise[:, :k].gather(-1, drafts.clamp(min=0).unsqueeze(-1)).squeeze(-1))
            out = rejection_sample(probs[index], drafts, num_drafts_d, None, logits.argmax(dim=-1)[index],
                                   metadata.is_greedy[index[:, 0]], uniform, noise)
        if not metadata.no_penalties:
            self._record_emitted(metadata, out, counts)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            # Of each emitted token, at its position, from the raw distribution (as without speculation).
            logprobs = gather_logprobs(full_logits[index.flatten()], out.token_ids.clamp(min=0).flatten(),
                                       metadata.max_num_logprobs)
        return SampledStep.start_copy(sampling, out.token_ids, logprobs, out.num_tokens, num_drafts)

    def _record_emitted(self, metadata: SamplingMetadata, out: RejectionSamplerOutput, counts: np.ndarray) -> None:
        """Adds a verification step's emitted tokens to the penalty state. Row r of the step (request
        b's position j, ``counts[b]`` positions each) emitted out.token_ids[b, j] if j <
        out.num_tokens[b]; a row past them repeats the request's last token, uncounted."""
        request_np = np.repeat(np.arange(len(counts)), counts)
        position_np = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        request, position = (torch.from_numpy(a).to(self.device, non_blocking=True) for a in (request_np, position_np))
        num_tokens = out.num_tokens[request]
        last = torch.minimum(position, num_tokens - 1)
        self.sampling_table.record_sampled(metadata, out.token_ids[request, last], position < num_tokens)

    @staticmethod
    def _fetch(step: SampledStep) -> ModelRunnerOutput:
        """Waits for a step's tokens on the host and adds them to its requests."""
        tokens, logprobs = step.wait()
        for state, new_tokens in zip(step.states, tokens):
            state.token_ids.extend(new_tokens)
            state.output_token_ids.extend(new_tokens)
        req_ids = [s.req_id for s in step.states]
        block, rows = ModelRunner._logprobs_block(step, *logprobs) if logprobs is not None else (None, None)
        return ModelRunnerOutput(req_ids, tokens, block, rows, num_verified_drafts=step.num_drafts)

    @staticmethod
    def _logprobs_block(step: SampledStep, ids: np.ndarray, values: np.ndarray,
                        ranks: np.ndarray) -> tuple[StepLogprobs, list[int]]:
        """A step's logprob rows (``num_positions`` per request) as one block, and each request's
        first row in it (-1 where it asked for none): the whole arrays when every request asked (no
        work per request), else the rows of those that did."""
        num_positions = step.num_positions
        asked = [state.sampling_params.logprobs is not None for state in step.states]
        if all(asked):
            return (StepLogprobs.of(ids.shape[1], ids, values, ranks),
                    list(range(0, len(asked) * num_positions, num_positions)))
        requests = np.flatnonzero(asked)
        rows = (requests[:, None] * num_positions + np.arange(num_positions)).ravel()
        first_rows = [-1] * len(asked)
        for index, request in enumerate(requests.tolist()):
            first_rows[request] = index * num_positions
        return StepLogprobs.of(ids.shape[1], ids[rows], values[rows], ranks[rows]), first_rows

    def is_replay_only(self, staged: StagedStep) -> bool:
        """Whether running ``staged`` here is a copy and a CUDA-graph replay, with no collective
        issued from the host (a rank without a split LM head computes no logits): then any thread
        may launch it."""
        return staged.graph_key is not None and not (self._split_lm_head is not None and staged.num_logits)

    @torch.inference_mode()
    def run_staged(self, staged: StagedStep | None) -> None:
        """Runs a step the driver rank staged, without sampling (a rank of a ``uni`` executor whose
        only part in a step is its shard of the forward pass, and of the LM head's collectives)."""
        if staged is None:
            return
        hidden = self._compute_hidden(self._load(staged))
        if self._split_lm_head is not None and staged.num_logits:
            # The collectives the driver's sampling path runs, with the driver's choice of path.
            (self._greedy_tokens if staged.greedy else self._full_logits)(self._head_output(hidden))
