"""POST /v1/chat/completions: chat template -> engine -> OpenAI's response or SSE chunks."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from novainfer.entrypoints.openai.errors import OpenAIError, error_body, request_id_of
from novainfer.entrypoints.openai.logprobs import chat_logprobs
from novainfer.entrypoints.openai.protocol import ChatCompletionChoice, ChatCompletionRequest, \
    ChatCompletionResponse, ChatMessage, ChatResponseMessage
from novainfer.entrypoints.openai.serving_common import RequestScope, ServerContext, Submission, check_lengths, \
    engine_failure, new_id, now, sampling_params, submit, usage_of
from novainfer.entrypoints.openai.served_models import ServedModel
from novainfer.entrypoints.openai.streaming import SSE_DONE, ClientDisconnected, SSEResponse, merge_streams, \
    sse_event, unless_disconnected
from novainfer.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Roles the chat templates of most models know; OpenAI's newer "developer" is a system message.
_ROLE_ALIASES = {"developer": "system"}


def render_chat(model: ServedModel, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Applies the model's chat template and tokenizes it exactly as the offline ``LLM.chat`` does."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(f"model '{model.name}' has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # template errors (e.g. "roles must alternate") are the request's fault
        raise OpenAIError(f"the model's chat template rejected the messages: {exc}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in messages]


class ChatHandler:
    """One chat completion request, from validation to the last byte."""

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> None:
        self.ctx = ctx
        self.body = body
        self.request = request
        self.arrival_time = now()
        self.response_id = new_id("chatcmpl")
        self.scope = RequestScope()
        self.messages: list[dict[str, str]] = []
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None

    async def handle(self) -> Response:
        body = self.body
        unsupported = body.unsupported()
        if unsupported is not None:
            raise OpenAIError(unsupported[1], param=unsupported[0], code="unsupported")
        model = self.ctx.models.get(body.model)
        try:
            submission = await self._submit(model)
        except BaseException:
            self.scope.close()
            raise
        if body.stream:
            return SSEResponse(self._stream(submission), on_close=self.scope.close)
        return await self._complete(submission)

    async def _submit(self, model: ServedModel) -> Submission:
        body = self.body
        history: list[dict[str, str]] = []
        if body.session_id is not None:
            lock = self.ctx.sessions.lock(body.session_id)
            await lock.acquire()
            self.scope.add(lock.release)
            session = self.ctx.sessions.get(body.session_id)
            history = list(session.messages) if session is not None else []
        self.messages = history + plain_messages(body.messages)
        prompt = await model.run_tokenizer(render_chat, model, self.messages)
        max_tokens = body.effective_max_tokens()
        check_lengths(len(prompt), max_tokens, model.max_model_len, "messages")
        params = sampling_params(body, max_tokens, self.top_logprobs)
        return await submit(self.ctx, self.request, model, self.response_id, "chat", [prompt], params, body.user,
                            self.arrival_time, self.scope)

    def _save_session(self, model: str, reply: str, finish_reason: str | None) -> None:
        if self.body.session_id is not None and finish_reason in ("stop", "length"):
            self.ctx.sessions.save(self.body.session_id, model,
                                   self.messages + [{"role": "assistant", "content": reply}])

    # ---- non-streaming --------------------------------------------------------------------------
    async def _collect(self, submission: Submission) -> RequestOutput:
        final = None
        async for _, output in merge_streams(submission.streams):
            submission.tracker.on_output(output)
            final = output
        assert final is not None and final.finished
        return final

    async def _complete(self, submission: Submission) -> Response:
        tracker = submission.tracker
        try:
            final = await unless_disconnected(self.request, self._collect(submission))
            return self._response(submission, final)
        except ClientDisconnected:
            tracker.finish("client_disconnected")
            return Response(status_code=499)
        except OpenAIError as err:
            tracker.finish("error", err.status, err.message)
            raise
        except Exception as exc:
            err = engine_failure(exc)
            logger.error("chat request %s failed: %r", tracker.request_id, exc)
            tracker.finish("error", err.status, repr(exc))
            raise err from None
        finally:
            self.scope.close()

    def _response(self, submission: Submission, final: RequestOutput) -> Response:
        model = submission.model
        choices = []
        for c in final.outputs:
            logprobs = None
            if self.top_logprobs is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, self.top_logprobs, model.tokenizer)
            choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
        usage = usage_of([final])
        self._save_session(model.name, final.outputs[0].text, final.outputs[0].finish_reason)
        submission.tracker.set_usage(usage.prompt_tokens, usage.completion_tokens,
                                     usage.prompt_tokens_details.cached_tokens)
        submission.tracker.finish("ok", 200)
        response = ChatCompletionResponse(id=self.response_id, model=model.name, choices=choices, usage=usage,
                                          session_id=self.body.session_id)
        return JSONResponse(response.model_dump())

    # ---- streaming ------------------------------------------------------------------------------
    def _chunk(self, model: str, created: int, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {"id": self.response_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return sse_event(payload)

    async def _stream(self, submission: Submission):
        model = submission.model
        tracker = submission.tracker
        created = int(self.arrival_time)
        n = self.body.n
        status, http_status, error = "ok", 200, None
        try:
            for i in range(n):
                yield self._chunk(model.name, created, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
            reported_logprobs = [0] * n
            finished: set[int] = set()
            final: RequestOutput | None = None
            async for _, output in merge_streams(submission.streams):
                tracker.on_output(output)
                final = output
                for c in output.outputs:
                    if c.index in finished:
                        continue
                    logprobs = None
                    if self.top_logprobs is not None and c.logprobs is not None \
                            and len(c.logprobs) > reported_logprobs[c.index]:
                        start = reported_logprobs[c.index]
                        logprobs = chat_logprobs(c.token_ids[start:], c.logprobs[start:], self.top_logprobs,
                                                 model.tokenizer).model_dump()
                    if c.delta_text or logprobs is not None:
                        if logprobs is not None:
                            reported_logprobs[c.index] = len(c.logprobs)
                        yield self._chunk(model.name, created, [{"index": c.index,
                                                                 "delta": {"content": c.delta_text},
                                                                 "logprobs": logprobs, "finish_reason": None}])
                    if c.finish_reason is not None:
                        finished.add(c.index)
                        yield self._chunk(model.name, created, [{"index": c.index, "delta": {}, "logprobs": None,
                                                                 "finish_reason": c.finish_reason,
                                                                 "stop_reason": c.stop_reason}])
            assert final is not None and final.finished
            usage = usage_of([final])
            tracker.set_usage(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield self._chunk(model.name, created, [], usage=usage.model_dump())
            self._save_session(model.name, final.outputs[0].text, final.outputs[0].finish_reason)
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            status, http_status = "client_disconnected", None
            raise
        except Exception as exc:
            err = exc if isinstance(exc, OpenAIError) else engine_failure(exc)
            status, http_status, error = "error", err.status, repr(exc)
            logger.error("chat stream %s failed: %r", tracker.request_id, exc)
            yield sse_event(error_body(err, request_id_of(self.request)))
            yield SSE_DONE
        finally:
            tracker.finish(status, http_status, error)
            self.scope.close()
