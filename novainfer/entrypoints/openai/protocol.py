"""Request and response bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Requests are strict: unknown fields, wrong JSON types (``"0.5"`` for a number, ``true`` for an
integer) and NaN/Infinity are rejected, each error naming its field. Fields that OpenAI defines but
this server does not implement are declared, so that they are rejected with a message saying
*unsupported* rather than *unknown* (see :meth:`OpenAIRequest.unsupported`).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from novainfer.sampling_params import MAX_LOGPROBS

# A request may ask for at most this many completions per prompt (n): bounds the work one request
# can create; admission control also counts n.
MAX_N = 64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# ---- shared request pieces -------------------------------------------------------------------------
class StreamOptions(StrictModel):
    include_usage: bool = False


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(StrictModel):
    """Sampling fields common to both generation endpoints (OpenAI's, then vLLM's extras)."""

    model: str | None = Field(None, description="served model name; defaults to the first served model")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Declared only to be refused with a clear message.
    logit_bias: dict[str, Any] | None = None

    UNSUPPORTED_IF_SET: ClassVar[tuple[str, ...]] = ("logit_bias",)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value this server does not implement."""
        for name in self.UNSUPPORTED_IF_SET:
            value = getattr(self, name, None)
            if value is not None and value != {} and value != []:
                return name, f"'{name}' is not supported by this server"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "'stream_options' is only allowed when 'stream' is true"
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    session_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$",
                                   description="server-side conversation: stored messages are prepended")
    # Declared only to be refused with a clear message.
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    UNSUPPORTED_IF_SET: ClassVar[tuple[str, ...]] = ("logit_bias", "tools", "functions", "function_call",
                                                     "parallel_tool_calls")

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice is not None and self.tool_choice != "none":
            return "tool_choice", "'tool_choice' is not supported by this server (tools are not supported)"
        if self.response_format is not None and self.response_format != {"type": "text"}:
            return "response_format", ("'response_format' other than {\"type\": \"text\"} is not supported "
                                       "by this server")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "'top_logprobs' requires 'logprobs' to be true"
        return super().unsupported()

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Declared only to be refused with a clear message.
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    UNSUPPORTED_IF_SET: ClassVar[tuple[str, ...]] = ("logit_bias", "suffix")

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "'echo' is not supported by this server"
        if self.best_of is not None and self.best_of > 1:
            return "best_of", "'best_of' > 1 is not supported by this server"
        return super().unsupported()

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class _GenerationResponse(BaseModel):
    """The fields of both generation responses; each narrows ``object`` and ``choices`` (in place)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[Any]
    usage: UsageInfo


class ChatCompletionResponse(_GenerationResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    session_id: str | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_GenerationResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "novainfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    created: int
    last_used: int
    num_messages: int


class SessionDetail(SessionInfo):
    messages: list[dict[str, str]]


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionInfo] = Field(default_factory=list)


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


class HealthResponse(BaseModel):
    status: str


class VersionResponse(BaseModel):
    version: str
