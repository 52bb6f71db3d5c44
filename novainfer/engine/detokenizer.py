"""Incremental detokenization: turn a growing stream of token ids into text.

Decoding the whole output again after every token costs O(n) per step. A fast tokenizer is
decoded by the tokenizers library's streaming decoder (``tokenizers.decoders.DecodeStream``): one
call into Rust per step, whatever the number of new tokens, which keeps its own small window.
Other tokenizers go through the same algorithm in Python: we keep only a small window of token
ids, split by ``read_offset``:

* ``window[:read_offset]``: context tokens, whose text was emitted by the
  previous step (or that are the tail of the prompt). They are decoded again
  because how a token decodes can depend on its left neighbour (SentencePiece
  drops the leading space of the first token it decodes).
* ``window[read_offset:]``: tokens whose text has not been emitted yet.

Each step decodes ``window`` and ``window[:read_offset]``; the new text is the
difference. When it ends with U+FFFD the last token ended inside a UTF-8
character (byte-level BPE splits multi-byte characters across tokens), so
nothing is emitted and the window keeps growing until later tokens complete
the character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Number of prompt tokens used as left context for the first output tokens, so
# that e.g. a leading space of the first generated word is kept.
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes the output tokens of one request, a few tokens at a time.

    The concatenation of all strings returned by :meth:`add_tokens` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`` for tokenizers whose decoding does
    not depend on left context (byte-level BPE such as Qwen2, GPT-2), except
    that an incomplete UTF-8 character at the very end is never emitted.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        token_texts: TokenTexts | None = None,
    ) -> None:
        """``token_texts``: single-token texts (a shared cache), which mostly saves decoding the
        prompt's tail to check that it ends on a whole character."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        # A fast tokenizer's Rust backend decodes without the Python wrapper's per-call
        # conversions (most of the cost for a few ids); it has no spaces_between_special_tokens
        # option, and the wrapper ignores that option for fast tokenizers too.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._window: list[int] = context
        self._read_offset = len(context)
        # A prompt that ends inside a UTF-8 character would make the context
        # text and the context-plus-output text disagree on their common part,
        # so such a prompt is not used as context.
        whole = token_texts is not None and token_texts.ends_on_character(context)
        if not whole and self._decode(context).endswith(_REPLACEMENT_CHAR):
            self._window = []
            self._read_offset = 0
        self._context = list(self._window)
        self._stream = _decode_stream(self._backend, self._window, skip_special_tokens)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends output tokens and returns the text they complete.

        Returns ``""`` when the tokens produce no text yet: they end inside a
        multi-byte character (the text is returned once later tokens complete
        it) or they are special tokens being skipped.
        """
        if not token_ids:
            return ""
        if self._stream is not None:
            return self._stream.step(self._backend, list(token_ids)) or ""
        self._window.extend(token_ids)

        prefix_text = self._decode(self._window[: self._read_offset])
        full_text = self._decode(self._window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""

        new_text = full_text[len(prefix_text) :]
        # The tokens just emitted become the context of the next step; older
        # context is no longer needed.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return new_text

    def decode_output(self, token_ids: Sequence[int]) -> str:
        """The text :meth:`add_tokens` emits for ``token_ids`` fed from the start in any chunks,
        in one decode: that of the longest prefix whose text does not end inside a character
        (usually all of them; a few more decodes when the output ends inside one)."""
        ids = self._context + list(token_ids)
        context_text = self._decode(self._context)
        for end in range(len(ids), len(self._context), -1):
            text = self._decode(ids[:end])
            if not text.endswith(_REPLACEMENT_CHAR):
                return text[len(context_text):]
        return ""

    @staticmethod
    def decode_outputs(requests: Sequence[tuple[IncrementalDetokenizer, Sequence[int]]]) -> list[str]:
        """:meth:`decode_output` of each (detokenizer, token ids) pair, with the decodes of fast
        tokenizers made in batched calls (one per backend and special-token setting): the tokenizers
        library decodes a batch without holding the GIL, on several threads. A text that ends inside
        a character is redone by :meth:`decode_output` alone."""
        texts: list[str | None] = [None] * len(requests)
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (detokenizer, _) in enumerate(requests):
            if detokenizer._backend is not None:
                groups.setdefault((id(detokenizer._backend), detokenizer._skip_special_tokens), []).append(i)
        for members in groups.values():
            first = requests[members[0]][0]
            backend, skip = first._backend, first._skip_special_tokens
            contexts = [requests[i][0]._context for i in members]
            whole = backend.decode_batch([context + list(requests[i][1]) for i, context in zip(members, contexts)],
                                         skip_special_tokens=skip)
            context_texts = backend.decode_batch(contexts, skip_special_tokens=skip)
            for i, text, context_text in zip(members, whole, context_texts):
                if not text.endswith(_REPLACEMENT_CHAR):
                    texts[i] = text[len(context_text):]
        return [text if text is not None else detokenizer.decode_output(token_ids)
                for text, (detokenizer, token_ids) in zip(texts, requests)]

    def _decode(self, token_ids: list[int]) -> str:
        # Cleanup of tokenization spaces looks across token boundaries, so
        # applying it to windows would not add up to applying it to the whole
        # text; it is disabled (the backend never applies it).
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def _decode_stream(backend: Any, context: list[int], skip_special_tokens: bool) -> Any:
    """A streaming decoder primed with ``context``, or None where the tokenizers library has none
    that takes a context and several ids per step (before 0.22) or the tokenizer is not a fast one."""
    if backend is None or DecodeStream is None:
        return None
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None


class TokenTexts:
    """The text of single tokens (the alternatives of logprobs), decoded once per token id: a
    step with logprobs asks for several per request, mostly of tokens seen before."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        # The Rust backend skips the wrapper's per-call conversions; the wrapper's clean-up of
        # tokenization spaces (which the backend lacks) can change a single token's text.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend
        self._texts: dict[int, str] = {}
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def ends_on_character(self, token_ids: Sequence[int]) -> bool:
        """Whether the text of ``token_ids`` surely ends on a whole character, from the last token
        alone: an ordinary token whose own text has no replacement character is whole characters
        (its bytes are valid on their own), and it is the end of the text whatever comes before it.
        False where that cannot be told so (then decode to know)."""
        if not token_ids or token_ids[-1] in self._special_ids:  # a skipped special token ends nothing
            return False
        return _REPLACEMENT_CHAR not in self([token_ids[-1]])[0]

    def __call__(self, token_ids: Sequence[int]) -> list[str]:
        texts = self._texts
        missing = [t for t in dict.fromkeys(token_ids) if t not in texts]
        if missing:
            texts.update(zip(missing, self._decode_each(missing)))
        return [texts[t] for t in token_ids]

    def _decode_each(self, token_ids: list[int]) -> list[str]:
        if self._backend is not None:
            return [self._backend.decode([t], skip_special_tokens=False) for t in token_ids]
        return [self._tokenizer.decode([t]) for t in token_ids]
