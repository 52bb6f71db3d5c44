"""Driver-side scheduling state: KV cache block bookkeeping and prefix caching."""

from novainfer.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from novainfer.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from novainfer.core.kv_cache_utils import ROOT_BLOCK_HASH, BlockHash, hash_block_tokens

__all__ = [
    "ROOT_BLOCK_HASH",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
]
