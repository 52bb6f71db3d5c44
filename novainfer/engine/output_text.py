"""Per-request output text: incremental detokenization, stop strings, streaming."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from novainfer.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from novainfer.engine.stop_strings import StopMatcher

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputTextState:
    """Output text of one request, cut at the first stop string.

    Call :meth:`append_tokens` with each step's new tokens, and
    :meth:`take_delta` to get the text that may be streamed to the client.
    Streamed text never contains a stop string that is not part of the output,
    because text that could be the beginning of a stop string is held back
    until it is known not to be one.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        defer: bool = False,
        token_texts: TokenTexts | None = None,
    ) -> None:
        """``defer``: only the final text is wanted (no streaming); without stop strings the tokens
        are then decoded once, when the text is first read, instead of at every step.
        ``token_texts``: single-token texts (a shared cache), which lets tokens that arrived in
        several steps be decoded in one call (see :meth:`_decode_pending`)."""
        if isinstance(stop, str):
            raise TypeError(f"stop must be a sequence of strings, not the string {stop!r}")
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            token_texts=token_texts,
        )
        self._stops = StopMatcher(stop)
        self._include_stop_str_in_output = include_stop_str_in_output
        self._text = ""
        self._stop_matched: str | None = None
        self._num_streamed = 0
        # Without stop strings nothing needs the text before it is read: tokens wait in
        # ``_pending_ids`` and are decoded together when it is (a streamed request whose reader
        # is behind decodes several steps' tokens in one call). ``defer`` (only the final text
        # is wanted) keeps every token and decodes them once, from the start.
        self._lazy = not stop
        self._deferred_ids: list[int] | None = [] if defer and not stop else None
        self._pending_ids: list[int] = []
        self._token_texts = token_texts

    @property
    def text(self) -> str:
        """Output text so far, truncated at the stop string if one was matched."""
        self._decode_pending()
        return self._text

    def _decode_pending(self) -> None:
        if not self._pending_ids:
            return
        if self._deferred_ids is not None:
            self._deferred_ids += self._pending_ids
            self._text = self._detokenizer.decode_output(self._deferred_ids)
        elif len(self._pending_ids) == 1 or (self._token_texts is not None
                                             and self._token_texts.ends_on_character(self._pending_ids)):
            # One token (a streamed request's usual step), or a batch that cannot end inside a
            # character: its text is what feeding the tokens one at a time would have emitted.
            self._text += self._detokenizer.add_tokens(self._pending_ids)
        else:
            # One token at a time, as they came: a batch that ends inside a character would hold
            # back the text of its every token, where steps of one token hold back only that one.
            add_tokens = self._detokenizer.add_tokens
            self._text += "".join([add_tokens((token,)) for token in self._pending_ids])
        self._pending_ids = []

    def append_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Detokenizes new tokens; returns the stop string they complete, else None.

        On a match the text is truncated before the stop string (or after it
        with ``include_stop_str_in_output``); the request must then finish,
        and appending more tokens raises ``RuntimeError``.
        """
        if self._stop_matched is not None:
            raise RuntimeError(
                f"append_tokens called after stop string {self._stop_matched!r} "
                f"already ended the output {self._text!r}"
            )
        if self._lazy:
            self._pending_ids += token_ids
            return None
        new_text = self._detokenizer.add_tokens(token_ids)
        offset = len(self._text)
        self._text += new_text
        if not new_text or not self._stops.stops:
            return None
        # A match not found by earlier calls ends inside the new text: only it is read.
        match = self._stops.feed(new_text, offset)
        if match is None:
            return None
        self._text = self._text[: match.end if self._include_stop_str_in_output else match.start]
        self._stop_matched = match.stop
        return match.stop

    def take_delta(self, finished: bool) -> str:
        """Returns the text added since the previous call that is safe to stream.

        While the request runs, a tail of the text that could be the beginning
        of a stop string is held back. Once it is finished, or a stop string
        was matched (the text can no longer grow), everything left is returned.
        """
        self._decode_pending()
        end = len(self._text)
        if not finished and self._stop_matched is None:
            end -= self._stops.partial_len()
        if end < self._num_streamed:
            # Only possible if tokens were appended after a finished=True call
            # and a stop string then cut into text that was already streamed.
            raise RuntimeError(
                f"{self._num_streamed} characters were already streamed but the "
                f"output text is now {self._text!r}"
            )
        delta = self._text[self._num_streamed : end]
        self._num_streamed = end
        return delta
