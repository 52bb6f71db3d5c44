"""The engine's per-token logprobs in OpenAI's two formats (chat and legacy completions).

Each engine entry maps token id -> Logprob; the sampled token comes first (with its true rank),
then the top-k alternatives with ranks 1..k (the sampled token appears once even if it is among
them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from novainfer.outputs import Logprob


def _token_text(token_id: int, logprob: Logprob, tokenizer) -> str:
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:k]


def _finite(value: float) -> float:
    # JSON has no -Infinity; a token of probability 0 gets the most negative finite float.
    return value if value > -3.0e38 else -3.0e38


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_k: int,
                  tokenizer) -> dict[str, Any]:
    """A chat choice's ``logprobs`` (``ChatChoiceLogprobs``'s fields) as plain data: a streamed chunk
    is serialized as it is, without building and dumping a model per token."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry.get(token_id) or next(iter(entry.values()))
        text = _token_text(token_id, sampled, tokenizer)
        top = []
        for tid, lp in _top(entry, top_k):
            token = _token_text(tid, lp, tokenizer)
            top.append({"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode("utf-8"))})
        content.append({"token": text, "logprob": _finite(sampled.logprob), "bytes": list(text.encode("utf-8")),
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_k: int,
                        tokenizer, text_offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (``CompletionLogprobs``'s fields) as plain data (see
    :func:`chat_logprobs`)."""
    result: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = text_offset
    for token_id, entry in zip(token_ids, entries):
        sampled = entry.get(token_id) or next(iter(entry.values()))
        text = _token_text(token_id, sampled, tokenizer)
        result["tokens"].append(text)
        result["token_logprobs"].append(_finite(sampled.logprob))
        top = {_token_text(tid, lp, tokenizer): _finite(lp.logprob) for tid, lp in _top(entry, top_k)}
        top.setdefault(text, _finite(sampled.logprob))
        result["top_logprobs"].append(top)
        result["text_offset"].append(offset)
        offset += len(text)
    return result
