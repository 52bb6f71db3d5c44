"""Per-request output text: incremental detokenization, stop strings, streaming."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from novainfer.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from novainfer.engine.stop_strings import StopMatcher

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Pieces of text are joined into one when this many are held: copying the text once per this many
# steps bounds both the copying per step and the objects per request.
_MAX_PIECES = 64


def _joined(pieces: list[str]) -> str:
    """The pieces' text, left in ``pieces`` as one piece."""
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""


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
        # The text, as pieces: the streamed part, then the tail not streamed yet (joined when read):
        # a step appends a piece instead of copying a string as long as the output.
        self._streamed: list[str] = []
        self._streamed_len = 0  # characters in ``_streamed``
        self._num_streamed = 0  # characters handed out by take_delta (the same, unless a cut went below it)
        self._tail: list[str] = []
        self._tail_len = 0
        self._stop_matched: str | None = None
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
        return _joined(self._streamed) + _joined(self._tail)

    def _length(self) -> int:
        return self._streamed_len + self._tail_len

    def _append(self, text: str) -> None:
        if text:
            self._tail.append(text)
            self._tail_len += len(text)
            if len(self._tail) >= _MAX_PIECES:
                _joined(self._tail)

    @property
    def deferred(self) -> bool:
        """Whether the text is decoded whole when read (``defer`` without stop strings)."""
        return self._deferred_ids is not None

    def final_decode(self) -> tuple[IncrementalDetokenizer, list[int]]:
        """A :attr:`deferred` text's detokenizer and every token id, to decode the whole text
        elsewhere (``IncrementalDetokenizer.decode_outputs`` batches requests)."""
        if self._deferred_ids is None:
            raise RuntimeError("final_decode is for deferred texts only")
        return self._detokenizer, self._deferred_ids + self._pending_ids

    def _decode_pending(self) -> None:
        if not self._pending_ids:
            return
        if self._deferred_ids is not None:
            self._deferred_ids += self._pending_ids
            self._tail, self._tail_len = [], 0  # nothing is streamed: the text is decoded again
            self._append(self._detokenizer.decode_output(self._deferred_ids))
        elif len(self._pending_ids) == 1 or (self._token_texts is not None
                                             and self._token_texts.ends_on_character(self._pending_ids)):
            # One token (a streamed request's usual step), or a batch that cannot end inside a
            # character: its text is what feeding the tokens one at a time would have emitted.
            self._append(self._detokenizer.add_tokens(self._pending_ids))
        else:
            # One token at a time, as they came: a batch that ends inside a character would hold
            # back the text of its every token, where steps of one token hold back only that one.
            add_tokens = self._detokenizer.add_tokens
            self._append("".join([add_tokens((token,)) for token in self._pending_ids]))
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
                f"already ended the output {self.text!r}"
            )
        if self._lazy:
            self._pending_ids += token_ids
            return None
        new_text = self._detokenizer.add_tokens(token_ids)
        offset = self._length()
        self._append(new_text)
        if not new_text or not self._stops.stops:
            return None
        # A match not found by earlier calls ends inside the new text: only it is read.
        match = self._stops.feed(new_text, offset)
        if match is None:
            return None
        self._cut(match.end if self._include_stop_str_in_output else match.start)
        self._stop_matched = match.stop
        return match.stop

    def _cut(self, length: int) -> None:
        """Truncates the text to ``length`` characters."""
        if length < self._streamed_len:  # into text already streamed: take_delta reports it
            self._streamed, self._streamed_len = [_joined(self._streamed)[:length]], length
        tail = _joined(self._tail)[:length - self._streamed_len]
        self._tail, self._tail_len = [tail] if tail else [], len(tail)

    def take_delta(self, finished: bool) -> str:
        """Returns the text added since the previous call that is safe to stream.

        While the request runs, a tail of the text that could be the beginning
        of a stop string is held back. Once it is finished, or a stop string
        was matched (the text can no longer grow), everything left is returned.
        """
        self._decode_pending()
        end = self._length()
        if not finished and self._stop_matched is None:
            end -= self._stops.partial_len()
        if end < self._num_streamed:
            # Only possible if tokens were appended after a finished=True call
            # and a stop string then cut into text that was already streamed.
            raise RuntimeError(
                f"{self._num_streamed} characters were already streamed but the "
                f"output text is now {self.text!r}"
            )
        if end == self._streamed_len:
            return ""
        tail = _joined(self._tail)
        delta, rest = tail[:end - self._streamed_len], tail[end - self._streamed_len:]
        self._tail, self._tail_len = [rest] if rest else [], len(rest)
        self._streamed.append(delta)
        self._streamed_len = self._num_streamed = end
        if len(self._streamed) >= _MAX_PIECES:
            _joined(self._streamed)
        return delta
