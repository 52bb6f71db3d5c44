"""The front-end's output side: the core's per-step token deltas to RequestOutputs.

It owns detokenization, stop strings, logprobs and ``n`` > 1: a user request with ``n`` > 1 runs
as ``n`` sequences in the core, whose completions are gathered into one :class:`RequestOutput`
under the parent's id. A stop string found here ends the sequence at once (later tokens are
dropped); the caller then aborts it in the core (``process_outputs`` says which).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from novainfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from novainfer.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from novainfer.engine.output_text import OutputTextState
from novainfer.outputs import CompletionOutput, FlatLogprobs, LogprobsWindow, RequestMetrics, RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    request_id: str  # the core's id
    index: int
    params: SamplingParams
    text: OutputTextState | None  # None when the request is not detokenized
    logprobs: FlatLogprobs | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_reported: int = 0
    final_reported: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    children: list[ChildState] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    started: bool = False  # whether any of its sequences got a token (it is no longer waiting)

    def finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass
class FrontendLoad:
    """The requests the front-end has handed to the core and not seen finish."""

    num_running: int = 0  # sequences that got a token
    num_waiting: int = 0  # sequences that did not yet
    num_waiting_prompt_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.logprobs_window = LogprobsWindow()  # the steps' logprob rows until their sequences copy them
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, tuple[ParentState, ChildState]] = {}
        self.finished_requests_total: Counter = Counter()  # sequences, by finish reason
        # Called with each finished sequence's finish reason (a server's metrics, summed over its processes).
        self.on_finished: Callable[[str], None] | None = None
        self.load = FrontendLoad()
        # Final outputs whose text decode_final_texts fills, while batching (None: not batching).
        self._final_texts: list[tuple[CompletionOutput, OutputTextState]] | None = None

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
                    output_kind: RequestOutputKind, children: list[EngineCoreRequest]) -> None:
        parent = ParentState(parent_id, prompt, prompt_token_ids, output_kind,
                             RequestMetrics(arrival_time=children[0].arrival_time), num_unfinished=len(children))
        for index, request in enumerate(children):
            params = request.sampling_params
            text = None
            if params.detokenize:
                text = OutputTextState(self.tokenizer, prompt_token_ids, stop=params.stop or (),
                                       include_stop_str_in_output=params.include_stop_str_in_output,
                                       skip_special_tokens=params.skip_special_tokens,
                                       spaces_between_special_tokens=params.spaces_between_special_tokens,
                                       defer=output_kind == RequestOutputKind.FINAL_ONLY,
                                       token_texts=self.token_texts)
            logprobs = None
            if params.logprobs is not None:  # token texts only where the text is detokenized
                logprobs = FlatLogprobs(self.token_texts if text is not None else None, params.logprobs)
            child = ChildState(request.request_id, index, params, text, logprobs)
            parent.children.append(child)
            self.children[request.request_id] = (parent, child)
        self.parents[parent_id] = parent
        self.load.num_waiting += len(children)
        self.load.num_waiting_prompt_tokens += len(prompt_token_ids) * len(children)

    def has(self, parent_id: str) -> bool:
        return parent_id in self.parents

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request_id for c in parent.children] if parent else []

    # ---- one step ----------------------------------------------------------------------------
    def process_outputs(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Applies a step's outputs; returns the RequestOutputs of the parents that changed, and the
        core ids of the sequences that stop strings ended (to abort in the core)."""
        touched, to_abort = self.apply_outputs(core_outputs)
        return [self.make_output(parent_id) for parent_id in touched], to_abort

    def apply_outputs(self, core_outputs: EngineCoreOutputs) -> tuple[list[str], list[str]]:
        """Applies a step's outputs without building RequestOutputs; returns the ids of the parents
        that have something to report (see :meth:`make_output`) and the core ids of the sequences
        that stop strings ended. A reader that falls behind gets several steps in one output."""
        touched: dict[str, None] = {}
        to_abort: list[str] = []
        now = core_outputs.timestamp
        m = core_outputs
        # The sparse columns by request index (most steps have none: decode steps without logprobs).
        finished = dict(zip(m.finished, zip(m.finish_reasons, m.stop_reasons))) if m.finished else {}
        started = dict(zip(m.started, zip(m.num_cached_tokens, m.first_scheduled_times))) if m.started else {}
        window = self.logprobs_window
        logprobs_rows = self._window_rows(m, [window.add(block) for block in m.logprobs_blocks])
        children = self.children
        token_ids = m.token_ids
        end = 0
        for index, (request_id, num_new) in enumerate(zip(m.request_ids, m.num_new_tokens)):
            start = end
            end += num_new
            entry = children.get(request_id)
            if entry is None:
                continue  # finished here (stop string, abort) while the core was still running it
            parent, child = entry
            if child.finish_reason is not None:
                continue
            if not child.token_ids:
                self._start(parent, child, started.get(index), now)
            finish = finished.get(index)
            kept = self._apply(child, token_ids[start:end], finish)
            if child.logprobs is not None and logprobs_rows is not None and logprobs_rows[index] is not None:
                child.logprobs.add_window_rows(window, logprobs_rows[index], kept)
            if child.finish_reason is not None:
                self._finish(parent, child, now)
                if finish is None:
                    to_abort.append(child.request_id)
            if parent.output_kind != RequestOutputKind.FINAL_ONLY or parent.finished():
                touched[parent.request_id] = None
            parent.metrics.last_token_time = now
        return list(touched), to_abort

    @staticmethod
    def _window_rows(m: EngineCoreOutputs, first_rows: list[int]) -> list[int | None] | None:
        """Per request index, the window row of its first new token's logprobs (None for a request
        without); None when no request has any. ``first_rows``: the window row of each block's first."""
        if not m.with_logprobs:
            return None
        if len(m.with_logprobs) == len(m.request_ids) and len(first_rows) == 1:
            # Every request in one block (a decode step where all ask for logprobs): no index to map.
            first = first_rows[0]
            return [first + row for row in m.logprobs_rows]
        rows: list[int | None] = [None] * len(m.request_ids)
        for index, block, row in zip(m.with_logprobs, m.logprobs_block_index, m.logprobs_rows):
            rows[index] = first_rows[block] + row
        return rows

    def _start(self, parent: ParentState, child: ChildState, first: tuple[int, float | None] | None,
               now: float) -> None:
        """A sequence's first tokens; ``first``: the core's (cached prompt tokens, first scheduled time)."""
        self.load.num_waiting -= 1
        self.load.num_waiting_prompt_tokens -= len(parent.prompt_token_ids)
        self.load.num_running += 1
        if not parent.started:
            parent.started = True
            num_cached_tokens, first_scheduled_time = first if first is not None else (0, None)
            parent.num_cached_tokens = max(num_cached_tokens, 0)
            parent.metrics.first_scheduled_time = first_scheduled_time
            parent.metrics.first_token_time = now

    def _apply(self, child: ChildState, new_ids: list[int], finish: tuple[str, int | None] | None) -> int:
        """Adds a sequence's new tokens, detokenizes them and checks stop strings; ``finish``: the
        core's (finish reason, stop reason) when the sequence finished in the core. Returns how many
        of the tokens it kept (those after one that completes a stop string are dropped)."""
        params = child.params
        # A stop token (EOS or stop_token_ids) ends the text without being rendered, unless asked.
        num_text = len(new_ids) - (finish is not None and finish[0] == "stop" and not params.include_stop_str_in_output)
        if child.text is None or not params.stop:
            child.token_ids += new_ids
            if child.text is not None and num_text > 0:
                child.text.append_tokens(new_ids[:num_text])
        else:
            # Token by token: the tokens after the one that completes a stop string are dropped.
            for position, token in enumerate(new_ids):
                child.token_ids.append(token)
                if position < num_text:
                    stop_str = child.text.append_tokens([token])
                    if stop_str is not None:
                        child.finish_reason, child.stop_reason = "stop", stop_str
                        return position + 1
        if finish is not None:
            child.finish_reason, child.stop_reason = finish
        return len(new_ids)

    def _finish(self, parent: ParentState, child: ChildState, now: float) -> None:
        parent.num_unfinished -= 1
        self.finished_requests_total[child.finish_reason] += 1
        if self.on_finished is not None:
            self.on_finished(child.finish_reason)
        if child.token_ids:
            self.load.num_running -= 1
        else:
            self.load.num_waiting -= 1
            self.load.num_waiting_prompt_tokens -= len(parent.prompt_token_ids)
        if parent.finished():
            parent.metrics.finished_time = now

    # ---- aborts ------------------------------------------------------------------------------
    def abort(self, parent_id: str, now: float) -> list[str]:
        """Ends a request's unfinished sequences (its next :meth:`make_output` is the final one);
        returns the core ids to abort."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return []
        to_abort = []
        for child in parent.children:
            if child.finish_reason is None:
                child.finish_reason = "abort"
                self._finish(parent, child, now)
                to_abort.append(child.request_id)
        return to_abort

    def fail_all(self) -> list[str]:
        """Forgets every request (the core died); returns their parent ids."""
        parent_ids = list(self.parents)
        self.parents.clear()
        self.children.clear()
        self.load = FrontendLoad()
        return parent_ids

    # ---- outputs -----------------------------------------------------------------------------
    def batch_final_texts(self) -> None:
        """From now on final outputs (RequestOutputKind.FINAL_ONLY) of texts decoded whole come with
        their text empty, until :meth:`decode_final_texts` fills them: for a caller that returns
        outputs only once all are finished (``LLM.generate``), so that their texts are decoded in a
        few batched calls that run on several threads, off the steps."""
        if self._final_texts is None:
            self._final_texts = []

    def decode_final_texts(self) -> None:
        """Fills the texts left empty since :meth:`batch_final_texts` and stops batching."""
        pending, self._final_texts = self._final_texts or [], None
        texts = IncrementalDetokenizer.decode_outputs([state.final_decode() for _, state in pending])
        for (completion, _), text in zip(pending, texts):
            completion.text = completion.delta_text = text

    def make_output(self, parent_id: str) -> RequestOutput | None:
        """The parent's output since the previous one (all of it for cumulative outputs), None if
        the parent is unknown (already finished); forgets the parent once every sequence is finished."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return None
        finished = parent.finished()
        delta = parent.output_kind == RequestOutputKind.DELTA
        outputs = []
        for child in parent.children:
            done = child.finish_reason is not None
            reported = child.num_tokens_reported
            new_ids = child.token_ids[reported:]
            child.num_tokens_reported = len(child.token_ids)
            # A final output's deferred text is left to decode_final_texts while batching.
            batched = (self._final_texts is not None and finished and not delta and child.text is not None
                       and child.text.deferred)
            # A sequence that finished earlier than its siblings has nothing more to stream.
            delta_text = ("" if child.final_reported or child.text is None or batched
                          else child.text.take_delta(finished=done))
            child.final_reported = done
            if delta:
                text, token_ids = delta_text, new_ids
                logprobs = None if child.logprobs is None else child.logprobs.take()
            else:
                text = child.text.text if child.text is not None and not batched else ""
                # The parent is forgotten after its final output: that one takes the lists themselves.
                token_ids = child.token_ids if finished else list(child.token_ids)
                logprobs = child.logprobs if finished or child.logprobs is None else child.logprobs[:]
            outputs.append(CompletionOutput(
                index=child.index, text=text, token_ids=token_ids,
                cumulative_logprob=None if child.logprobs is None else child.logprobs.cumulative_logprob,
                logprobs=logprobs, finish_reason=child.finish_reason, stop_reason=child.stop_reason if done else None,
                delta_text=delta_text, delta_token_ids=new_ids))
            if batched:
                self._final_texts.append((outputs[-1], child.text))
        if finished:
            del self.parents[parent.request_id]
            for child in parent.children:
                self.children.pop(child.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.num_cached_tokens, parent.metrics.snapshot())
