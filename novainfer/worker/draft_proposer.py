"""Draft-model proposals for speculative decoding, run by the target's worker after each step.

The draft model has a paged KV cache of its own (one tensor pair per draft layer), addressed by the
target's block tables: a request's block ``b`` holds the target's K/V of its tokens in the target's
cache and the draft's K/V of the same tokens in the draft's. Block accounting, prefix caching,
preemption and freeing are therefore the target's, unchanged; the cache budget counts a block's
bytes in both caches. The scheduler keeps ``num_speculative_tokens`` lookahead slots past each
request's scheduled tokens, where the draft writes the K/V of its proposals.

After every step the draft runs in two parts:

1. Catch-up: one varlen forward over each scheduled request's known tokens that the draft has not
   computed: a prompt chunk the target just computed (the draft keeps pace with the target, so a
   block the prefix cache shares holds valid draft K/V too), or, for a request that sampled, its
   newly accepted tokens up to and including its newest one, whose logits give the first draft.
   Rejected drafts' positions are written over here.
2. Proposal: ``num_speculative_tokens - 1`` one-token forwards, each feeding the previous argmax
   (taken on the device), over the requests that sampled: one chain, which replays a single CUDA
   graph for the whole proposal where one fits. Drafts are greedy: the proposal distribution q is
   one-hot, as for n-gram drafts.

The drafts' positions are not counted as computed by the draft: the next catch-up recomputes those
that the target accepted (a few tokens per request, in the one forward that also feeds the newest
token). Drafts stay on the device (:class:`DeviceDrafts`): the host learns only how many each request
got, and the step that verifies them reads their values there, so it is launched right behind the
draft's forwards without waiting for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from novainfer.sample.state import copy_to_device
from novainfer.worker.model_runner import DeviceDrafts

if TYPE_CHECKING:
    from novainfer.core.sched.output import SchedulerOutput
    from novainfer.worker.model_runner import CachedRequestState, ModelRunner


# The largest batch a chain graph is captured for; larger proposals replay decode graphs per forward.
MAX_CHAIN_GRAPH_SEQS = 64


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

    def propose(self, target: ModelRunner, so: SchedulerOutput, sampled_req_ids: Sequence[str]) -> DeviceDrafts:
        """Runs the draft after a step of ``target`` whose sampled tokens are on the host; returns the
        drafts of each request of ``sampled_req_ids``, in that order, on the device (fewer than k
        where its KV slots end, none while more requests run than ``disable_by_batch_size``)."""
        sampled = set(sampled_req_ids)
        states = [target.requests[rid] for rid in so.num_scheduled_tokens]
        capacity = np.fromiter((s.num_blocks for s in states), np.int64, len(states)) * target.block_size
        # A request that sampled knows its newest token, which the draft computes too; any other one
        # computed a prompt chunk, which the draft computes in turn. Never past the request's slots.
        ends = np.minimum([len(s.token_ids) if s.req_id in sampled else s.num_computed_tokens for s in states],
                          capacity)
        begins = np.fromiter((s.num_draft_computed_tokens for s in states), np.int64, len(states))
        keep = ends > begins
        states = [s for s, k in zip(states, keep) if k]
        capacity, ends, begins = capacity[keep], ends[keep], begins[keep]
        if not states:
            return self._no_drafts(sampled_req_ids)
        # Drafts of a request that sampled and whose newest token the draft computes: forward j
        # writes position end - 1 + j, which needs a slot.
        proposes = [s.req_id in sampled and end == len(s.token_ids) for s, end in zip(states, ends.tolist())]
        num_drafts = np.where(proposes, np.minimum(self.k, capacity - ends + 1), 0)
        if self.disable_by_batch_size is not None and len(target.requests) > self.disable_by_batch_size:
            num_drafts[:] = 0
        first = self._catch_up(target, states, begins, ends, num_drafts > 0)
        proposing = np.flatnonzero(num_drafts > 0)
        drafts = self._propose(target, [states[i] for i in proposing], ends[proposing], num_drafts[proposing], first)
        # Rows in the order of sampled_req_ids; a request without drafts reads the last row (none).
        row_of = {states[i].req_id: row for row, i in enumerate(proposing.tolist())}
        rows = np.fromiter((row_of.get(rid, len(proposing)) for rid in sampled_req_ids), np.int64,
                           len(sampled_req_ids))
        counts = np.append(num_drafts[proposing], 0)[rows]
        (rows_d,) = copy_to_device([rows], drafts.device)
        return DeviceDrafts(list(sampled_req_ids), counts.tolist(), drafts[rows_d])

    def _no_drafts(self, req_ids: Sequence[str]) -> DeviceDrafts:
        return DeviceDrafts(list(req_ids), [0] * len(req_ids), self._empty_rows(len(req_ids)))

    def _empty_rows(self, num_rows: int) -> torch.Tensor:
        """Rows of the drafts table that hold none (-1)."""
        return torch.full((num_rows, self.k), -1, dtype=torch.int64, device=self.runner.device)

    def _catch_up(self, target: ModelRunner, states: list[CachedRequestState], begins: np.ndarray,
                  ends: np.ndarray, proposing: np.ndarray) -> torch.Tensor:
        """The catch-up forward; returns the first draft of each proposing request (device)."""
        query_lens = ends - begins
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        input_ids = np.concatenate([np.asarray(s.token_ids[b:e], dtype=np.int64)
                                    for s, b, e in zip(states, begins.tolist(), ends.tolist())])
        logits_indices = (np.cumsum(query_lens) - 1)[proposing]
        first = self.runner.greedy_step(input_ids, query_lens, begins, self._block_tables(target, rows, ends),
                                        logits_indices)
        for state, end in zip(states, ends.tolist()):
            state.num_draft_computed_tokens = end
        return first

    def _propose(self, target: ModelRunner, states: list[CachedRequestState], ends: np.ndarray,
                 num_drafts: np.ndarray, first: torch.Tensor) -> torch.Tensor:
        """The drafts of the proposing requests ``states``: their first ones (``first``, from the
        catch-up), then one chain of one-token forwards (see ``ModelRunner.greedy_chain``). Returns
        [len(states) + 1, k] on the device, row i those of ``states[i]`` and a last row of none
        (-1); entries past a request's ``num_drafts`` are meaningless."""
        none = self._empty_rows(1)
        if not states:
            return none
        parts = [first.unsqueeze(1)]
        if self.k > 1:
            # Forward j feeds draft j at position end - 1 + j (its KV slot) and gives draft j + 1.
            num_forwards = num_drafts - 1
            rows = np.fromiter((s.row for s in states), np.int64, len(states))
            parts.append(self.runner.greedy_chain(first, np.arange(len(states)), ends, num_forwards, self.k - 1,
                                                  self._block_tables(target, rows, ends + num_forwards)))
        return torch.cat([torch.cat(parts, dim=1), none])

    @staticmethod
    def _block_tables(target: ModelRunner, rows: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """The target's block table rows of the given requests, as wide as the longest sequence needs."""
        width = max(-(-int(seq_lens.max()) // target.block_size), 1)
        return target.block_table_rows[rows, :width]
