"""Request and response bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Requests are strict: unknown fields, wrong JSON types (``"0.5"`` for a number, ``true`` for an
integer) and NaN/Infinity are rejected, each error naming its field. Fields that OpenAI defines but
this server does not implement are declared, so that they are rejected with a message saying
*unsupported* rather than *unknown* (see :meth:`OpenAIRequest.unsupported`).
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from novainfer.entrypoints.openai.errors import OpenAIError
from novainfer.sampling_params import MAX_LOGPROBS

# Bounds on what one request may ask for, all checked before any tokenization (each refusal is a
# 400 naming the field and the bound). Prompt text is bounded in characters by the model's
# context (see serving_common.max_prompt_chars).
MAX_N = 64  # completions per prompt (n, best_of); admission control also counts n
MAX_MESSAGES = 1024  # messages of one chat request
MAX_PROMPTS = 64  # prompts of one completion request
MAX_PROMPT_TOKEN_IDS = 1 << 20  # token ids of one prompt (the model's context bounds it further)
MAX_CONTENT_PARTS = 1024  # parts of one chat message's content
MAX_STOP_STRINGS = 16  # OpenAI allows 4
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's bound
MAX_SHORT_STRING = 256  # user, name, model
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_SURROGATE = re.compile("[\ud800-\udfff]")
ShortStr = Annotated[str, Field(max_length=MAX_SHORT_STRING)]


def _json_path(path: str, key: Any) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))


def check_unicode(value: Any, path: str = "") -> None:
    """Raises a 400 naming the JSON path of the first string (key or value) holding a lone surrogate.

    JSON may escape one (``"\\ud800"``) and Python's decoder keeps it, but it is not a character:
    it cannot be encoded, tokenized or logged.
    """
    found = _lone_surrogate_at(value)
    if found is None:
        return
    for key in found:
        path = _json_path(path, key)
    raise OpenAIError(f"'{path or 'body'}' holds invalid Unicode (a lone surrogate code point)",
                      param=path or None, code="invalid_unicode")


_SCALARS = (int, float, bool, type(None))


def _lone_surrogate_at(value: Any) -> list[Any] | None:
    """The keys and indices leading to the first string holding a lone surrogate, or None. The path
    is built only for that string, and numbers are skipped without a call: a body may hold millions
    of token ids, which a walk that called itself and formatted a path for each took a second on."""
    if isinstance(value, str):
        return [] if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return ["<key>"]
        if type(item) in _SCALARS:
            continue
        found = _lone_surrogate_at(item)
        if found is not None:
            return [key, *found]
    return None



def _prompt_shape(value: Any) -> Any:
    """Checks a list prompt's shape and size in one pass that stops at its first bad element. Left to
    the union of the prompt's forms, a list that fits none of them is reported element by element
    for each form (a million errors for a hostile list of a million elements: seconds of the
    server's event loop) before the error even names the problem."""
    if not isinstance(value, list) or not value:
        return value
    first = value[0]
    if type(first) is int:
        _check_token_ids(value, "the prompt")
        return value
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"a list of prompts holds at most {MAX_PROMPTS}, got {len(value)}")
    if isinstance(first, str):
        bad = next((i for i, item in enumerate(value) if not isinstance(item, str)), None)
        if bad is not None:
            raise ValueError(f"element {bad} is not a string, as element 0 is")
    elif isinstance(first, list):
        for index, item in enumerate(value):
            if not isinstance(item, list):
                raise ValueError(f"element {index} is not a list of token ids, as element 0 is")
            _check_token_ids(item, f"prompt {index}")
    else:
        raise ValueError("a prompt is a string, a list of token ids (integers), or a list of up to "
                         f"{MAX_PROMPTS} of either")
    return value


def _check_token_ids(ids: list[Any], what: str) -> None:
    if len(ids) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"{what} has {len(ids)} token ids; at most {MAX_PROMPT_TOKEN_IDS} are accepted")
    bad = next((i for i, token in enumerate(ids) if type(token) is not int), None)
    if bad is not None:
        raise ValueError(f"token {bad} of {what} is not an integer")


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class RequestModel(StrictModel):
    """A request body: on top of strict validation, every string in it must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data


# ---- shared request pieces -------------------------------------------------------------------------
class StreamOptions(StrictModel):
    include_usage: bool = False


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: ShortStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts_count(cls, content: Any) -> Any:
        """Counted before the parts are validated: a long list of bad parts would be reported part
        by part."""
        if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts are accepted, got {len(content)}")
        return content

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(RequestModel):
    """Sampling fields common to both generation endpoints (OpenAI's, then vLLM's extras)."""

    model: ShortStr | None = Field(None, description="served model name; defaults to the first served model")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_STRING_CHARS} characters")
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: ShortStr | None = Field(None, description="accepted for compatibility; limits and sessions key on "
                                                    "the API key (else the address), never on this")
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Declared only to be refused with a clear message.
    logit_bias: dict[str, Any] | None = Field(None, max_length=MAX_LOGIT_BIAS)

    UNSUPPORTED_IF_SET: ClassVar[tuple[str, ...]] = ("logit_bias",)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, stop: Any) -> Any:
        """Counted before the types are checked: a long list of non-strings would be reported
        element by element."""
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stop)}")
        return stop

    @field_validator("stop")
    @classmethod
    def _stop_lengths(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        bad = next((s for s in stops if not 1 <= len(s) <= MAX_STOP_STRING_CHARS), None)
        if bad is not None:
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters, got one of "
                             f"{len(bad)}")
        return stop

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
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    allow_special_tokens_in_content: bool = Field(
        False, description="parse special-token text (e.g. '<|im_start|>') inside message content as control "
                           "tokens; by default it is tokenized as plain text")
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
    prompt: Annotated[str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | list[int] |
                      Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)],
                      BeforeValidator(_prompt_shape)] = Field(
            ..., description="text (special-token text in it is parsed as such), token ids, or a list of either")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Declared only to be refused with a clear message.
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    UNSUPPORTED_IF_SET: ClassVar[tuple[str, ...]] = ("logit_bias", "suffix")

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "'echo' is not supported by this server"
        if self.best_of is not None and self.best_of > 1:
            return "best_of", "'best_of' > 1 is not supported by this server"
        return super().unsupported()

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(RequestModel):
    model: ShortStr | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    allow_special_tokens_in_content: bool = False


class DetokenizeRequest(RequestModel):
    model: ShortStr | None = None
    tokens: list[int]


class SessionCreateRequest(RequestModel):
    model: ShortStr | None = Field(None, description="served model name; defaults to the first served model")


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
