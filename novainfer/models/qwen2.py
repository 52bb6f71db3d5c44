"""Qwen2 (``Qwen2ForCausalLM``): the shared decoder with a bias on q/k/v only."""

from __future__ import annotations

from novainfer.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("Qwen2 with use_sliding_window=True is not supported")
        return DecoderOptions("Qwen2ForCausalLM", qkv_bias=True)
