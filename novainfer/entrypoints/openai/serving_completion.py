"""POST /v1/completions: prompt(s) -> engine -> OpenAI's legacy completion response or SSE chunks.

``prompt`` may be a string, a list of strings, a list of token ids or a list of token-id lists;
each prompt runs as its own engine request and yields ``n`` choices, numbered
``prompt_index * n + i`` as OpenAI does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from novainfer.entrypoints.openai.errors import OpenAIError, error_body, request_id_of
from novainfer.entrypoints.openai.logprobs import completion_logprobs
from novainfer.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from novainfer.entrypoints.openai.serving_common import RequestScope, ServerContext, Submission, check_lengths, \
    engine_failure, new_id, now, sampling_params, submit, usage_of
from novainfer.entrypoints.openai.served_models import ServedModel
from novainfer.entrypoints.openai.streaming import SSE_DONE, ClientDisconnected, SSEResponse, merge_streams, \
    sse_event, unless_disconnected
from novainfer.outputs import RequestOutput

logger = logging.getLogger(__name__)


def tokenize_prompts(model: ServedModel, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Every prompt of the request as token ids (text is encoded as the engine does)."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif not prompt:
        raise OpenAIError("prompt must not be an empty list", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    token_lists = []
    for p in prompts:
        ids = model.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"prompt token ids must be in [0, {model.vocab_size}), got {bad}", param="prompt")
        token_lists.append(ids)
    return token_lists


class CompletionHandler:
    def __init__(self, ctx: ServerContext, body: CompletionRequest, request: Request) -> None:
        self.ctx = ctx
        self.body = body
        self.request = request
        self.arrival_time = now()
        self.response_id = new_id("cmpl")
        self.scope = RequestScope()

    async def handle(self) -> Response:
        body = self.body
        unsupported = body.unsupported()
        if unsupported is not None:
            raise OpenAIError(unsupported[1], param=unsupported[0], code="unsupported")
        model = self.ctx.models.get(body.model)
        try:
            prompts = await model.run_tokenizer(tokenize_prompts, model, body.prompt)
            for ids in prompts:
                check_lengths(len(ids), body.max_tokens, model.max_model_len, "prompt")
            params = sampling_params(body, body.max_tokens, body.logprobs)
            submission = await submit(self.ctx, self.request, model, self.response_id, "completions", prompts,
                                      params, body.user, self.arrival_time, self.scope)
        except BaseException:
            self.scope.close()
            raise
        if body.stream:
            return SSEResponse(self._stream(submission), on_close=self.scope.close)
        return await self._complete(submission)

    # ---- non-streaming --------------------------------------------------------------------------
    async def _collect(self, submission: Submission) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(submission.streams)
        async for index, output in merge_streams(submission.streams):
            submission.tracker.on_output(output)
            finals[index] = output
        assert all(f is not None and f.finished for f in finals)
        return finals  # type: ignore[return-value]

    async def _complete(self, submission: Submission) -> Response:
        tracker = submission.tracker
        try:
            finals = await unless_disconnected(self.request, self._collect(submission))
            return self._response(submission, finals)
        except ClientDisconnected:
            tracker.finish("client_disconnected")
            return Response(status_code=499)
        except OpenAIError as err:
            tracker.finish("error", err.status, err.message)
            raise
        except Exception as exc:
            err = engine_failure(exc)
            logger.error("completion request %s failed: %r", tracker.request_id, exc)
            tracker.finish("error", err.status, repr(exc))
            raise err from None
        finally:
            self.scope.close()

    def _response(self, submission: Submission, finals: list[RequestOutput]) -> Response:
        model = submission.model
        n = self.body.n
        choices = []
        for prompt_index, final in enumerate(finals):
            for c in final.outputs:
                logprobs = None
                if self.body.logprobs is not None and c.logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs, self.body.logprobs, model.tokenizer)
                choices.append(CompletionChoice(index=prompt_index * n + c.index, text=c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = usage_of(finals)
        submission.tracker.set_usage(usage.prompt_tokens, usage.completion_tokens,
                                     usage.prompt_tokens_details.cached_tokens)
        submission.tracker.finish("ok", 200)
        response = CompletionResponse(id=self.response_id, model=model.name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    # ---- streaming ------------------------------------------------------------------------------
    def _chunk(self, model: str, created: int, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {"id": self.response_id, "object": "text_completion", "created": created,
                                   "model": model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return sse_event(payload)

    async def _stream(self, submission: Submission):
        model = submission.model
        tracker = submission.tracker
        created = int(self.arrival_time)
        n = self.body.n
        top = self.body.logprobs
        status, http_status, error = "ok", 200, None
        try:
            num_choices = len(submission.streams) * n
            reported_logprobs = [0] * num_choices
            text_offsets = [0] * num_choices
            finished: set[int] = set()
            finals: list[RequestOutput | None] = [None] * len(submission.streams)
            async for prompt_index, output in merge_streams(submission.streams):
                tracker.on_output(output)
                finals[prompt_index] = output
                for c in output.outputs:
                    index = prompt_index * n + c.index
                    if index in finished:
                        continue
                    logprobs = None
                    if top is not None and c.logprobs is not None and len(c.logprobs) > reported_logprobs[index]:
                        start = reported_logprobs[index]
                        logprobs = completion_logprobs(c.token_ids[start:], c.logprobs[start:], top,
                                                       model.tokenizer, text_offsets[index]).model_dump()
                    done = c.finish_reason is not None
                    if c.delta_text or logprobs is not None or done:
                        if logprobs is not None:
                            reported_logprobs[index] = len(c.logprobs)
                            text_offsets[index] += sum(len(t) for t in logprobs["tokens"])
                        if done:
                            finished.add(index)
                        yield self._chunk(model.name, created, [{
                            "index": index, "text": c.delta_text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason if done else None}])
            usage = usage_of([f for f in finals if f is not None])
            tracker.set_usage(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield self._chunk(model.name, created, [], usage=usage.model_dump())
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            status, http_status = "client_disconnected", None
            raise
        except Exception as exc:
            err = exc if isinstance(exc, OpenAIError) else engine_failure(exc)
            status, http_status, error = "error", err.status, repr(exc)
            logger.error("completion stream %s failed: %r", tracker.request_id, exc)
            yield sse_event(error_body(err, request_id_of(self.request)))
            yield SSE_DONE
        finally:
            tracker.finish(status, http_status, error)
            self.scope.close()
