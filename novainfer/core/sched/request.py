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
        # The ids that end it (stop_token_ids and EOS): the parameters' own set, read once per token.
        self.all_stop_token_ids = sampling_params.all_stop_token_ids
        self.max_tokens = max_tokens
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

    def append_output_token(self, token_id: int, now: float) -> None:
        """Records a sampled token (the value of the oldest placeholder, if any), known at ``now``
        (``time.time()``, read once per step by the caller)."""
        if self.num_output_placeholders:
            self.num_output_placeholders -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
