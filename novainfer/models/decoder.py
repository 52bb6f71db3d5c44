"""The decoder shared by the Llama family (Llama, Qwen2): pre-norm layers of GQA attention with
RoPE and a SiLU-gated MLP, built from tensor-parallel-ready layers.

An architecture subclasses :class:`DecoderForCausalLM` and states only what differs, as a
:class:`DecoderOptions` (which projections have a bias) and the configurations it refuses.
Per decoder layer there are exactly two all-reduces: after ``o_proj`` and after ``down_proj``
(both row-parallel, their biases added once, after the all-reduce); everything else is local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from novainfer.attention import Attention, AttentionMetadata
from novainfer.attention.backends.abstract import TracedAttentionInputs
from novainfer.attention.layer import attention_context
from novainfer.distributed import ProcessGroup, get_tp_group, get_vocab_parallel_group
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.layernorm import RMSNorm
from novainfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from novainfer.layers.rotary_embedding import RotaryEmbedding
from novainfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from novainfer.models.compile import CompiledForward
from novainfer.models.config_utils import get_head_dim, get_rope_scaling, get_rope_theta


@dataclass(frozen=True)
class DecoderOptions:
    """What one architecture of the family does differently (``name`` appears in errors)."""

    name: str
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False


def check_tensor_parallel_shapes(config, tp_group: ProcessGroup, name: str) -> None:
    """Fails at start-up unless every rank gets whole heads and intermediate columns (seed 000 7.4.6).

    KV heads are split, never replicated (section 7.4.2): ``num_key_value_heads`` must divide too.
    """
    tp_size = tp_group.world_size
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    bad = [f"{field}={value}" for field, value in sizes.items() if value % tp_size]
    if bad:
        device = tp_group.device
        global_nkvh = config.num_key_value_heads
        raise ValueError(
            f"{name} cannot be split over tensor_parallel_size={tp_size}: {', '.join(bad)} must be a multiple of it "
            f"(KV heads are split across ranks, never replicated) (tp_size={tp_size}, tp_rank={tp_group.rank}, "
            f"global_nkvh={global_nkvh}, local_nkvh={global_nkvh / tp_size:g}, "
            f"device_id={device.index if device.type == 'cuda' else device.type})")


class DecoderAttention(nn.Module):
    def __init__(self, config, options: DecoderOptions, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__()
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=options.qkv_bias, params_dtype=dtype,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.qkv_sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=options.o_proj_bias, params_dtype=dtype, prefix=f"{prefix}.o_proj")
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              prefix=f"{prefix}.attn", rotary_emb=rotary_emb)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, metadata: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v, metadata, positions))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up fused in one column-parallel matmul."""

    def __init__(self, config, options: DecoderOptions, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{options.name} hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=options.mlp_bias, params_dtype=dtype,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=options.mlp_bias,
                                           params_dtype=dtype, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, options: DecoderOptions, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, options, rotary_emb, dtype, f"{prefix}.self_attn")
        self.mlp = GatedMLP(config, options, dtype, f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, params_dtype=dtype, prefix=f"{prefix}.input_layernorm")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, params_dtype=dtype,
                                                prefix=f"{prefix}.post_attention_layernorm")

    def forward(self, positions, hidden_states, residual, metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config, options: DecoderOptions, dtype: torch.dtype, vocab_parallel: bool | None,
                 prefix: str = "model") -> None:
        super().__init__()
        vocab_group = get_vocab_parallel_group(vocab_parallel)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype=dtype,
                                                   tp_group=vocab_group, prefix=f"{prefix}.embed_tokens")
        # One cos/sin table for all layers: at 128k positions it is 128 MiB.
        self.rotary_emb = RotaryEmbedding(get_head_dim(config), config.max_position_embeddings,
                                          get_rope_theta(config), get_rope_scaling(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, options, self.rotary_emb, dtype, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=dtype, prefix=f"{prefix}.norm")

        # Set by DecoderForCausalLM.compile_forward: the layers below compiled with torch.compile.
        self.compiled_forward: CompiledForward | None = None
        self._attention_by_name: dict[str, Attention] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if self.compiled_forward is None:
            return self.forward_layers(input_ids, positions, metadata)
        if metadata.backend.supports_tracing:
            attn = self.layers[0].self_attn.attn
            traced = metadata.backend.traced_inputs(metadata, attn.num_heads, attn.k_cache)
            return self.compiled_forward(input_ids, positions, traced)
        with attention_context(metadata, self._attention_by_name):
            return self.compiled_forward(input_ids, positions)

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata: AttentionMetadata | TracedAttentionInputs | None = None) -> torch.Tensor:
        """The forward pass; without ``metadata``, attention takes it from ``attention_context``."""
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compile_forward(self, name: str, cpp_wrapper: bool) -> None:
        self._attention_by_name = {layer.self_attn.attn.prefix: layer.self_attn.attn for layer in self.layers}
        self.compiled_forward = CompiledForward(self.forward_layers, name, cpp_wrapper)


class DecoderForCausalLM(nn.Module):
    """The decoder with its LM head; subclasses implement :meth:`decoder_options`."""

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint tensors that are derived, not parameters.
    ignored_checkpoint_suffixes = ("rotary_emb.inv_freq",)

    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        """This architecture's options for ``config``; raises for configurations it does not support."""
        raise NotImplementedError

    def __init__(self, config, dtype: torch.dtype, vocab_parallel: bool | None = None) -> None:
        """``vocab_parallel``: split the embedding and LM head over the tensor-parallel group
        (None: as the enclosing ``tp_group_context`` says; replicated by default)."""
        super().__init__()
        options = self.decoder_options(config)
        check_tensor_parallel_shapes(config, get_tp_group(), options.name)
        self.config = config
        self.model = DecoderModel(config, options, dtype, vocab_parallel)
        vocab_group = get_vocab_parallel_group(vocab_parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype,
                                      tp_group=vocab_group, prefix="lm_head")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def compile_forward(self, cpp_wrapper: bool = False) -> None:
        """Runs the decoder through ``torch.compile`` from now on (see :mod:`novainfer.models.compile`)."""
        if get_tp_group().world_size > 1:
            raise ValueError("compilation needs tensor_parallel_size 1 (collectives are not traced)")
        self.model.compile_forward(type(self).__name__, cpp_wrapper)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
