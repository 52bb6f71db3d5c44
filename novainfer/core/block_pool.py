"""Bookkeeping for the fixed pool of KV cache blocks (no tensors here).

A block is either in use (``ref_cnt > 0``: held by one or more requests) or
free (sitting in the LRU free queue). A free block may still be *cached*: it
keeps its hash and stays hittable until the pool hands it out again, at which
point the hash is evicted.

Prefix identity. Each hashed block gets a ``prefix_id`` naming the exact
token prefix (positions 0 up to the end of the block) whose KV it holds, and
remembers the ``parent_prefix_id`` of the block before it. A lookup accepts a
cached block only if its tokens equal the request's tokens *and* its parent
prefix id equals the prefix id of the block the request matched just before.
By induction over the chain, a hit is then exact whatever the hash function
does: comparing tokens alone is not enough, because a block with the right
tokens but a different history could sit under a colliding hash.
"""

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from novainfer.core.kv_cache_utils import BlockHash

ROOT_PREFIX_ID = 0
"""Parent prefix id of a request's first block (the empty prefix)."""


@dataclass(slots=True)
class KVCacheBlock:
    """Metadata of one KV cache block."""

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is registered in the pool's hash map (hittable).
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent_prefix_id: int | None = None
    # Set once the block is full and hashed, whether registered or not: the
    # next block of the same request records it as its parent.
    prefix_id: int | None = None

    def clear_cache_metadata(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.parent_prefix_id = None
        self.prefix_id = None


class FreeBlockQueue:
    """Free blocks in LRU order: the head is reused first.

    Backed by an ``OrderedDict`` keyed by block id, so append, pop from the
    head and removal from the middle (a cache hit on a free block) are O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def append(self, block: KVCacheBlock) -> None:
        if block.block_id in self._blocks:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        self._blocks[block.block_id] = block

    def popleft(self) -> KVCacheBlock:
        if not self._blocks:
            raise IndexError("pop from an empty free block queue")
        return self._blocks.popitem(last=False)[1]

    def remove(self, block: KVCacheBlock) -> None:
        try:
            del self._blocks[block.block_id]
        except KeyError:
            raise KeyError(f"block {block.block_id} is not in the free queue") from None

    def block_ids(self) -> list[int]:
        """Block ids from head (next to reuse) to tail; for inspection and tests."""
        return list(self._blocks)


class BlockPool:
    """Owns every block, the free queue and the hash -> cached block map."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._next_prefix_id = ROOT_PREFIX_ID + 1

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (``ref_cnt > 0``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue.

        Cached blocks among them lose their hash here: this is eviction.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (cache hits)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the given order.

        Blocks whose last reference goes are appended to the free queue in
        that order, so the first ones given are the first to be evicted.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(
        self, block_hash: BlockHash, parent_prefix_id: int, token_ids: tuple[int, ...]
    ) -> KVCacheBlock | None:
        """The cached block holding exactly ``token_ids`` after ``parent_prefix_id``, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_prefix_id != parent_prefix_id or block.token_ids != token_ids:
            return None
        return block

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        parent_prefix_id: int,
        token_ids: tuple[int, ...],
    ) -> None:
        """Record that ``block`` is full with ``token_ids`` after ``parent_prefix_id``.

        If another block is already registered under ``block_hash`` the map
        keeps it. When that block holds the same prefix, ``block`` shares its
        prefix id, so blocks later appended after ``block`` stay hittable
        through the registered one.
        """
        existing = self._cached.get(block_hash)
        if existing is None:
            self._cached[block_hash] = block
            block.block_hash = block_hash
            block.token_ids = token_ids
            block.parent_prefix_id = parent_prefix_id
            block.prefix_id = self._new_prefix_id()
        elif existing.parent_prefix_id == parent_prefix_id and existing.token_ids == token_ids:
            block.prefix_id = existing.prefix_id
        else:
            # A genuine hash collision: the block stays unregistered (unhittable).
            block.prefix_id = self._new_prefix_id()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.clear_cache_metadata()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
        block.clear_cache_metadata()

    def _new_prefix_id(self) -> int:
        # Never reused, so a stale parent id can never match a newer prefix.
        prefix_id = self._next_prefix_id
        self._next_prefix_id += 1
        return prefix_id
