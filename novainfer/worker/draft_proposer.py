"""Draft-model proposals for speculative decoding, run by the target's worker after each step.

The draft model has a paged KV cache of its own (one tensor pair per draft layer), addressed by the
target's block tables: a request's block ``b`` holds the target's K/V of its tokens in the target's
cache and the draft's K/V of the same tokens in the draft's. Block accounting, prefix caching,
preemption and freeing are therefore the target's, unchanged; the cache budget counts a block's
bytes in both caches. The scheduler keeps ``num_speculative_tokens`` lookahead slots past each
request's scheduled tokens, where the draft writes the K/V of its proposals.

After every step after which it proposes (at most ``disable_by_batch_size`` requests running) the
draft runs in two parts; after the others it computes nothing, and the next catch-up computes every
token it skipped (see ``ModelRunner.draft_kv_blocks`` for blocks the prefix cache shares meanwhile):

1. Catch-up (:meth:`DraftModelProposer.catch_up`), queued right behind the step, before its tokens
   reach the host: one varlen forward over each scheduled request's tokens that the draft has not
   computed: those it skipped, a prompt chunk the target just computed and, for a request that
   sampled, every token the step may have given it (its drafts and one more), read from the step's
   tokens on the device. Only the host learns later how many of them are real (the accepted drafts
   and the token after them); the positions past those hold K/V of other tokens, counted as not
   computed, which later forwards write over. The argmax at each request's newest token is taken on the device,
   whose row the step's accepted count gives there.
2. Proposal (:meth:`DraftModelProposer.propose`), once the step's tokens are on the host: the first
   draft is that argmax, and ``num_speculative_tokens - 1`` one-token forwards follow, each feeding
   the previous argmax (taken on the device), over the requests that sampled: one chain, which
   replays a single CUDA graph for the whole proposal where one fits. Drafts are greedy: the
   proposal distribution q is one-hot, as for n-gram drafts.

So the device goes from the step to the catch-up without waiting for the host, which meanwhile
fetches the step's tokens and stages the chain.

The drafts' positions are not counted as computed by the draft: the next catch-up recomputes those
that the target accepted (a few tokens per request, in the one forward that also feeds the newest
token). Drafts stay on the device (:class:`DeviceDrafts`): the host learns only how many each request
got, and the step that verifies them reads their values there, so it is launched right behind the
draft's forwards without waiting for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from novainfer.sample.state import copy_to_device
from novainfer.worker.input_buffers import LogitsShift
from novainfer.worker.model_runner import DeviceDrafts

if TYPE_CHECKING:
    from novainfer.core.sched.output import SchedulerOutput
    from novainfer.worker.model_runner import CachedRequestState, ModelRunner, SampledStep


# The largest batch a chain graph is captured for; larger proposals replay decode graphs per forward.
MAX_CHAIN_GRAPH_SEQS = 64


@dataclass
class CatchUp:
    """A launched catch-up forward, for the proposal that follows once the step's tokens are known."""

    states: list[CachedRequestState]  # the requests it computed, in its order
    known: np.ndarray  # per request: its known tokens when the step was launched
    ends: np.ndarray  # per request: the end of the positions it computed
    certain: np.ndarray  # per request: whether those are all its tokens (it verified no drafts)
    capacity: np.ndarray  # per request: its KV slots
    # Per request: its row of ``tokens``, the argmax at its newest token (-1: none kept).
    first_rows: np.ndarray
    tokens: torch.Tensor | None  # the kept argmaxes, on the device


class DraftModelProposer:
    def __init__(self, draft_runner: ModelRunner, num_speculative_tokens: int,
                 disable_by_batch_size: int | None = None) -> None:
        """``draft_runner``: the draft model's runner (its model, KV cache, step buffers, graphs)."""
        self.runner = draft_runner
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size

    def chain_graphs(self, max_num_seqs: int) -> dict[str, int]:
        """What the draft runner captures for the proposals (``ModelRunner.capture_model``'s chain
        arguments): chains of k - 1 forwards, for as many requests as may get drafts (at most
        MAX_CHAIN_GRAPH_SEQS: each graph keeps its batch's logits)."""
        limit = min(max_num_seqs, MAX_CHAIN_GRAPH_SEQS)
        if self.disable_by_batch_size is not None:
            limit = min(limit, self.disable_by_batch_size)
        return {"chain_length": self.k - 1, "max_chain_seqs": limit}

    def catch_up(self, target: ModelRunner, so: SchedulerOutput, step: SampledStep | None,
                 proposes: bool = True) -> CatchUp | None:
        """Queues the catch-up after a step of ``target`` that is launched, its sampled tokens
        (``step``) still on the device; None where it computes nothing. After a step that proposes
        nothing (not ``proposes``: one left in flight; or more requests run than
        ``disable_by_batch_size``) it computes nothing: the draft lags until proposals resume, then
        computes every token it missed (a large batch's steps cost what they cost without it)."""
        if not proposes or (self.disable_by_batch_size is not None
                            and len(target.requests) > self.disable_by_batch_size):
            return None
        sampled = step.rows if step is not None else {}
        states = [target.requests[rid] for rid in so.num_scheduled_tokens]
        capacity = np.fromiter((s.num_blocks for s in states), np.int64, len(states)) * target.block_size
        known = np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
        # A request that sampled may have got as many tokens as it verified drafts, and one more.
        may_get = np.fromiter(((1 + (step.num_drafts[sampled[s.req_id]] if step.speculative else 0))
                               if s.req_id in sampled else 0 for s in states), np.int64, len(states))
        # A request that did not sample computed a prompt chunk, which the draft computes in turn.
        computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        ends = np.minimum(np.where(may_get > 0, known + may_get, computed), capacity)  # never past its slots
        begins = np.fromiter((s.num_draft_computed_tokens for s in states), np.int64, len(states))
        ends = begins + self._within_budget(ends - begins)
        keep = ends > begins
        states = [s for s, k in zip(states, keep) if k]
        known, ends, capacity, begins, may_get = known[keep], ends[keep], capacity[keep], begins[keep], may_get[keep]
        if not states:
            return None
        query_lens = ends - begins
        # The argmax at a request's newest token, the first draft: its row is that of its first new
        # token, moved on the device by how many more it got (within what was computed).
        keeps = (may_get > 0) & (ends > known)
        starts = np.cumsum(query_lens) - query_lens
        logits_indices = (starts + known - begins)[keeps]
        first_rows = np.where(keeps, np.cumsum(keeps) - 1, -1)
        input_ids, sources = self._catch_up_inputs(states, begins, ends, known, sampled, step)
        shift = self._newest_token_shift(step, [s for s, k in zip(states, keeps) if k], (ends - known)[keeps],
                                         may_get[keeps])
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        # A row's entries past its new tokens are -1 (taken as 0): read only at positions counted as
        # not computed.
        source_tokens = step.device_token_rows if sources is not None else None
        tokens = self.runner.greedy_step(input_ids, query_lens, begins, self._block_tables(target, rows, ends),
                                         logits_indices, sources, source_tokens, shift)
        return CatchUp(states, known, ends, may_get <= 1, capacity, first_rows, tokens)

    def _within_budget(self, query_lens: np.ndarray) -> np.ndarray:
        """Each request's share of ``query_lens`` that fits the draft's step buffers, in order: after
        steps it skipped, a request may lag by many tokens; one that does not fit catches up over
        the next steps, without drafts meanwhile."""
        budget = self.runner.max_step_tokens
        return np.clip(budget - (np.cumsum(query_lens) - query_lens), 0, query_lens)

    def _newest_token_shift(self, step: SampledStep | None, states: list[CachedRequestState],
                            num_computed_new: np.ndarray, may_get: np.ndarray) -> LogitsShift | None:
        """Moves each logits row of ``states`` (requests that sampled in ``step``, each of which may
        have got ``may_get`` tokens) on the device from its first new token to its newest, within
        the ``num_computed_new`` new positions computed (None where each got one token: a step
        without drafts)."""
        if not states or step.device_num_tokens is None:
            return None
        step_rows = np.fromiter((step.rows[s.req_id] for s in states), np.int64, len(states))
        if _is_identity(step_rows, len(step_rows)) and (num_computed_new >= may_get).all():
            return LogitsShift(step.device_num_tokens)  # each row its request's, whatever it got computed
        rows_d, limits_d = copy_to_device([step_rows, num_computed_new - 1], self.runner.device)
        return LogitsShift(step.device_num_tokens, rows_d, limits_d)

    @staticmethod
    def _catch_up_inputs(states: list[CachedRequestState], begins: np.ndarray, ends: np.ndarray, known: np.ndarray,
                         sampled: dict[str, int], step: SampledStep | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The catch-up's input tokens: each request's known ones from the host, then its new ones,
        taken on the device (``token_sources``: entries of its row of the step's tokens)."""
        width = step.device_token_rows.shape[1] if step is not None else 0
        ids, sources = [], []
        for state, begin, end, num_known in zip(states, begins.tolist(), ends.tolist(), known.tolist()):
            ids.append(np.asarray(state.token_ids[begin:min(end, num_known)], dtype=np.int64))
            sources.append(np.full(len(ids[-1]), -1, np.int64))
            if end > num_known:
                new = np.arange(max(begin, num_known), end) - num_known
                ids.append(np.zeros(len(new), np.int64))
                sources.append(sampled[state.req_id] * width + new)
        return np.concatenate(ids), (np.concatenate(sources) if (ends > known).any() else None)

    def propose(self, target: ModelRunner, catch_up: CatchUp, sampled_req_ids: Sequence[str]) -> DeviceDrafts:
        """The drafts after ``catch_up``, once the step's tokens are on the host: of each request of
        ``sampled_req_ids``, in that order, on the device (fewer than k where its KV slots end)."""
        states, ends = catch_up.states, catch_up.ends
        now_known = np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
        # Positions past a request's real tokens hold K/V of other tokens: not computed. (A step
        # left in flight gives each request one token, which the host may not know yet.)
        for state, end in zip(states, np.where(catch_up.certain, ends, np.minimum(ends, now_known)).tolist()):
            target.mark_draft_kv_blocks(state, state.num_draft_computed_tokens, end)
            state.num_draft_computed_tokens = end
        # A request proposes where the catch-up computed its newest token: forward j writes
        # position known - 1 + j, which needs a slot.
        proposing = np.flatnonzero((catch_up.first_rows >= 0) & (now_known <= ends) & (now_known > catch_up.known))
        num_drafts = np.minimum(self.k, catch_up.capacity[proposing] - now_known[proposing] + 1)
        first = None
        if len(proposing):
            first_rows = catch_up.first_rows[proposing]
            first = catch_up.tokens
            if not _is_identity(first_rows, len(first)):  # some kept argmax does not propose
                (index_d,) = copy_to_device([first_rows], first.device)
                first = first.index_select(0, index_d)
        proposing_states = [states[i] for i in proposing.tolist()]
        drafts = self._propose(target, proposing_states, now_known[proposing], num_drafts, first)
        # Rows in the order of sampled_req_ids; a request without drafts reads a row of none (-1).
        row_of = {state.req_id: row for row, state in enumerate(proposing_states)}
        rows = np.fromiter((row_of.get(rid, len(proposing)) for rid in sampled_req_ids), np.int64,
                           len(sampled_req_ids))
        counts = np.append(num_drafts, 0)[rows]
        if not _is_identity(rows, len(drafts)):
            (rows_d,) = copy_to_device([rows], self.runner.device)
            drafts = torch.cat([drafts, self._empty_rows(1)]).index_select(0, rows_d)
        return DeviceDrafts(list(sampled_req_ids), counts.tolist(), drafts)

    def _empty_rows(self, num_rows: int) -> torch.Tensor:
        """Rows of the drafts table that hold none (-1)."""
        return torch.full((num_rows, self.k), -1, dtype=torch.int64, device=self.runner.device)

    def _propose(self, target: ModelRunner, states: list[CachedRequestState], ends: np.ndarray,
                 num_drafts: np.ndarray, first: torch.Tensor) -> torch.Tensor:
        """The drafts of the proposing requests ``states``: their first ones (``first``, from the
        catch-up), then one chain of one-token forwards (see ``ModelRunner.greedy_chain``). Returns
        [len(states), k] on the device, row i those of ``states[i]``; entries past a request's
        ``num_drafts`` are meaningless."""
        if not states:
            return self._empty_rows(0)
        if self.k == 1:
            return first.unsqueeze(1)
        # Forward j feeds draft j at position end - 1 + j (its KV slot) and gives draft j + 1.
        num_forwards = num_drafts - 1
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        chain = self.runner.greedy_chain(first, np.arange(len(states)), ends, num_forwards, self.k - 1,
                                         self._block_tables(target, rows, ends + num_forwards))
        return torch.cat([first.unsqueeze(1), chain], dim=1)

    @staticmethod
    def _block_tables(target: ModelRunner, rows: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """The target's block table rows of the given requests, as wide as the longest sequence needs."""
        width = max(-(-int(seq_lens.max()) // target.block_size), 1)
        return target.block_table_rows[rows, :width]


def _is_identity(index: np.ndarray, size: int) -> bool:
    """Whether gathering ``index`` from ``size`` rows would give them all, in order (no gather needed)."""
    return len(index) == size and bool((index == np.arange(size)).all())
