"""Engine-side output processing: detokenization, stop strings, logprobs, RequestOutputs.

A user request with ``n`` > 1 runs as ``n`` child requests; their completions are gathered
into one :class:`RequestOutput` under the parent's id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from novainfer.engine.detokenizer import TokenTexts
from novainfer.engine.output_text import OutputTextState
from novainfer.engine.request import Request, RequestStatus
from novainfer.outputs import CompletionOutput, Logprob, RequestOutput
from novainfer.sampling_params import RequestOutputKind


@dataclass
class ChildState:
    request: Request
    index: int
    text: OutputTextState | None  # None when the request is not detokenized
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    num_tokens_reported: int = 0
    final_reported: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[ChildState] = field(default_factory=list)

    def finished(self) -> bool:
        return all(c.request.is_finished() for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}

    def add_request(self, parent_id: str, prompt: str | None, children: list[Request]) -> None:
        parent = ParentState(parent_id, prompt, children[0].prompt_token_ids,
                             children[0].sampling_params.output_kind)
        for index, request in enumerate(children):
            params = request.sampling_params
            text = None
            if params.detokenize:
                text = OutputTextState(self.tokenizer, request.prompt_token_ids, stop=params.stop or (),
                                       include_stop_str_in_output=params.include_stop_str_in_output,
                                       skip_special_tokens=params.skip_special_tokens,
                                       spaces_between_special_tokens=params.spaces_between_special_tokens)
            wants_logprobs = params.logprobs is not None
            child = ChildState(request, index, text, [] if wants_logprobs else None,
                               0.0 if wants_logprobs else None)
            parent.children.append(child)
            self.child_to_parent[request.request_id] = parent
            self.children[request.request_id] = child
        self.parents[parent_id] = parent

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process_token(self, request: Request, token_stop: RequestStatus | None,
                      logprobs: tuple[list[int], list[float], int] | None) -> RequestStatus | None:
        """Detokenizes a request's newest token and checks stop strings; returns its finish status."""
        child = self.children[request.request_id]
        params = request.sampling_params
        # A stop token (EOS or stop_token_ids) ends the text without being rendered, unless asked.
        stopped_by_token = token_stop == RequestStatus.FINISHED_STOPPED
        if child.text is not None and (not stopped_by_token or params.include_stop_str_in_output):
            stop_str = child.text.append_tokens(request.output_token_ids[-1:])
            if stop_str is not None:
                request.stop_reason = stop_str
                token_stop = RequestStatus.FINISHED_STOPPED
        if logprobs is not None and child.logprobs is not None:
            ids, values, rank = logprobs
            decode = self.token_texts if child.text is not None else lambda _: None
            entry = {ids[0]: Logprob(values[0], rank, decode(ids[0]))}
            for position, (tid, value) in enumerate(zip(ids[1:], values[1:]), start=1):
                entry.setdefault(tid, Logprob(value, position, decode(tid)))
            child.logprobs.append(entry)
            child.cumulative_logprob += values[0]
        return token_stop

    def wants_output(self, request_id: str, finished_now: bool) -> bool:
        """Whether a child's new token makes its parent produce an output this step.

        FINAL_ONLY parents produce one only when their last child finishes.
        """
        parent = self.child_to_parent[request_id]
        if parent.output_kind != RequestOutputKind.FINAL_ONLY:
            return True
        return finished_now and parent.finished()

    def make_output(self, parent_id: str) -> RequestOutput:
        """The parent's current output; forgets the parent once every child is finished."""
        parent = self.parents[parent_id]
        finished = parent.finished()
        outputs = []
        for child in parent.children:
            request = child.request
            done = request.is_finished()
            new_ids = request.output_token_ids[child.num_tokens_reported:]
            child.num_tokens_reported = request.num_output_tokens
            # A child that finished earlier than its siblings has nothing more to stream.
            delta_text = "" if child.final_reported or child.text is None else child.text.take_delta(finished=done)
            child.final_reported = done
            outputs.append(CompletionOutput(
                index=child.index, text=child.text.text if child.text is not None else "", token_ids=list(request.output_token_ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                finish_reason=request.get_finished_reason() if done else None,
                stop_reason=request.stop_reason if done else None,
                delta_text=delta_text, delta_token_ids=new_ids))
        first = parent.children[0].request
        metrics = dataclasses.replace(first.metrics)  # a snapshot: the request keeps updating its own
        if finished:
            del self.parents[parent_id]
            for child in parent.children:
                self.child_to_parent.pop(child.request.request_id, None)
                self.children.pop(child.request.request_id, None)
        return RequestOutput(parent_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             max(first.num_cached_tokens, 0), metrics)

    def parent_of(self, request_id: str) -> str:
        return self.child_to_parent[request_id].request_id

    def has(self, parent_id: str) -> bool:
        return parent_id in self.parents
