"""Llama (``LlamaForCausalLM``): the shared decoder; ``attention_bias`` puts a bias on q/k/v and
o_proj, ``mlp_bias`` on gate/up/down (as transformers does). ``head_dim`` may differ from
hidden_size / num_attention_heads, and RoPE may be scaled (``linear``, ``llama3``)."""

from __future__ import annotations

from novainfer.models.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions("LlamaForCausalLM", qkv_bias=attention_bias, o_proj_bias=attention_bias,
                              mlp_bias=bool(getattr(config, "mlp_bias", False)))
