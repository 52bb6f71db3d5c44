"""The offline facade: ``LLM(model=...).generate(prompts, sampling_params)``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.llm_engine import LLMEngine, PromptType
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, str]


class LLM:
    """Loads a model directory (``None``: the built-in tiny model) and generates text.

    Keyword arguments are engine arguments with vLLM's names (see :class:`EngineArgs`);
    an unknown one is an error. With ``multiprocess`` the engine core (scheduler, KV cache, model)
    runs in a process of its own, as under ``novainfer serve``: it keeps generating while this
    process detokenizes and builds outputs (or the calling script does other work between
    ``generate_stream`` outputs).
    """

    def __init__(self, model: str | None = None, *, multiprocess: bool = False, **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, multiprocess=multiprocess)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (and nothing done) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Releases the workers (and their device memory, once the LLM itself is dropped)."""
        self.llm_engine.shutdown()

    def _add_requests(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        elif not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a string, a prompt dict, a list of token ids, or a list of "
                            f"these; got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries but there are "
                                 f"{len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)  # all or nothing: no half-added batch
            raise
        return request_ids

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        request_ids = self._add_requests(prompts, self._final_only(sampling_params))
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            # The outputs are handed on at the end: their texts are decoded then, in batched calls.
            with self.llm_engine.final_texts_batched():
                while len(finished) < len(request_ids):
                    for output in self.llm_engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            if progress is not None:
                                progress.update(1)
        except BaseException:
            self.llm_engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[rid] for rid in request_ids]

    @staticmethod
    def _final_only(sampling_params: SamplingParams | Sequence[SamplingParams] | None
                    ) -> SamplingParams | list[SamplingParams]:
        """Copies of the params that report only final outputs: generate() waits for those anyway."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()]
            single = True
        else:
            single = False
        final = []
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY
            final.append(params)
        return final[0] if single else final

    def generate_stream(self, prompts: PromptType | Sequence[PromptType],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yields every request's outputs as they are produced; ``outputs[i].delta_text`` is the new text."""
        request_ids = self._add_requests(prompts, sampling_params)
        pending = set(request_ids)
        try:
            while pending:
                for output in self.llm_engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:
            if pending:
                self.llm_engine.abort_request(sorted(pending))

    def apply_chat_template(self, messages: list[ChatMessage]) -> str:
        return self.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages: list[ChatMessage] | list[list[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation or to each of several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
