"""POST /v1/chat/completions: chat template -> engine -> OpenAI's response or SSE chunks."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from starlette.requests import Request

from novainfer.entrypoints.openai.errors import OpenAIError
from novainfer.entrypoints.openai.logprobs import chat_logprobs
from novainfer.entrypoints.openai.protocol import ChatCompletionChoice, ChatCompletionRequest, \
    ChatCompletionResponse, ChatMessage, ChatResponseMessage, UsageInfo
from novainfer.entrypoints.openai.serving_common import GenerationHandler, ServerContext, check_before_tokenizing, \
    check_lengths, principal_of, sampling_params
from novainfer.entrypoints.openai.served_models import ServedModel
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Roles the chat templates of most models know; OpenAI's newer "developer" is a system message.
_ROLE_ALIASES = {"developer": "system"}


def _apply_template(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # template errors (e.g. "roles must alternate") are the request's fault
        raise OpenAIError(f"the model's chat template rejected the messages: {exc}", param="messages") from None


def render_chat(model: ServedModel, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                special_tokens_in_content: bool = False) -> list[int]:
    """Applies the model's chat template and tokenizes it as the offline ``LLM.chat`` does, except
    that text in a message's content that spells a special token (``<|im_start|>``) stays text,
    unless ``special_tokens_in_content``: only the template's own markers become control tokens.

    For that, the template is rendered with a unique placeholder for each content, and the pieces
    between placeholders (the template's) are tokenized with special tokens parsed, the contents
    with them split as plain text. Messages without such text take the plain path.
    """
    tokenizer = model.tokenizer
    if is_plain_chat(model, messages, special_tokens_in_content):
        return tokenizer.encode(_apply_template(tokenizer, messages, add_generation_prompt), add_special_tokens=False)
    marks = [f"@@content-{secrets.token_hex(8)}@@" for _ in messages]
    text = _apply_template(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)],
                           add_generation_prompt)
    ids: list[int] = []
    for message, mark in zip(messages, marks):
        template_part, found, text = text.partition(mark)
        if not found or mark in text:
            raise OpenAIError("a message's content holds special-token text, and this model's chat template does "
                              "not render content verbatim, so it cannot be kept as plain text; remove it or set "
                              "allow_special_tokens_in_content", param="messages", code="special_tokens_in_content")
        ids += tokenizer.encode(template_part, add_special_tokens=False)
        ids += tokenizer.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
    return ids + tokenizer.encode(text, add_special_tokens=False)


def is_plain_chat(model: ServedModel, messages: list[dict[str, str]], special_tokens_in_content: bool) -> bool:
    """Whether :func:`render_chat` encodes the rendered template as one text (no content spells a
    special token, or such text may become one)."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(f"model '{model.name}' has no chat template; use /v1/completions", param="messages")
    specials = tuple(tokenizer.added_tokens_encoder)
    return special_tokens_in_content or not any(sp in m["content"] for m in messages for sp in specials)


async def tokenize_chat(model: ServedModel, messages: list[dict[str, str]], add_generation_prompt: bool,
                        special_tokens_in_content: bool) -> list[int]:
    """:func:`render_chat`'s token ids; a plain chat's text joins the tokenizer thread's batches."""
    if is_plain_chat(model, messages, special_tokens_in_content):
        [ids] = await model.encode([_apply_template(model.tokenizer, messages, add_generation_prompt)])
        return ids
    return await model.run_tokenizer(render_chat, model, messages, add_generation_prompt, special_tokens_in_content,
                                     size=messages_chars(messages))


def messages_chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in messages]


class ChatHandler(GenerationHandler):
    """One chat completion request, from validation to the last byte."""

    endpoint = "chat"
    kind = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    log = logger
    body: ChatCompletionRequest

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> None:
        super().__init__(ctx, body, request)
        self.messages: list[dict[str, str]] = []
        self._streamed_reply: list[str] = []  # a stream's first choice, kept for its session
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None

    async def _prepare(self, model: ServedModel) -> tuple[list[list[int]], SamplingParams]:
        body = self.body
        history: list[dict[str, str]] = []
        max_tokens = body.effective_max_tokens()
        new_messages = plain_messages(body.messages)
        check_before_tokenizing(messages_chars(new_messages), max_tokens, model.max_model_len, "messages")
        if body.session_id is not None:
            owner = principal_of(self.request)
            lock = self.ctx.sessions.lock(owner, body.session_id)
            await lock.acquire()
            self.scope.add(lock.release)
            session = self.ctx.sessions.get(owner, body.session_id)
            history = list(session.messages) if session is not None else []
        self.messages = history + new_messages
        chars = messages_chars(self.messages)
        check_before_tokenizing(chars, max_tokens, model.max_model_len, "messages")
        prompt = await tokenize_chat(model, self.messages, True, body.allow_special_tokens_in_content)
        check_lengths(len(prompt), max_tokens, model.max_model_len, "messages")
        return [prompt], sampling_params(body, max_tokens, self.top_logprobs)

    def _on_complete(self, model: str, finals: list[RequestOutput]) -> None:
        """Saves the conversation, with the first choice as the reply, if it ended normally."""
        reply = finals[0].outputs[0]
        if self.body.session_id is not None and reply.finish_reason in ("stop", "length"):
            text = "".join(self._streamed_reply) if self.body.stream else reply.text
            self.ctx.sessions.save(principal_of(self.request), self.body.session_id, model,
                                   self.messages + [{"role": "assistant", "content": text}])

    def _response_body(self, model: ServedModel, finals: list[RequestOutput],
                       usage: UsageInfo) -> ChatCompletionResponse:
        [final] = finals
        choices = []
        for c in final.outputs:
            logprobs = None
            if self.top_logprobs is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, self.top_logprobs, model.tokenizer)
            choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.response_id, model=model.name, choices=choices, usage=usage,
                                      session_id=self.body.session_id)

    def _opening_choices(self) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.body.n)]

    def _stream_choices(self, model: ServedModel, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        keep_reply = self.body.session_id is not None
        choices = []
        for c in output.outputs:  # deltas: the tokens, logprobs and text new since the previous output
            if c.index in self._finished:
                continue
            logprobs = None
            if self.top_logprobs is not None and c.logprobs is not None and len(c.logprobs) > 0:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, self.top_logprobs, model.tokenizer)
            if keep_reply and c.index == 0:
                self._streamed_reply.append(c.delta_text)
            if c.delta_text or logprobs is not None:
                choices.append({"index": c.index, "delta": {"content": c.delta_text}, "logprobs": logprobs,
                                "finish_reason": None})
            if c.finish_reason is not None:
                self._finished.add(c.index)
                choices.append({"index": c.index, "delta": {}, "logprobs": None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return choices
