"""POST /v1/completions: prompt(s) -> engine -> OpenAI's legacy completion response or SSE chunks.

``prompt`` may be a string, a list of strings, a list of token ids or a list of token-id lists;
each prompt runs as its own engine request and yields ``n`` choices, numbered
``prompt_index * n + i`` as OpenAI does.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request

from novainfer.entrypoints.openai.errors import OpenAIError
from novainfer.entrypoints.openai.logprobs import completion_logprobs
from novainfer.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from novainfer.entrypoints.openai.serving_common import GenerationHandler, ServerContext, check_before_tokenizing, \
    check_lengths, sampling_params
from novainfer.entrypoints.openai.served_models import ServedModel
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)


async def tokenize_prompts(model: ServedModel, prompts: list[str | list[int]]) -> list[list[int]]:
    """Every prompt as token ids. Text is encoded as the engine does: it is the client's own raw
    prompt, so special-token text in it is parsed as special tokens (as vLLM does)."""
    for ids in prompts:  # the client's own ids (the tokenizer's are in range)
        if not isinstance(ids, str) and ids and not (0 <= min(ids) and max(ids) < model.vocab_size):
            bad = next(t for t in ids if not 0 <= t < model.vocab_size)
            raise OpenAIError(f"prompt token ids must be in [0, {model.vocab_size}), got {bad}", param="prompt")
    encoded = iter(await model.encode([p for p in prompts if isinstance(p, str)]))
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


class CompletionHandler(GenerationHandler):
    """One (legacy) completion request, from validation to the last byte."""

    endpoint = "completions"
    kind = "completion"
    id_prefix = "cmpl"
    chunk_object = "text_completion"
    log = logger
    body: CompletionRequest

    def __init__(self, ctx: ServerContext, body: CompletionRequest, request: Request) -> None:
        super().__init__(ctx, body, request)
        # Per streamed choice: the length of its text so far (the logprobs' text offsets).
        self._text_offsets: dict[int, int] = {}

    async def _prepare(self, model: ServedModel) -> tuple[list[list[int]], SamplingParams]:
        body = self.body
        raw = split_prompts(body.prompt)
        for p in raw:  # token-id prompts are checked the same way: one id counts as one character
            check_before_tokenizing(len(p), body.max_tokens, model.max_model_len, "prompt")
        prompts = await tokenize_prompts(model, raw)
        for ids in prompts:
            check_lengths(len(ids), body.max_tokens, model.max_model_len, "prompt")
        return prompts, sampling_params(body, body.max_tokens, body.logprobs)

    def _response_body(self, model: ServedModel, finals: list[RequestOutput], usage: UsageInfo) -> CompletionResponse:
        n = self.body.n
        choices = []
        for prompt_index, final in enumerate(finals):
            for c in final.outputs:
                logprobs = None
                if self.body.logprobs is not None and c.logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs, self.body.logprobs, model.tokenizer)
                choices.append(CompletionChoice(index=prompt_index * n + c.index, text=c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=self.response_id, model=model.name, choices=choices, usage=usage)

    def _stream_choices(self, model: ServedModel, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        n = self.body.n
        top = self.body.logprobs
        choices = []
        for c in output.outputs:  # deltas: the tokens, logprobs and text new since the previous output
            index = prompt_index * n + c.index
            if index in self._finished:
                continue
            logprobs = None
            if top is not None and c.logprobs is not None and len(c.logprobs) > 0:
                offset = self._text_offsets.get(index, 0)
                logprobs = completion_logprobs(c.token_ids, c.logprobs, top, model.tokenizer, offset)
                self._text_offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
            done = c.finish_reason is not None
            if c.delta_text or logprobs is not None or done:
                if done:
                    self._finished.add(index)
                choices.append({"index": index, "text": c.delta_text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason if done else None})
        return choices
