"""What chat and completion requests share: sampling params, length checks, admission, submission,
and :class:`GenerationHandler`, which drives a request to its JSON response or its SSE stream."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from novainfer.engine.async_llm_engine import EngineDeadError, RequestStream, StreamGroup
from novainfer.entrypoints.openai.admission import AdmissionController, Ticket
from novainfer.entrypoints.openai.errors import OpenAIError, error_body, param_from_message, request_id_of
from novainfer.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from novainfer.entrypoints.openai.protocol import SamplingFields, UsageInfo
from novainfer.entrypoints.openai.served_models import ModelRegistry, ServedModel
from novainfer.entrypoints.openai.sessions import RemoteSessionStore, SessionStore
from novainfer.entrypoints.openai.streaming import SSE_DONE, ChunkEvents, ClientDisconnected, SSEResponse, \
    sse_event, unless_disconnected
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ServerContext:
    """Everything a request handler needs, built once per app."""

    models: ModelRegistry
    admission: AdmissionController
    metrics: ServerMetrics
    sessions: SessionStore | RemoteSessionStore
    log_requests: bool = True


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def principal_of(request: Request) -> str:
    """Who made the request: ``key:<digest>`` of its API key, else ``ip:<address>`` (set by the auth
    middleware). Limits, sessions and logs key on it, never on a body field."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise RuntimeError("no principal on the request: the app runs without its auth middleware")
    return principal


# A prompt's characters are bounded before it is tokenized, by this many per token of context:
# generous (tokens of real text average 3 to 5 characters), and cheap to check.
PROMPT_CHARS_PER_TOKEN = 32


def max_prompt_chars(max_model_len: int) -> int:
    return PROMPT_CHARS_PER_TOKEN * max_model_len


def check_before_tokenizing(num_chars: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> None:
    """The bounds that need no tokenization: the prompt's characters and max_tokens alone."""
    limit = max_prompt_chars(max_model_len)
    if num_chars > limit:
        raise OpenAIError(f"'{prompt_param}' has {num_chars} characters; this server accepts at most {limit} "
                          f"({PROMPT_CHARS_PER_TOKEN} per token of the model's {max_model_len}-token context)",
                          param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and max_tokens >= max_model_len:
        raise OpenAIError(f"max_tokens={max_tokens} leaves no room for a prompt in this model's maximum context "
                          f"length of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")


class RequestScope:
    """Cleanup callbacks of one API request, run once (in reverse order) however the request ends."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.closed = False

    def add(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for callback in reversed(self._callbacks):
            try:
                callback()
            except Exception:  # one failing cleanup must not skip the others
                logger.exception("request cleanup failed")


_SAMPLING_NAMES = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                   "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                   "logprobs", "skip_special_tokens", "include_stop_str_in_output")


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams; invalid combinations are 400s naming the field."""
    kwargs = dict(n=body.n, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                  temperature=1.0 if body.temperature is None else body.temperature,
                  top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, stop=body.stop,
                  stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, max_tokens=max_tokens,
                  min_tokens=body.min_tokens, logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
                  include_stop_str_in_output=body.include_stop_str_in_output,
                  # A stream takes what is new at each read; a full response needs only the end.
                  output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY)
    if body.top_k is not None:
        kwargs["top_k"] = body.top_k
    if body.min_p is not None:
        kwargs["min_p"] = body.min_p
    if body.repetition_penalty is not None:
        kwargs["repetition_penalty"] = body.repetition_penalty
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise OpenAIError(f"invalid sampling parameters: {exc}",
                          param=param_from_message(str(exc), _SAMPLING_NAMES)) from None


def check_lengths(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> None:
    """Prompt alone, and prompt plus requested output, must fit in the model's context."""
    if num_prompt_tokens == 0:
        raise OpenAIError("the prompt is empty", param=prompt_param)
    if num_prompt_tokens > max_model_len:
        raise OpenAIError(f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"{num_prompt_tokens} tokens", param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} "
                          f"prompt tokens plus max_tokens={max_tokens} makes {num_prompt_tokens + max_tokens}; "
                          f"lower max_tokens or shorten the prompt", param="max_tokens",
                          code="context_length_exceeded")


@dataclass
class Submission:
    """An admitted request's engine streams (one per prompt) and its bookkeeping."""

    model: ServedModel
    streams: list[RequestStream]
    tracker: RequestTracker
    scope: RequestScope
    arrival_time: float
    engine_ids: list[str] = field(default_factory=list)


async def submit(ctx: ServerContext, request: Request, model: ServedModel, response_id: str, endpoint: str,
                 prompts: list[list[int]], params: SamplingParams, arrival_time: float,
                 scope: RequestScope) -> Submission:
    """Admits the request and hands its prompts to the engine.

    Returns only once the engine has accepted every prompt, so every error here (400, 429, 503) is
    raised before any response byte is sent. On error everything already added is aborted.
    """
    num_tokens = sum(len(p) for p in prompts) * params.n
    num_seqs = len(prompts) * params.n
    try:
        ticket: Ticket = ctx.admission.admit(model.name, model.engine, principal_of(request), num_seqs,
                                             num_tokens)
    except OpenAIError as err:
        if err.status == 429:
            ctx.metrics.requests_rejected.inc(model.name, err.code or "overloaded")
        raise
    scope.add(ticket.release)
    tracker = RequestTracker(ctx.metrics, request_id_of(request) or response_id, model.name, endpoint,
                             arrival_time, ctx.log_requests, response_id=response_id,
                             principal=principal_of(request))
    tracker.set_usage(sum(len(p) for p in prompts), 0, 0)
    scope.add(lambda: tracker.finish("aborted"))  # if nothing reports a better status first
    submission = Submission(model, [], tracker, scope, arrival_time)
    for index, prompt in enumerate(prompts):
        engine_id = response_id if len(prompts) == 1 else f"{response_id}-{index}"
        ticket.submitted(params.n, len(prompt) * params.n)  # from here on the engine counts it
        try:
            stream = await model.engine.add_request(engine_id, {"prompt_token_ids": prompt}, params,
                                                    arrival_time=arrival_time, num_prompt_tokens=len(prompt))
        except (ValueError, TypeError) as exc:
            param = "messages" if endpoint == "chat" else "prompt"
            raise OpenAIError(f"invalid request: {exc}",
                              param=param_from_message(str(exc), _SAMPLING_NAMES) or param) from None
        except EngineDeadError as exc:
            raise OpenAIError(f"the engine of model '{model.name}' is not running: {exc}", 503,
                              code="engine_dead") from None
        submission.streams.append(stream)
        submission.engine_ids.append(engine_id)
        scope.add(stream.abort)
    return submission


def usage_of(finals: list[RequestOutput], completion: int) -> UsageInfo:
    """The usage of a request whose prompts' last outputs are ``finals`` and that generated
    ``completion`` tokens in all."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    cached = sum(o.num_cached_tokens for o in finals)
    usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    usage.prompt_tokens_details.cached_tokens = cached
    return usage


def engine_failure(exc: BaseException) -> OpenAIError:
    """An error while waiting for outputs, as the client sees it."""
    if isinstance(exc, EngineDeadError):
        return OpenAIError(f"the engine failed while serving this request: {exc}", 500, code="engine_dead")
    return OpenAIError("internal server error while generating; the server logged the details", 500)


def now() -> float:
    return time.time()


class GenerationHandler(ABC):
    """One generation request (chat or completion), from validation to the last byte.

    The mechanism is shared; subclasses say what differs: ``_prepare`` (the prompts and sampling
    parameters), ``_response_body`` (the non-streaming response), ``_opening_choices`` and
    ``_stream_choices`` (the choices of the SSE chunks) and ``_on_complete`` (anything to do once
    generation ended well).
    """

    endpoint: ClassVar[str]  # the endpoint as the tracker records it
    kind: ClassVar[str]  # what log lines call the request
    id_prefix: ClassVar[str]  # of the response id
    chunk_object: ClassVar[str]  # the "object" of a streamed chunk
    log: ClassVar[logging.Logger]

    def __init__(self, ctx: ServerContext, body: SamplingFields, request: Request) -> None:
        self.ctx = ctx
        self.body = body
        self.request = request
        self.arrival_time = now()
        self.response_id = new_id(self.id_prefix)
        self.scope = RequestScope()
        self._finished: set[int] = set()  # streamed choices whose last event is out

    async def handle(self) -> Response:
        body = self.body
        unsupported = body.unsupported()
        if unsupported is not None:
            raise OpenAIError(unsupported[1], param=unsupported[0], code="unsupported")
        model = self.ctx.models.get(body.model)
        try:
            prompts, params = await self._prepare(model)
            submission = await submit(self.ctx, self.request, model, self.response_id, self.endpoint, prompts,
                                      params, self.arrival_time, self.scope)
        except BaseException:
            self.scope.close()
            raise
        if body.stream:
            return SSEResponse(self._stream(submission), on_close=self.scope.close)
        return await self._complete(submission)

    @abstractmethod
    async def _prepare(self, model: ServedModel) -> tuple[list[list[int]], SamplingParams]:
        """The request's prompts as token ids, and its sampling parameters; errors are 400s."""

    def _on_complete(self, model: str, finals: list[RequestOutput]) -> None:
        """Called once every prompt's generation has ended, before the response (or [DONE]) is sent."""

    @staticmethod
    def _note(submission: Submission, finals: list[RequestOutput | None],
              batch: list[tuple[int, RequestOutput]]) -> None:
        """Tracks a batch of (prompt index, output) that arrived together (a ``StreamGroup`` batch)
        and keeps each output as its prompt's latest in ``finals``. A stream's outputs are deltas
        (what is new since the previous one); a full response's prompts give one output each, at
        their end."""
        tracker = submission.tracker
        for index, output in batch:
            tracker.on_output(output)
            finals[index] = output

    # ---- non-streaming --------------------------------------------------------------------------
    async def _collect(self, submission: Submission) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(submission.streams)
        async for batch in StreamGroup(submission.streams).batches():
            self._note(submission, finals, batch)
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
            self.log.error("%s request %s failed: %r", self.kind, tracker.request_id, exc)
            tracker.finish("error", err.status, repr(exc))
            raise err from None
        finally:
            self.scope.close()

    def _response(self, submission: Submission, finals: list[RequestOutput]) -> Response:
        model = submission.model
        usage = usage_of(finals, submission.tracker.completion_tokens)
        response = self._response_body(model, finals, usage)
        self._on_complete(model.name, finals)
        submission.tracker.set_usage(usage.prompt_tokens, usage.completion_tokens,
                                     usage.prompt_tokens_details.cached_tokens)
        submission.tracker.finish("ok", 200)
        return JSONResponse(response.model_dump())

    @abstractmethod
    def _response_body(self, model: ServedModel, finals: list[RequestOutput], usage: UsageInfo) -> BaseModel:
        """The non-streaming response, from every prompt's final output."""

    # ---- streaming ------------------------------------------------------------------------------
    def _opening_choices(self) -> list[dict[str, Any]]:
        """The choices of the events that open a stream, before any output (none by default)."""
        return []

    @abstractmethod
    def _stream_choices(self, model: ServedModel, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The choices of the SSE events for one output (a delta) of prompt ``prompt_index``, in
        order (one event per choice); outputs come in the order they arrive."""

    async def _stream(self, submission: Submission) -> AsyncIterator[bytes]:
        model = submission.model
        tracker = submission.tracker
        status, http_status, error = "ok", 200, None
        last = b""  # the events held back to go out with the stream's end
        # The fields of every chunk before its choices.
        head = {"id": self.response_id, "object": self.chunk_object, "created": int(self.arrival_time),
                "model": model.name}
        try:
            finals: list[RequestOutput | None] = [None] * len(submission.streams)
            num_open = len(submission.streams) * self.body.n  # choices not yet finished
            chunks = ChunkEvents(head)
            opening = self._opening_choices()
            if opening:
                yield b"".join([chunks.event(choice) for choice in opening])
            # One wake-up per engine step for all of the request's prompts, and one write of the
            # step's events.
            async for batch in StreamGroup(submission.streams).batches():
                self._note(submission, finals, batch)
                choices = [choice for index, output in batch
                           for choice in self._stream_choices(model, index, output)]
                if not choices:
                    continue
                events = b"".join([chunks.event(choice) for choice in choices])
                num_open -= sum(choice["finish_reason"] is not None for choice in choices)
                if num_open > 0:
                    yield events
                else:  # the last events: written with the usage and [DONE] that follow at once
                    last += events
            done = [f for f in finals if f is not None]
            usage = usage_of(done, tracker.completion_tokens)
            tracker.set_usage(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                last += sse_event({**head, "choices": [], "usage": usage.model_dump()})
            self._on_complete(model.name, done)
            yield last + SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            status, http_status = "client_disconnected", None
            raise
        except Exception as exc:
            err = exc if isinstance(exc, OpenAIError) else engine_failure(exc)
            status, http_status, error = "error", err.status, repr(exc)
            self.log.error("%s stream %s failed: %r", self.kind, tracker.request_id, exc)
            yield last + sse_event(error_body(err, request_id_of(self.request))) + SSE_DONE
        finally:
            tracker.finish(status, http_status, error)
            self.scope.close()
