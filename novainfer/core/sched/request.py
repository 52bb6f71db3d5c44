"""A generation request as the scheduler sees it, and its state machine."""

from __future__ import annotations

import enum
import time

from novainfer.outputs import RequestMetrics
from novainfer.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}

_FINISHED = {s for s in RequestStatus if RequestStatus.is_finished(s)}
_ALLOWED_TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS,
                            RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED},
    RequestStatus.WAITING_FOR_REMOTE_KVS: {RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED} | _FINISHED - {RequestStatus.FINISHED_IGNORED},
    # A request preempted while its last token was in flight finishes if that token ends it.
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED,
                              RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED,
                              RequestStatus.FINISHED_IGNORED},
}


class InvalidStatusTransition(RuntimeError):
    pass


class Request:
    """Prompt, sampling parameters, generated tokens, progress and timings of one sequence."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, arrival_time: float | None = None, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # The ids that end it (stop_token_ids and EOS): the parameters' own set, read at every step.
        self.all_stop_token_ids = sampling_params.all_stop_token_ids
        self.max_tokens = max_tokens
        # The length (prompt and outputs) at which it ends: that of max_tokens, capped by the context
        # limit of the scheduler that takes it (``Scheduler.add_request``).
        self.max_num_tokens = len(self.prompt_token_ids) + max_tokens
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose values are not known yet (a step in flight): the
        # scheduler counts them as part of the sequence, and the workers read them on the device.
        self.num_output_placeholders = 0
        # Draft tokens proposed for its next step (speculative decoding); from scheduling until the
        # step's tokens are known, the drafts that step verifies.
        self.spec_token_ids: list[int] = []
        # While running: the most computed tokens its KV blocks take with nothing for the KV cache
        # manager to do but count them (``KVCacheManager.num_tokens_in_place``), so the scheduler
        # skips the manager's call on most steps. Set at each call.
        self.num_tokens_in_place = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.time())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def set_status(self, new_status: RequestStatus) -> None:
        """The only way to change ``status``: illegal transitions raise."""
        if new_status not in _ALLOWED_TRANSITIONS.get(self.status, set()):
            raise InvalidStatusTransition(
                f"request {self.request_id}: illegal status transition {self.status.name} -> {new_status.name}")
        self.status = new_status
        now = time.time()
        if new_status == RequestStatus.RUNNING and self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
        elif RequestStatus.is_finished(new_status):
            self.metrics.finished_time = now

    def append_output_tokens(self, token_ids: list[int], now: float) -> RequestStatus | None:
        """Records a step's sampled tokens (the values of the oldest placeholders), known at ``now``
        (``time.time()``, read once per step by the caller), and applies the token-level stop
        conditions token by token: EOS/stop ids (after ``min_tokens``), then ``max_num_tokens``
        (max_tokens and the context limit). A stop ends it at its token: the tokens after it are
        dropped from ``token_ids`` (in place) and not recorded. Returns the status a stop ends it
        with, None if it goes on. One call per request and step whatever its number of tokens (one
        on nearly every step), with the per-token work in C (set and list operations)."""
        # How many of them it may take: max_num_tokens ends it at the token that reaches it (at its
        # first if it is reached already).
        num_kept = self.max_num_tokens - len(self.all_token_ids)
        status = None
        if num_kept <= len(token_ids):
            status = RequestStatus.FINISHED_LENGTH_CAPPED
            if num_kept < 1:
                num_kept = 1
        if not self.all_stop_token_ids.isdisjoint(token_ids):  # (rare: no per-token loop otherwise)
            stop = self._first_stop(token_ids)
            if stop is not None and stop < num_kept:  # a stop token wins over a limit reached at it
                num_kept, status = stop + 1, RequestStatus.FINISHED_STOPPED
                token = token_ids[stop]
                self.stop_reason = token if token in (self.sampling_params.stop_token_ids or ()) else None
        if status is not None:
            del token_ids[num_kept:]
        num_placeholders = self.num_output_placeholders - len(token_ids)
        self.num_output_placeholders = num_placeholders if num_placeholders > 0 else 0
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        return status

    def _first_stop(self, token_ids: list[int]) -> int | None:
        """The index in ``token_ids`` (the next outputs) of the first stop token that may end the
        request (with ``min_tokens`` reached at it), None if none."""
        stop_ids, num_outputs = self.all_stop_token_ids, len(self.output_token_ids)
        min_tokens = self.sampling_params.min_tokens
        return next((index for index, token in enumerate(token_ids)
                     if token in stop_ids and num_outputs + index + 1 >= min_tokens), None)
