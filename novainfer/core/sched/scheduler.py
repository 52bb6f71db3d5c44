"""Continuous batching with chunked prefill under one token budget per step.

Each step first serves running requests in admission order (a decode costs one token, an
unfinished prompt a chunk), then admits waiting requests first come, first served, while the
token budget, ``max_num_seqs`` and the KV cache allow. A prompt longer than the remaining
budget is chunked, so long prompts never stall decodes. When a running request cannot get a
KV block, the most recently admitted running request is preempted: its blocks are freed and it
goes back to the front of the waiting queue to be recomputed later.

A scheduled step counts as computed at once: ``num_computed_tokens`` advances when the step is
scheduled, and a request that will sample in it gets an output placeholder, so the next step
can be scheduled (and run) before this one's tokens are known (``async_scheduling``). The
sampled tokens replace the placeholders in :meth:`Scheduler.update_from_output`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from novainfer.core.kv_cache_manager import KVCacheManager
from novainfer.core.messages import EngineCoreOutput
from novainfer.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from novainfer.core.sched.request import Request, RequestStatus
from novainfer.outputs import StepLogprobs

logger = logging.getLogger(__name__)


# The least prompt tokens a step with decodes may take under ``max_mixed_step_tokens``.
MIN_MIXED_PROMPT_CHUNK = 64


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 2048
    # Schedule and launch step N+1 before step N's tokens are on the host: the host's work of a
    # step (scheduling, input staging, output processing) then overlaps the device's.
    async_scheduling: bool = False
    # The most tokens of a step that also decodes (None: max_num_batched_tokens). Prompt chunks then
    # fill such a step only up to this bound (that of the captured CUDA graphs), so an arriving
    # prompt never stalls the running streams with one long eager step; a step without decodes
    # still takes max_num_batched_tokens of prompts.
    max_mixed_step_tokens: int | None = None
    # KV slots held past each request's scheduled tokens: a draft model (speculative decoding)
    # writes the K/V of its proposals there before the step that verifies them is scheduled.
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_mixed_step_tokens is not None and self.max_mixed_step_tokens < 1:
            raise ValueError(f"max_mixed_step_tokens must be >= 1 or None, got {self.max_mixed_step_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Entry i: drafts accepted at draft position i (the first draft of a step is position 0).
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._workers_know: set[str] = set()  # requests whose state the workers hold
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions_total = 0
        # Speculative decoding since start: requests' steps with drafts, draft tokens verified and
        # accepted, and accepted drafts by position.
        self.num_drafts_total = 0
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        self.num_accepted_tokens_per_pos: list[int] = []
        # The context a request may reach (a stop condition): capped by max_model_len and by what the
        # whole KV cache holds, so that a request alone in the cache can always take its next step.
        self.max_context_len = min(config.max_model_len, kv_cache_manager.num_blocks * kv_cache_manager.block_size)

    # ---- queue management --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.max_num_tokens = min(request.max_num_tokens, self.max_context_len)
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (stop, length, abort): frees their KV blocks. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.set_status(status)
            self.kv_cache_manager.free(rid)
            self._release(rid)
            finished.append(request)
        return finished

    def _release(self, rid: str) -> None:
        self._workers_know.discard(rid)
        self._finished_since_last_step.add(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        scheduled: list[tuple[Request, int]] = []  # num_scheduled's requests, without a lookup each

        # Decodes first, then unfinished prompts, each group in admission order: a long prompt's
        # chunks use what is left of the budget and never delay a decode.
        # (request, its uncomputed tokens): unchanged until the request is scheduled or preempted.
        decoding: list[tuple[Request, int]] = []
        prefilling: list[tuple[Request, int]] = []
        workers_know = self._workers_know
        running_status = RequestStatus.RUNNING  # a local: looking up an enum member costs more than the test
        for r in self.running:
            num_known, num_placeholders = len(r.all_token_ids), r.num_output_placeholders
            num_uncomputed = num_known + num_placeholders - r.num_computed_tokens
            if num_uncomputed > 1:
                prefilling.append((r, num_uncomputed))
            elif num_uncomputed == 1 and not (
                    # Its tokens in flight take it to its length limit: it finishes once they are
                    # known, so scheduling it again would only sample a token past its end.
                    num_placeholders and num_known + num_placeholders >= r.max_num_tokens):
                decoding.append((r, 1))
        for group in (decoding, prefilling):
            if group is prefilling:
                budget = self._prompt_budget(budget, len(num_scheduled))
            for request, num_uncomputed in group:
                if budget == 0:
                    break
                if request.status != running_status:
                    continue  # preempted earlier in this step
                # A decode's drafts (speculative decoding) ride along as far as the budget goes.
                drafts = request.spec_token_ids
                num_new = num_uncomputed + len(drafts) if drafts else num_uncomputed
                if num_new > budget:  # (not min(): a call per request per step)
                    num_new = budget
                if request.num_computed_tokens + num_new <= request.num_tokens_in_place:
                    # Most steps: its blocks hold the new tokens and none of them fills, so the KV
                    # cache manager would only count them (it takes our count at its next call).
                    new_blocks = []
                else:
                    new_blocks = self._allocate_or_preempt(request, num_new, num_scheduled, preempted)
                    if new_blocks is None:
                        continue  # the request itself was preempted
                rid = request.request_id
                num_scheduled[rid] = num_new
                scheduled.append((request, num_new))
                budget -= num_new
                if drafts:
                    request.spec_token_ids = drafts[:num_new - num_uncomputed]
                    if request.spec_token_ids:
                        spec_tokens[rid] = request.spec_token_ids
                if rid in workers_know:  # only what changed (inline: every decode of every step is here)
                    cached_reqs.req_ids.append(rid)
                    cached_reqs.new_block_ids.append(new_blocks)
                    cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
                else:
                    self._emit_new(request, new_reqs)

        # Admit waiting requests, unless this step already had to preempt (no room).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted while its last token was in flight: recomputed once that is known
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request.request_id, request.all_token_ids)
            num_new = min(request.num_tokens - num_hit, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request.request_id, request.all_token_ids, num_new,
                                                              hit_blocks, num_hit, self._lookahead(num_hit + num_new))
            if new_blocks is None:
                break  # first come, first served: nobody behind it jumps the queue
            self._note_tokens_in_place(request)
            self.waiting.popleft()
            request.set_status(RequestStatus.RUNNING)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            scheduled.append((request, num_new))
            budget -= num_new
            self._emit_new(request, new_reqs)

        output = SchedulerOutput(new_reqs, cached_reqs, num_scheduled, sum(num_scheduled.values()),
                                 scheduled_spec_decode_tokens=spec_tokens,
                                 finished_req_ids=self._finished_since_last_step, preempted_req_ids=preempted)
        self._finished_since_last_step = set()
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= len(request.all_token_ids) + request.num_output_placeholders:
                # It samples in this step (beyond its known tokens when it verifies drafts: the
                # rejected ones are taken back in update_from_output).
                request.num_output_placeholders += 1
        return output

    def _prompt_budget(self, budget: int, num_decodes: int) -> int:
        """What a step with ``num_decodes`` decodes may add in prompt tokens. Under the mixed-step
        bound, a small chunk (``MIN_MIXED_PROMPT_CHUNK``) still fits, so prompts keep flowing when
        the decodes alone fill the bound."""
        bound = self.config.max_mixed_step_tokens
        if bound is None or num_decodes == 0:
            return budget
        return min(budget, max(bound - num_decodes, MIN_MIXED_PROMPT_CHUNK))

    def _lookahead(self, num_tokens: int) -> int:
        """Lookahead slots for a request that will have ``num_tokens`` computed tokens: never past the
        context limit, so that a request alone in the cache always fits."""
        lookahead = self.config.num_lookahead_tokens
        return max(min(lookahead, self.max_context_len - num_tokens), 0) if lookahead else 0

    def _allocate_or_preempt(self, request: Request, num_new: int, num_scheduled: dict[str, int],
                             preempted: set[str]) -> list[int] | None:
        lookahead = self._lookahead(request.num_computed_tokens + num_new) if self.config.num_lookahead_tokens else 0
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request.request_id, request.all_token_ids, num_new,
                                                              num_lookahead_tokens=lookahead,
                                                              num_computed_tokens=request.num_computed_tokens)
            if new_blocks is not None:
                self._note_tokens_in_place(request)
                return new_blocks
            # The most recently admitted request that this step has not scheduled yet (at worst
            # ``request`` itself, which is running and unscheduled).
            victim = next(r for r in reversed(self.running) if r.request_id not in num_scheduled)
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _note_tokens_in_place(self, request: Request) -> None:
        """After a call to ``allocate_slots``: up to where later steps need none. (Its lookahead
        bound is the largest, so the tokens in place never count slots a step's lookahead needs.)"""
        request.num_tokens_in_place = self.kv_cache_manager.num_tokens_in_place(request.request_id,
                                                                                self.config.num_lookahead_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request.request_id)
        request.set_status(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._workers_know.discard(request.request_id)
        self.waiting.appendleft(request)
        logger.debug("preempted request %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def _emit_new(self, request: Request, new_reqs: list[NewRequestData]) -> None:
        """Adds a scheduled request that the workers do not hold (new, or resumed after preemption)
        to the step's message, with all its blocks. (Those they hold go to the step's
        ``CachedRequestData`` with the blocks they got in the step.)"""
        rid = request.request_id
        self._workers_know.add(rid)
        new_reqs.append(NewRequestData(rid, request.prompt_token_ids, list(request.output_token_ids),
                                       request.sampling_params, self.kv_cache_manager.get_block_ids(rid),
                                       request.num_computed_tokens))

    def update_from_output(self, req_ids: Iterable[str], sampled_token_ids: Iterable[list[int]],
                           logprobs: StepLogprobs | None = None, logprobs_rows: Iterable[int] | None = None,
                           num_verified_drafts: Iterable[int] | None = None) -> list[EngineCoreOutput]:
        """Fills in a step's sampled tokens (per request: one, or with speculative decoding its
        accepted drafts and one more), applies the token-level stop conditions token by token and
        frees the requests they end; returns one output per request that got tokens. A stop ends
        a request at its token: the tokens after it are dropped. ``logprobs``: the step's logprob
        rows, and per request the row of its first token (-1: none); an output refers to its rows
        (as many as it has tokens, so none of the dropped tokens). ``num_verified_drafts``: per
        request, how many drafts the step verified (None: none), whatever drafts the request holds
        now for a later step.

        Requests finished since the step was scheduled are skipped. A request preempted since
        then keeps its tokens: they are part of what it recomputes when it resumes.
        """
        outputs = []
        now = time.time()
        requests = self.requests
        for rid, tokens, first_row, num_drafts in zip(req_ids, sampled_token_ids, logprobs_rows or itertools.repeat(-1),
                                                      num_verified_drafts or itertools.repeat(0)):
            request = requests.get(rid)
            if request is None:
                continue
            if num_drafts:
                self._take_back_rejected(request, num_drafts, len(tokens) - 1)
            # Its own list (outputs of two steps are merged into the first one's; a stop truncates it).
            output = EngineCoreOutput(rid, list(tokens), None if first_row < 0 else (logprobs, first_row))
            if tokens:
                if not request.output_token_ids:  # its first tokens
                    output.num_cached_tokens = max(request.num_cached_tokens, 0)
                    output.first_scheduled_time = request.metrics.first_scheduled_time
                status = request.append_output_tokens(output.new_token_ids, now)
                if status is not None:
                    self.finish_requests(rid, status)
                    output.finish_reason = request.get_finished_reason()
                    output.stop_reason = request.stop_reason
            outputs.append(output)
        return outputs

    def _take_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After a speculative step: the drafts after the ``num_accepted`` accepted ones were computed
        on wrong tokens, so their positions count as uncomputed again (the KV cache manager's too);
        later steps write them over. Only known tokens are ever hashed for the prefix cache, so no
        block holding a rejected draft gets registered."""
        request.spec_token_ids = []
        self._count_verified(num_drafts, num_accepted)
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted
            self.kv_cache_manager.truncate(request.request_id, request.num_computed_tokens)

    def _count_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts_total += 1
        self.num_draft_tokens_total += num_drafts
        self.num_accepted_tokens_total += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1

    def make_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage,
                              stats.queries, stats.hits, self.num_preemptions_total, self.num_drafts_total,
                              self.num_draft_tokens_total, self.num_accepted_tokens_total,
                              list(self.num_accepted_tokens_per_pos))
