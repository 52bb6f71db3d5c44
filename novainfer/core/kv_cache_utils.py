"""Content hashing of KV cache blocks for prefix caching.

A full block's hash covers its own tokens and, through the parent hash, every
token before it: ``hash_k = H(hash_{k-1}, tokens of block k)`` with a fixed
root value standing in for ``hash_{-1}``. Equal hashes therefore (almost
certainly) mean equal prefixes; the block pool still verifies every hit, so a
collision costs a miss, never a wrong block.
"""

from collections.abc import Sequence

import numpy as np
import xxhash

BlockHash = int
"""A 128-bit xxh3 digest, as a Python int."""

ROOT_BLOCK_HASH: BlockHash = xxhash.xxh3_128_intdigest(b"novainfer/prefix-cache/root")
"""Parent hash of a request's first block."""

_HASH_BYTES = 16


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one full block of tokens chained on the hash of the block before it.

    The byte encoding (little-endian parent digest, then little-endian int64
    tokens) is fixed so that hashes are stable across processes and machines.
    """
    data = parent_hash.to_bytes(_HASH_BYTES, "little") + np.asarray(token_ids, dtype="<i8").tobytes()
    return xxhash.xxh3_128_intdigest(data)
