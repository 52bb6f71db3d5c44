"""Backpressure: a bounded waiting queue per model and an optional per-client concurrency limit.

A request is admitted only if, with its sequences (prompts x n) and prompt tokens added, the
model's waiting queue stays within ``max_waiting_requests`` and ``max_queued_prompt_tokens``;
otherwise it is refused with 429 and ``Retry-After``. A request that could never fit (more
sequences or tokens than the bound itself) is a 400 instead: retrying would not help.

Admitted work is *reserved* here until the engine has seen it, so a burst of requests arriving
between two engine steps cannot overrun the bound.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from novainfer.engine.async_llm_engine import AsyncLLMEngine
from novainfer.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)


@dataclass
class AdmissionLimits:
    max_waiting_requests: int = 512
    max_queued_prompt_tokens: int | None = None
    max_concurrent_per_client: int | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        for name in ("max_queued_prompt_tokens", "max_concurrent_per_client"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")


class Ticket:
    """One admitted request: holds its reservation and its client's concurrency slot until released."""

    def __init__(self, controller: AdmissionController, model: str, client: str | None, seqs: int,
                 tokens: int) -> None:
        self._controller = controller
        self.model = model
        self.client = client
        self._seqs = seqs
        self._tokens = tokens
        self._released = False

    def submitted(self, seqs: int, tokens: int) -> None:
        """Part of the request reached the engine, which now counts it itself."""
        seqs, tokens = min(seqs, self._seqs), min(tokens, self._tokens)
        self._seqs -= seqs
        self._tokens -= tokens
        self._controller._unreserve(self.model, seqs, tokens)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._controller._unreserve(self.model, self._seqs, self._tokens)
        self._seqs = self._tokens = 0
        self._controller._release_client(self.client)


class AdmissionController:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._reserved_seqs: Counter[str] = Counter()
        self._reserved_tokens: Counter[str] = Counter()
        self._per_client: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # by reason, for metrics

    def _too_many(self, reason: str, message: str) -> OpenAIError:
        self.rejected[reason] += 1
        return OpenAIError(message, 429, code=reason, headers={"Retry-After": str(self.limits.retry_after_s)})

    def admit(self, model: str, engine: AsyncLLMEngine, client: str | None, num_seqs: int,
              num_prompt_tokens: int) -> Ticket:
        """Admits a request or raises OpenAIError (429 overloaded, 400 never admissible)."""
        limits = self.limits
        if num_seqs > limits.max_waiting_requests:
            raise OpenAIError(f"the request needs {num_seqs} sequences (prompts x n) but this server queues at "
                              f"most {limits.max_waiting_requests}", param="n", code="request_too_large")
        if limits.max_queued_prompt_tokens is not None and num_prompt_tokens > limits.max_queued_prompt_tokens:
            raise OpenAIError(f"the request has {num_prompt_tokens} prompt tokens (prompts x n) but this server "
                              f"queues at most {limits.max_queued_prompt_tokens}", param="prompt",
                              code="request_too_large")
        if client is not None and limits.max_concurrent_per_client is not None \
                and self._per_client[client] >= limits.max_concurrent_per_client:
            raise self._too_many("client_concurrency_limit",
                                 f"too many concurrent requests from this client (limit "
                                 f"{limits.max_concurrent_per_client}); retry later")
        load = engine.get_load()
        waiting = load.num_waiting + self._reserved_seqs[model]
        if waiting + num_seqs > limits.max_waiting_requests:
            raise self._too_many("queue_full", f"server overloaded: {waiting} sequences are waiting for model "
                                               f"'{model}' (limit {limits.max_waiting_requests}); retry later")
        if limits.max_queued_prompt_tokens is not None:
            tokens = load.num_waiting_prompt_tokens + self._reserved_tokens[model]
            if tokens + num_prompt_tokens > limits.max_queued_prompt_tokens:
                raise self._too_many("queue_full", f"server overloaded: {tokens} prompt tokens are waiting for "
                                                   f"model '{model}' (limit {limits.max_queued_prompt_tokens}); "
                                                   f"retry later")
        self._reserved_seqs[model] += num_seqs
        self._reserved_tokens[model] += num_prompt_tokens
        if client is not None:
            self._per_client[client] += 1
        return Ticket(self, model, client, num_seqs, num_prompt_tokens)

    def _unreserve(self, model: str, seqs: int, tokens: int) -> None:
        self._reserved_seqs[model] -= seqs
        self._reserved_tokens[model] -= tokens
        if self._reserved_seqs[model] <= 0:
            del self._reserved_seqs[model]
        if self._reserved_tokens[model] <= 0:
            del self._reserved_tokens[model]

    def _release_client(self, client: str | None) -> None:
        if client is None:
            return
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]
