"""What the scheduler tells the workers to run in one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from novainfer.sampling_params import SamplingParams


# The value of a draft token that stays on the device where the draft model proposed it: the
# scheduler counts such drafts, the workers read their values there.
DEVICE_DRAFT_TOKEN = -1


@dataclass
class NewRequestData:
    """A request the workers have not seen yet, or one resumed after preemption (recomputed)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The requests the workers already hold, as columns (entry i is request ``req_ids[i]``): only
    what changed since the last step. One object per step rather than one per request: a decode
    step of hundreds of requests builds and sends three lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # the blocks each got in this step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens computed this step (1 for a decode, 1 + its drafts for a speculative decode,
    # k for a prefill chunk)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> the draft tokens a speculative decode verifies (they follow its last known token);
    # only requests with drafts appear.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests finished (or aborted) since the last step: workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: workers drop them from the batch but keep their RNG.
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
