"""Triton kernels of the attention backend (imported only where Triton is available)."""

from novainfer.attention.ops.decode_attention import (MAX_SPLITS, DecodeTileConfig, choose_num_splits,
                                                     decode_attention, decode_tile_config, decode_workspace_shape)
from novainfer.attention.ops.prefill_attention import PrefillTileConfig, prefill_attention, prefill_tile_config
from novainfer.attention.ops.reshape_and_cache import reshape_and_cache, rotary_embedding_and_cache

__all__ = ["MAX_SPLITS", "DecodeTileConfig", "PrefillTileConfig", "choose_num_splits", "decode_attention", "decode_tile_config",
           "decode_workspace_shape", "prefill_attention", "prefill_tile_config", "reshape_and_cache",
           "rotary_embedding_and_cache"]
