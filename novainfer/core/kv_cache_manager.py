"""Per-request KV cache block tables on top of the block pool, with prefix caching.

Scheduler protocol, per request:

1. On admission: ``blocks, num_hit = get_computed_blocks(rid, token_ids)``,
   then at once (no other allocation in between, which could evict those
   blocks) ``allocate_slots(rid, token_ids, n, blocks, num_hit)``.
2. Every later step: ``allocate_slots(rid, token_ids, n)``. A caller that counts
   the request's computed tokens itself passes them (``num_computed_tokens``)
   and may skip the steps that stay within ``num_tokens_in_place(rid)``: those
   calls would only have counted the tokens.
3. On finish, abort or preemption: ``free(rid)``. A preempted request is
   admitted afresh later.

``allocate_slots`` returning ``None`` means "not enough free blocks" and leaves
everything as it was, so the scheduler may preempt someone and retry.

The manager counts the tokens each request has been given slots for and
treats all of them as computed at the next ``allocate_slots`` call for that
request (their step may still be running on the device: later steps run after
it). Only blocks whose tokens are all known are hashed, so a block holding a
token that is still being sampled becomes hittable at a later call.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from novainfer.core import kv_cache_utils
from novainfer.core.block_pool import ROOT_PREFIX_ID, BlockPool, KVCacheBlock
from novainfer.core.kv_cache_utils import BlockHash


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix cache counters, in tokens, since the manager was built."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _RequestBlocks:
    block_ids: list[int]
    # Tokens the block table has been sized for: computed, or being computed
    # in the step that the last allocate_slots call served (or truncate set).
    num_tokens: int
    # Leading blocks already hashed, and the chain hash of the last of them,
    # so that hashing newly filled blocks is O(new blocks).
    num_hashed_blocks: int
    last_block_hash: BlockHash


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out KV cache blocks to requests and shares cached prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self._queries = 0
        self._hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached-but-free blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0."""
        return self.block_pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Snapshot of the cumulative counters (recorded once per admission)."""
        return PrefixCacheStats(queries=self._queries, hits=self._hits)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits in the whole pool at all."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return _cdiv(num_tokens, self.block_size) <= self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table, in token order."""
        return list(self._get_request(request_id).block_ids)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The longest cached prefix of full blocks, as (block ids, num tokens).

        A pure lookup: no reference is taken, so pass the result straight to
        ``allocate_slots``. At most ``len(token_ids) - 1`` tokens are reported
        (rounded down to whole blocks) so the model still computes the last
        token and produces logits for it. Statistics are not recorded here
        but in the first ``allocate_slots`` call, so that a request whose
        admission is retried over several steps counts once.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks; look up only on admission")
        if not self.enable_prefix_caching:
            return [], 0
        block_size = self.block_size
        max_blocks = max(len(token_ids) - 1, 0) // block_size
        block_ids: list[int] = []
        parent_hash = kv_cache_utils.ROOT_BLOCK_HASH
        parent_prefix_id = ROOT_PREFIX_ID
        for k in range(max_blocks):
            tokens = tuple(token_ids[k * block_size : (k + 1) * block_size])
            parent_hash = kv_cache_utils.hash_block_tokens(parent_hash, tokens)
            block = self.block_pool.lookup(parent_hash, parent_prefix_id, tokens)
            if block is None:
                break
            block_ids.append(block.block_id)
            parent_prefix_id = block.prefix_id
        return block_ids, len(block_ids) * block_size

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        num_computed_tokens: int | None = None,
    ) -> list[int] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        ``token_ids`` is every token of the request known so far (prompt and
        outputs). The first call admits the request: it takes the cache hits
        ``new_computed_blocks`` covering ``num_new_computed_tokens`` tokens
        (from ``get_computed_blocks``) and records prefix cache statistics.

        Returns the newly allocated block ids (possibly empty), or ``None``
        when the free blocks do not suffice, in which case nothing changed.
        Full blocks whose tokens are all known get hashed and become
        hittable for later requests.

        ``num_lookahead_tokens``: slots for that many more tokens past the new
        ones, not counted as computed (a draft model writes its proposals'
        K/V there before the step that verifies them is scheduled).

        ``num_computed_tokens``: an admitted request's computed tokens before
        the new ones, from a caller that skipped calls (None: the count of
        the previous calls).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens} (request {request_id!r})")
        pool = self.block_pool
        request = self._requests.get(request_id)
        if request is not None and num_computed_tokens is None:
            num_computed_tokens = request.num_tokens
        if request is not None and not new_computed_blocks and not num_new_computed_tokens:
            # The common decode step: the last block still has room. Checked first because it
            # runs for every running request on every step.
            num_tokens = num_computed_tokens + num_new_tokens
            if num_tokens + num_lookahead_tokens <= len(request.block_ids) * self.block_size:
                request.num_tokens = num_tokens
                # (_cache_full_blocks' own first test, without the call: no block fills on most steps)
                if (self.enable_prefix_caching
                        and min(num_tokens, len(token_ids)) // self.block_size > request.num_hashed_blocks):
                    self._cache_full_blocks(request, token_ids)
                return []
        if request is None:
            hit_blocks = [pool.blocks[i] for i in new_computed_blocks]
            self._check_hits(request_id, token_ids, hit_blocks, num_new_computed_tokens)
            num_held = len(hit_blocks)
            num_computed = num_new_computed_tokens
            # Hits sitting in the free queue leave it when taken.
            num_revived = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        else:
            if new_computed_blocks or num_new_computed_tokens:
                raise ValueError(
                    f"request {request_id!r} is already admitted; cache hits are taken only once"
                )
            num_held = len(request.block_ids)
            num_computed = num_computed_tokens
            num_revived = 0

        num_tokens = num_computed + num_new_tokens
        num_needed = max(_cdiv(num_tokens + num_lookahead_tokens, self.block_size) - num_held, 0)
        if num_needed + num_revived > pool.num_free_blocks:
            return None

        if request is None:
            pool.touch(hit_blocks)
            request = _RequestBlocks(
                block_ids=[block.block_id for block in hit_blocks],
                num_tokens=num_computed,
                num_hashed_blocks=len(hit_blocks),
                last_block_hash=hit_blocks[-1].block_hash if hit_blocks else kv_cache_utils.ROOT_BLOCK_HASH,
            )
            self._requests[request_id] = request
            if self.enable_prefix_caching:
                self._queries += len(token_ids)
                self._hits += num_new_computed_tokens

        new_block_ids = [block.block_id for block in pool.allocate(num_needed)]
        request.block_ids.extend(new_block_ids)
        request.num_tokens = num_tokens
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, token_ids)
        return new_block_ids

    def num_tokens_in_place(self, request_id: str, num_lookahead_tokens: int = 0) -> int:
        """The most computed tokens the request can count, with ``num_lookahead_tokens`` slots past
        them, before ``allocate_slots`` has more to do than count them: its blocks' slots, and short
        of filling its first block not hashed yet (allocate_slots hashes a block that fills)."""
        request = self._get_request(request_id)
        limit = len(request.block_ids) * self.block_size - num_lookahead_tokens
        if self.enable_prefix_caching:
            limit = min(limit, (request.num_hashed_blocks + 1) * self.block_size - 1)
        return limit

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Counts only the request's first ``num_tokens`` tokens as computed (speculative decoding's
        rejected drafts); its blocks stay allocated, and later steps write those slots again.
        Hashed (cacheable) blocks hold known tokens only and are never cut. (The bound is the slots
        held, not the count: a caller that skips calls counts more than the manager does.)"""
        request = self._get_request(request_id)
        num_slots = len(request.block_ids) * self.block_size
        if not request.num_hashed_blocks * self.block_size <= num_tokens <= num_slots:
            raise ValueError(f"request {request_id!r}: num_tokens must be in "
                             f"[{request.num_hashed_blocks * self.block_size}, {num_slots}], got {num_tokens}")
        request.num_tokens = num_tokens

    def free(self, request_id: str) -> None:
        """Release the request's blocks and forget it; unknown ids are ignored.

        Blocks go back tail first, so a request's later blocks are evicted
        before its prefix blocks, which are the likelier to be shared.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        blocks = self.block_pool.blocks
        self.block_pool.free(blocks[i] for i in reversed(request.block_ids))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; returns False (and does nothing) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def _get_request(self, request_id: str) -> _RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no KV cache blocks") from None

    def _check_hits(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hit_blocks: list[KVCacheBlock],
        num_new_computed_tokens: int,
    ) -> None:
        if num_new_computed_tokens != len(hit_blocks) * self.block_size:
            raise ValueError(
                f"request {request_id!r}: {len(hit_blocks)} computed blocks cover "
                f"{len(hit_blocks) * self.block_size} tokens, not {num_new_computed_tokens}"
            )
        if num_new_computed_tokens > len(token_ids):
            raise ValueError(
                f"request {request_id!r}: {num_new_computed_tokens} computed tokens "
                f"but only {len(token_ids)} tokens known"
            )
        for block in hit_blocks:
            if block.block_hash is None:
                raise ValueError(
                    f"request {request_id!r}: block {block.block_id} is not cached "
                    "(was it evicted since get_computed_blocks?)"
                )

    def _cache_full_blocks(self, request: _RequestBlocks, token_ids: Sequence[int]) -> None:
        """Hash and register the request's blocks that became full with known tokens."""
        block_size = self.block_size
        num_full = min(request.num_tokens, len(token_ids)) // block_size
        if num_full <= request.num_hashed_blocks:
            return
        blocks = self.block_pool.blocks
        block_ids = request.block_ids
        parent_hash = request.last_block_hash
        for k in range(request.num_hashed_blocks, num_full):
            parent_prefix_id = blocks[block_ids[k - 1]].prefix_id if k else ROOT_PREFIX_ID
            tokens = tuple(token_ids[k * block_size : (k + 1) * block_size])
            parent_hash = kv_cache_utils.hash_block_tokens(parent_hash, tokens)
            self.block_pool.cache_full_block(blocks[block_ids[k]], parent_hash, parent_prefix_id, tokens)
        request.num_hashed_blocks = num_full
        request.last_block_hash = parent_hash
