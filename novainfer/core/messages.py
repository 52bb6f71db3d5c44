"""The messages between the front-end (tokenization, n>1 fan-out, detokenization, stop strings,
RequestOutputs) and the engine core (scheduler, KV cache manager, executor).

The core takes :class:`EngineCoreRequest` s (one per sequence: a request with ``n`` > 1 arrives as
``n`` of them) and aborts, and returns one :class:`EngineCoreOutputs` per step, holding one
:class:`EngineCoreOutput` per request that got tokens or finished in that step. Outputs are deltas:
nothing in them grows with the length of a request. They are msgspec structs, so that the same
objects cross a process boundary as compact msgpack (see ``novainfer.engine.serial``).
"""

from __future__ import annotations

from typing import Any

import msgspec


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
    # Per new token, when the request asked for logprobs: (token ids, logprobs, rank of the sampled
    # token); index 0 of the lists is the sampled token, then the top alternatives.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
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
    """Everything one step (or one abort) produced, sent as one message."""

    outputs: list[EngineCoreOutput] = []
    stats: EngineCoreStats | None = None
    timestamp: float = 0.0  # time.time() when the step's tokens were known
