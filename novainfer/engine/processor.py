"""The front-end's input side: prompts to token ids, validation, and n>1 fan-out into core requests."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from novainfer.config import ModelConfig
from novainfer.core.messages import EngineCoreRequest
from novainfer.sampling_params import SamplingParams

PromptType = str | Sequence[int] | Mapping[str, Any]


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The core's id of sequence ``index`` of a request with ``n`` sequences."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer, kv_capacity: int) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.kv_capacity = kv_capacity  # tokens the whole KV cache holds
        self.eos_token_ids = model_config.generation_eos_token_ids()
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(tokenizer.eos_token_id)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise TypeError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        # The common case checked at C speed (every id a plain int, min and max in range); the loop
        # that names the bad value runs only for a bad prompt.
        if not (set(map(type, prompt_token_ids)) == {int} and 0 <= min(prompt_token_ids)
                and max(prompt_token_ids) < vocab):
            bad = next(t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab)
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad!r}")
        max_len = self.model_config.max_model_len
        if len(prompt_token_ids) > max_len:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens long, longer than "
                             f"max_model_len={max_len}")
        if len(prompt_token_ids) > self.kv_capacity:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens long but the KV cache holds only "
                             f"{self.kv_capacity} tokens")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                arrival_time: float | None = None
                ) -> tuple[str | None, list[int], SamplingParams, list[EngineCoreRequest]]:
        """(prompt text, prompt token ids, the params, one core request per sequence). Bad input
        raises, naming the field."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        max_tokens = params.max_tokens or self.model_config.max_model_len - len(token_ids)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        children = []
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index  # distinct but reproducible siblings
            child_params.update_from_generation_config(self.eos_token_ids)
            children.append(EngineCoreRequest(child_request_id(request_id, index, params.n), token_ids,
                                              child_params, max_tokens, arrival_time))
        return text, token_ids, params, children

