"""The messages between the front-end (tokenization, n>1 fan-out, detokenization, stop strings,
RequestOutputs) and the engine core (scheduler, KV cache manager, executor).

The core takes :class:`EngineCoreRequest` s (one per sequence: a request with ``n`` > 1 arrives as
``n`` of them) and aborts, and returns one :class:`EngineCoreOutputs` per step: flat columns over
the requests that got tokens or finished in that step (the scheduler's per-request
:class:`EngineCoreOutput` s, laid out column by column). Outputs are deltas: nothing in them grows
with the length of a request. They are msgspec structs, so that the same objects cross a process
boundary as compact msgpack (see ``novainfer.engine.serial``); a step's message is a handful of
lists whatever its batch, cheap to encode, to decode and for the collector to ignore.
"""

from __future__ import annotations

import itertools
from operator import itemgetter
from typing import Any

import msgspec

from novainfer.outputs import StepLogprobs


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence to generate. ``sampling_params`` is a SamplingParams in the process that uses it
    (its EOS ids already added) and its wire form while it travels."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    max_tokens: int
    arrival_time: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request got in one step."""

    request_id: str
    new_token_ids: list[int]
    # When the request asked for logprobs: those of its new tokens, as (block, row of the first);
    # the block holds one row per new token from there.
    new_logprobs: tuple[StepLogprobs, int] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it (stop strings are the front-end's)
    # Sent with a request's first output only.
    num_cached_tokens: int = -1
    first_scheduled_time: float | None = None


class EngineCoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's gauges now and totals since start."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Speculative decoding since start: drafts (a request's step with draft tokens), draft tokens
    # verified and accepted (acceptance rate: their ratio; mean accepted length: 1 + accepted per
    # draft), and accepted tokens by draft position (entry i: the (i + 1)-th draft of a step).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos_total: list[int] = []
    step_time_total: float = 0.0  # seconds in step()
    model_time_total: float = 0.0  # seconds of that inside the executor (forward + sampling)
    # Steps and their seconds by what they computed: "decode", "prefill" or "mixed".
    steps_by_kind: dict[str, int] = {}
    step_time_by_kind: dict[str, float] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one step (or one abort) produced, as one message of columns.

    Request ``request_ids[i]`` got ``num_new_tokens[i]`` tokens, the next ones of ``token_ids`` (in
    the order of ``request_ids``). The rarer facts are sparse columns naming requests by their
    index ``i``: the requests that finished, those that got their first tokens, those with logprobs.
    """

    request_ids: list[str] = []
    num_new_tokens: list[int] = []
    token_ids: list[int] = []
    finished: list[int] = []  # indices of the requests that finished in this step
    finish_reasons: list[str] = []  # per finished request: "stop" | "length" | "abort"
    stop_reasons: list[int | None] = []  # per finished request: the stop token id that ended it, if one did
    started: list[int] = []  # indices of the requests whose first tokens these are
    num_cached_tokens: list[int] = []  # per started request
    first_scheduled_times: list[float | None] = []  # per started request
    with_logprobs: list[int] = []  # indices of the requests that asked for logprobs
    # Their logprobs: the step's blocks (one, or more where a message carries several steps), and per
    # request with logprobs the index of its block and the row of its first new token there.
    logprobs_blocks: list[StepLogprobs] = []
    logprobs_block_index: list[int] = []
    logprobs_rows: list[int] = []
    stats: EngineCoreStats | None = None
    timestamp: float = 0.0  # time.time() when the step's tokens were known

    @classmethod
    def from_outputs(cls, outputs: list[EngineCoreOutput], stats: EngineCoreStats | None,
                     timestamp: float) -> EngineCoreOutputs:
        """The columns of per-request outputs (one comprehension per column: this runs on the
        core's critical path, once per step)."""
        if not outputs:
            return cls(stats=stats, timestamp=timestamp)
        # num_cached_tokens is set on a request's first output only.
        rare = [i for i, o in enumerate(outputs)
                if o.finish_reason is not None or o.num_cached_tokens >= 0 or o.new_logprobs is not None]
        finished = [i for i in rare if outputs[i].finish_reason is not None]
        started = [i for i in rare if outputs[i].num_cached_tokens >= 0]
        with_logprobs = [i for i in rare if outputs[i].new_logprobs is not None]
        new_logprobs = [outputs[i].new_logprobs for i in with_logprobs]
        step_blocks = list(map(itemgetter(0), new_logprobs))
        # A step's one block (nearly every step), found by list.count (identity first, in C): blocks
        # that are distinct but equal would pass too, and their rows are the same.
        if not step_blocks or step_blocks.count(step_blocks[0]) == len(step_blocks):
            blocks, block_index = step_blocks[:1], [0] * len(step_blocks)
        else:
            by_id = {id(block): block for block in step_blocks}  # each once, in order
            index_of = {key: index for index, key in enumerate(by_id)}
            blocks, block_index = list(by_id.values()), [index_of[id(block)] for block in step_blocks]
        return cls(request_ids=[o.request_id for o in outputs],
                   num_new_tokens=[len(o.new_token_ids) for o in outputs],
                   token_ids=[token for o in outputs for token in o.new_token_ids],
                   finished=finished, finish_reasons=[outputs[i].finish_reason for i in finished],
                   stop_reasons=[outputs[i].stop_reason for i in finished],
                   started=started, num_cached_tokens=[outputs[i].num_cached_tokens for i in started],
                   first_scheduled_times=[outputs[i].first_scheduled_time for i in started],
                   with_logprobs=with_logprobs, logprobs_blocks=blocks, logprobs_block_index=block_index,
                   logprobs_rows=list(map(itemgetter(1), new_logprobs)),
                   stats=stats, timestamp=timestamp)

    def subset(self, keep: list[int]) -> EngineCoreOutputs:
        """The outputs of requests ``keep`` (ascending indices into ``request_ids``) as a message of
        their own, with this step's stats and timestamp: what one of several front-ends gets."""
        if self.num_new_tokens.count(1) == len(self.request_ids):  # one token each (most steps): token i is request i's
            token_ids = [self.token_ids[i] for i in keep]
        else:
            starts = list(itertools.accumulate(self.num_new_tokens, initial=0))
            token_ids = [t for i in keep for t in self.token_ids[starts[i]:starts[i + 1]]]
        new_index = {old: new for new, old in enumerate(keep)}
        finished = [(new_index[i], reason, stop) for i, reason, stop in
                    zip(self.finished, self.finish_reasons, self.stop_reasons) if i in new_index]
        started = [(new_index[i], cached, when) for i, cached, when in
                   zip(self.started, self.num_cached_tokens, self.first_scheduled_times) if i in new_index]
        with_logprobs = [(new_index[i], block, row) for i, block, row in
                         zip(self.with_logprobs, self.logprobs_block_index, self.logprobs_rows) if i in new_index]
        blocks: dict[int, int] = {}  # index of a block here -> its index in the subset
        block_index = [blocks.setdefault(block, len(blocks)) for _, block, _ in with_logprobs]
        return EngineCoreOutputs(
            request_ids=[self.request_ids[i] for i in keep], num_new_tokens=[self.num_new_tokens[i] for i in keep],
            token_ids=token_ids,
            finished=[f[0] for f in finished], finish_reasons=[f[1] for f in finished],
            stop_reasons=[f[2] for f in finished], started=[s[0] for s in started],
            num_cached_tokens=[s[1] for s in started], first_scheduled_times=[s[2] for s in started],
            with_logprobs=[w[0] for w in with_logprobs], logprobs_blocks=[self.logprobs_blocks[b] for b in blocks],
            logprobs_block_index=block_index, logprobs_rows=[w[2] for w in with_logprobs],
            stats=self.stats, timestamp=self.timestamp)
