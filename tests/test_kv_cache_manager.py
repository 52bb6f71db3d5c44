"""Tests of KV cache block bookkeeping and prefix caching (pure Python, fast)."""

import random

import pytest

from novainfer.core import KVCacheManager, kv_cache_utils

BS = 4  # block size used throughout


def admit(manager: KVCacheManager, request_id: str, tokens: list[int], num_new_tokens: int | None = None):
    """Admission as the scheduler does it: look up hits, then allocate the rest."""
    hit_ids, num_hit = manager.get_computed_blocks(request_id, tokens)
    if num_new_tokens is None:
        num_new_tokens = len(tokens) - num_hit
    new_ids = manager.allocate_slots(request_id, tokens, num_new_tokens, hit_ids, num_hit)
    return hit_ids, num_hit, new_ids


def ref_counts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def is_cached(manager: KVCacheManager, block_id: int) -> bool:
    return manager.block_pool.blocks[block_id].block_hash is not None


# --- construction and helpers ---------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (4, 1.5), (True, 4), ("8", 4)]
)
def test_constructor_rejects_bad_arguments(num_blocks, block_size):
    with pytest.raises(ValueError, match="positive int"):
        KVCacheManager(num_blocks, block_size)


def test_can_fit():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    assert manager.can_fit(0)
    assert manager.can_fit(16)
    assert not manager.can_fit(17)
    with pytest.raises(ValueError):
        manager.can_fit(-1)


# --- allocation -----------------------------------------------------------------


def test_allocation_grows_block_table_exactly_as_needed():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(5))
    assert manager.allocate_slots("a", tokens, 5) == [0, 1]
    assert manager.get_block_ids("a") == [0, 1]
    # Decode one token per step: a new block exactly when token 9 needs a slot.
    for next_token in range(5, 12):
        tokens.append(next_token)
        new_ids = manager.allocate_slots("a", tokens, 1)
        assert new_ids == ([2] if len(tokens) == 9 else [])
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)


def test_chunked_prefill_hashes_only_blocks_full_so_far():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(10))
    assert manager.allocate_slots("a", tokens, 3) == [0]
    assert not is_cached(manager, 0)
    assert manager.allocate_slots("a", tokens, 3) == [1]
    assert [is_cached(manager, i) for i in (0, 1)] == [True, False]
    assert manager.allocate_slots("a", tokens, 4) == [2]
    assert [is_cached(manager, i) for i in (0, 1, 2)] == [True, True, False]


def test_blocks_beyond_known_tokens_are_not_hashed():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(6))
    # Slots for 8 tokens, only 6 known: block 1 is full of slots but not of tokens.
    assert manager.allocate_slots("a", tokens, 8) == [0, 1]
    assert [is_cached(manager, i) for i in (0, 1)] == [True, False]
    tokens += [6, 7]
    assert manager.allocate_slots("a", tokens, 0) == []
    assert is_cached(manager, 1)


def test_hashing_is_incremental(monkeypatch):
    calls = []
    real_hash = kv_cache_utils.hash_block_tokens

    def counting_hash(parent_hash, token_ids):
        calls.append(tuple(token_ids))
        return real_hash(parent_hash, token_ids)

    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", counting_hash)
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(5))
    manager.allocate_slots("a", tokens, 5)
    for next_token in range(5, 30):
        tokens.append(next_token)
        manager.allocate_slots("a", tokens, 1)
    # Each full block hashed exactly once, in order, whatever the number of steps.
    assert calls == [tuple(tokens[k * BS : (k + 1) * BS]) for k in range(len(tokens) // BS)]


def test_out_of_blocks_returns_none_and_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    tokens_a = list(range(12))
    assert admit(manager, "a", tokens_a)[2] == [0, 1, 2]
    # "b" needs 2 blocks, 1 is free.
    assert admit(manager, "b", list(range(100, 108)))[2] is None
    assert manager.num_free_blocks == 1
    assert manager.prefix_cache_stats.queries == 12
    with pytest.raises(KeyError, match="'b'"):
        manager.get_block_ids("b")
    assert admit(manager, "b", list(range(100, 104)))[2] == [3]

    # A decode step that needs a new block fails without touching "a"...
    tokens_a.append(12)
    assert manager.allocate_slots("a", tokens_a, 1) is None
    assert manager.get_block_ids("a") == [0, 1, 2]
    # ...and succeeds unchanged once room is made.
    manager.free("b")
    assert manager.allocate_slots("a", tokens_a, 1) == [3]
    assert manager.get_block_ids("a") == [0, 1, 2, 3]


def test_hits_in_free_queue_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    tokens_a = list(range(13))
    assert admit(manager, "a", tokens_a)[2] == [0, 1, 2, 3]
    manager.free("a")  # queue: 4, 3, 2, 1, 0
    assert admit(manager, "x", list(range(100, 108)))[2] == [4, 3]
    assert manager.block_pool.free_queue.block_ids() == [2, 1, 0]  # all three cached

    # "b" hits 3 free cached blocks and needs 1 new one: 4 > 3 free.
    hit_ids, num_hit = manager.get_computed_blocks("b", tokens_a)
    assert (hit_ids, num_hit) == ([0, 1, 2], 12)
    assert manager.allocate_slots("b", tokens_a, 1, hit_ids, num_hit) is None
    assert manager.num_free_blocks == 3
    assert manager.block_pool.free_queue.block_ids() == [2, 1, 0]
    assert ref_counts(manager, [0, 1, 2]) == [0, 0, 0]
    assert manager.get_computed_blocks("b", tokens_a) == ([0, 1, 2], 12)
    assert manager.prefix_cache_stats.queries == 13 + 8  # the failed admission is not counted

    manager.free("x")  # queue: 2, 1, 0, 3, 4
    assert manager.allocate_slots("b", tokens_a, 1, hit_ids, num_hit) == [3]
    assert manager.get_block_ids("b") == [0, 1, 2, 3]
    assert ref_counts(manager, [0, 1, 2, 3]) == [1, 1, 1, 1]
    assert manager.block_pool.free_queue.block_ids() == [4]


def test_free_returns_all_blocks_and_ignores_unknown_requests():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    admit(manager, "a", list(range(10)))
    admit(manager, "b", list(range(100, 105)))
    assert manager.num_free_blocks == 3
    manager.free("a")
    manager.free("b")
    manager.free("b")
    manager.free("never-seen")
    assert manager.num_free_blocks == 8
    assert manager.usage == 0.0
    with pytest.raises(KeyError):
        manager.get_block_ids("a")


# --- prefix caching ---------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_stats():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    tokens_a = list(range(14))  # 3 full blocks + 2 tokens
    assert admit(manager, "a", tokens_a) == ([], 0, [0, 1, 2, 3])

    tokens_b = tokens_a[:8] + [100, 101, 102, 103, 104]
    hit_ids, num_hit, new_ids = admit(manager, "b", tokens_b)
    assert (hit_ids, num_hit) == ([0, 1], 8)
    assert new_ids == [4, 5]
    assert manager.get_block_ids("b") == [0, 1, 4, 5]
    assert ref_counts(manager, [0, 1, 2, 3, 4, 5]) == [2, 2, 1, 1, 1, 1]

    stats = manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (14 + 13, 8)
    assert stats.hit_rate == pytest.approx(8 / 27)

    # Freeing one sharer keeps the shared blocks in use.
    manager.free("a")
    assert ref_counts(manager, [0, 1, 2, 3]) == [1, 1, 0, 0]
    assert manager.num_free_blocks == 16 - 4


def test_fully_cached_prompt_still_computes_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))  # a multiple of the block size
    admit(manager, "a", prompt)
    # All 3 blocks are cached, but the last token must be computed: the last
    # whole block is dropped, hit = len - block_size.
    assert manager.get_computed_blocks("b", prompt) == ([0, 1], 12 - BS)
    # Not a multiple: hit = len - 1.
    admit(manager, "c", list(range(200, 213)))
    assert manager.get_computed_blocks("d", list(range(200, 213))) == ([3, 4, 5], 12)


def test_recomputed_duplicate_block_keeps_the_chain_hittable():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))
    admit(manager, "a", prompt)  # blocks 0, 1, 2
    tokens_b = list(prompt)
    assert admit(manager, "b", tokens_b)[:3] == ([0, 1], 8, [3])
    # Block 3 now holds the same prefix as block 2; the map keeps block 2.
    assert not is_cached(manager, 3)
    for next_token in range(50, 55):
        tokens_b.append(next_token)
        manager.allocate_slots("b", tokens_b, 1)
    assert manager.get_block_ids("b") == [0, 1, 3, 4, 5]
    # "b"'s block 4 follows its duplicate block 3, and is reached through block 2.
    probe = tokens_b + [99]
    assert manager.get_computed_blocks("c", probe) == ([0, 1, 2, 4], 16)


def test_freed_blocks_stay_hittable_until_evicted_in_lru_order():
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    tokens_a = list(range(12))
    admit(manager, "a", tokens_a)  # blocks 0, 1, 2
    manager.free("a")
    # Tail first: the prefix block 0 is the last to be reused.
    assert manager.block_pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    probe = tokens_a + [99]
    assert manager.get_computed_blocks("p", probe) == ([0, 1, 2], 12)

    assert admit(manager, "x", list(range(100, 116)))[2] == [3, 4, 5, 2]
    assert manager.get_computed_blocks("p", probe) == ([0, 1], 8)
    assert admit(manager, "y", list(range(200, 204)))[2] == [1]
    assert manager.get_computed_blocks("p", probe) == ([0], 4)
    assert admit(manager, "z", list(range(300, 304)))[2] == [0]
    assert manager.get_computed_blocks("p", probe) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 6  # the full blocks of x, y, z


def test_earliest_freed_request_is_reused_first():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    admit(manager, "a", list(range(8)))  # 0, 1
    admit(manager, "b", list(range(100, 108)))  # 2, 3
    manager.free("a")
    manager.free("b")
    assert admit(manager, "c", list(range(200, 212)))[2] == [1, 0, 3]


def test_hit_on_free_block_takes_it_out_of_the_free_queue():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    admit(manager, "a", tokens)
    manager.free("a")  # queue: 3, ..., 7, 2, 1, 0
    assert admit(manager, "b", tokens) == ([0, 1], 8, [3])
    assert ref_counts(manager, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert manager.num_free_blocks == 5
    assert manager.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 2]


def test_constant_hash_collisions_never_return_a_wrong_block(monkeypatch):
    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", lambda parent_hash, token_ids: 7)
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    admit(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0 and 1 share hash 7
    manager.free("a")

    assert manager.get_computed_blocks("q", [9, 9, 9, 9, 0]) == ([], 0)
    # The registered block 0 holds [1, 2, 3, 4] but at position 0: it is not
    # a hit for position 1 even though the tokens there are [1, 2, 3, 4].
    assert manager.get_computed_blocks("q", [1, 2, 3, 4, 1, 2, 3, 4, 0]) == ([0], 4)
    # Block 1 could not be registered under the taken hash: a miss, not a wrong block.
    assert manager.get_computed_blocks("q", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == ([0], 4)


def test_block_with_same_tokens_but_other_history_is_not_a_hit(monkeypatch):
    real_hash = kv_cache_utils.hash_block_tokens
    # A hash that forgets the parent: equal blocks collide across positions.
    monkeypatch.setattr(
        kv_cache_utils,
        "hash_block_tokens",
        lambda parent_hash, token_ids: real_hash(kv_cache_utils.ROOT_BLOCK_HASH, token_ids),
    )
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    admit(manager, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0])  # block 1 holds [2, 2, 2, 2] after [1, 1, 1, 1]
    assert manager.get_computed_blocks("q", [2, 2, 2, 2, 0]) == ([], 0)
    assert manager.get_computed_blocks("q", [1, 1, 1, 1, 2, 2, 2, 2, 0]) == ([0, 1], 8)


def test_prefix_caching_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(12))
    assert admit(manager, "a", tokens) == ([], 0, [0, 1, 2])
    assert not any(is_cached(manager, i) for i in range(8))
    assert manager.get_computed_blocks("b", tokens) == ([], 0)
    manager.free("a")
    assert manager.get_computed_blocks("b", tokens) == ([], 0)
    assert manager.prefix_cache_stats.queries == 0
    assert manager.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(13))
    admit(manager, "a", tokens)
    assert not manager.reset_prefix_cache()  # blocks in use
    assert manager.get_computed_blocks("b", tokens) == ([0, 1, 2], 12)
    manager.free("a")
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks("b", tokens) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0
    # The cache fills again afterwards.
    admit(manager, "c", tokens)
    assert manager.get_computed_blocks("d", tokens) == (manager.get_block_ids("c")[:3], 12)


# --- misuse -------------------------------------------------------------------------


def test_misuse_raises_with_context():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    admit(manager, "a", tokens)
    with pytest.raises(ValueError, match="'a' already holds blocks"):
        manager.get_computed_blocks("a", tokens)
    with pytest.raises(ValueError, match="already admitted"):
        manager.allocate_slots("a", tokens, 1, [0], BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots("a", tokens, -1)
    with pytest.raises(ValueError, match="cover 8 tokens, not 4"):
        manager.allocate_slots("b", tokens, 1, [0, 1], 4)
    with pytest.raises(ValueError, match="only 3 tokens known"):
        manager.allocate_slots("b", tokens[:3], 1, [0], 4)
    with pytest.raises(ValueError, match="block 2 is not cached"):
        manager.allocate_slots("b", tokens, 1, [2], 4)  # block 2 is partial
    assert manager.num_free_blocks == 5


# --- property test --------------------------------------------------------------------


def test_random_workload_keeps_invariants_and_hits_are_correct():
    rng = random.Random(1234)
    num_blocks = 24
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    shared_prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    # Reference model: block id -> the full token prefix its KV was computed for.
    written: dict[int, tuple[int, ...]] = {}
    active: dict[str, dict] = {}  # request id -> {"tokens", "prompt_len", "computed"}

    def record_computed(rid: str) -> None:
        req = active[rid]
        block_ids = manager.get_block_ids(rid)
        for k in range(req["computed"] // BS):
            prefix = tuple(req["tokens"][: (k + 1) * BS])
            assert written.setdefault(block_ids[k], prefix) == prefix

    def forget_reused(new_ids: list[int]) -> None:
        for block_id in new_ids:
            written.pop(block_id, None)

    def check_invariants() -> None:
        holders = [0] * num_blocks
        for rid, req in active.items():
            block_ids = manager.get_block_ids(rid)
            assert len(block_ids) == -(-req["computed"] // BS)
            for block_id in block_ids:
                holders[block_id] += 1
        assert [b.ref_cnt for b in manager.block_pool.blocks] == holders
        assert manager.num_free_blocks == holders.count(0)
        assert manager.usage == pytest.approx(1 - holders.count(0) / num_blocks)

    for step in range(3000):
        action = rng.random()
        if action < 0.3 and len(active) < 8:
            rid = f"r{step}"
            prompt = rng.choice(shared_prefixes)[: rng.randrange(13)] + [
                rng.randrange(5) for _ in range(rng.randrange(1, 10))
            ]
            hit_ids, num_hit = manager.get_computed_blocks(rid, prompt)
            assert num_hit == len(hit_ids) * BS and num_hit <= len(prompt) - 1
            for k, block_id in enumerate(hit_ids):
                assert written[block_id] == tuple(prompt[: (k + 1) * BS])
            chunk = rng.randrange(1, len(prompt) - num_hit + 1)
            new_ids = manager.allocate_slots(rid, prompt, chunk, hit_ids, num_hit)
            if new_ids is not None:
                forget_reused(new_ids)
                active[rid] = {"tokens": list(prompt), "prompt_len": len(prompt), "computed": num_hit + chunk}
                record_computed(rid)
        elif action < 0.85 and active:
            rid = rng.choice(sorted(active))
            req = active[rid]
            if req["computed"] < req["prompt_len"]:
                num_new = rng.randrange(1, req["prompt_len"] - req["computed"] + 1)
            else:
                req["tokens"].append(rng.randrange(5))  # the token sampled last step
                num_new = 1
            new_ids = manager.allocate_slots(rid, req["tokens"], num_new)
            if new_ids is None:
                manager.free(rid)  # preempted
                del active[rid]
            else:
                forget_reused(new_ids)
                req["computed"] += num_new
                record_computed(rid)
        elif active:
            rid = rng.choice(sorted(active))
            manager.free(rid)
            del active[rid]
        check_invariants()

    stats = manager.prefix_cache_stats
    assert 0 < stats.hits < stats.queries  # the workload did exercise the cache
    for rid in list(active):
        manager.free(rid)
    assert manager.num_free_blocks == num_blocks
    assert manager.usage == 0.0
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


# --- calls a caller may skip ------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tokens_in_place_stop_short_of_new_blocks_and_of_a_block_to_hash(prefix_caching):
    """Up to ``num_tokens_in_place`` a call would only count tokens; a caller that skips such calls
    passes its own count at the next one, and ``truncate`` takes its count too."""
    manager = KVCacheManager(16, BS, enable_prefix_caching=prefix_caching)
    tokens = list(range(100, 110))
    admit(manager, "a", tokens[:6])  # blocks 0-1, the first one full
    # Prefix caching: the 8th token fills the second block, which allocate_slots then hashes.
    assert manager.num_tokens_in_place("a") == (7 if prefix_caching else 8)
    assert manager.num_tokens_in_place("a", num_lookahead_tokens=3) == 5
    # Tokens 7 and 8 counted by the caller alone (skipped calls), then the 9th needs a block.
    assert manager.allocate_slots("a", tokens[:8], 1, num_computed_tokens=8) == [2]
    assert manager._requests["a"].num_tokens == 9
    assert manager._requests["a"].num_hashed_blocks == (2 if prefix_caching else 0)
    manager.truncate("a", 10)  # a count past the manager's own (skipped calls), within the slots held
    assert manager._requests["a"].num_tokens == 10
    with pytest.raises(ValueError):
        manager.truncate("a", 13)
