from array import array

import pytest

from kvserve.cache import ChunkCache, LockRefError, RadixCache, SpentLockError
from kvserve.mem import MemoryPools, PoolError, ReqToTokenPool, TokenToKVPoolAllocator


def make_cache(page_size=1, num_tokens=1024):
    pools = MemoryPools(ReqToTokenPool(4, 64, page_size),
                        TokenToKVPoolAllocator(num_tokens, page_size))
    return RadixCache(pools)


def put(cache, tokens, extra_key=None):
    """Allocate pages for the uncached part of ``tokens`` and insert; returns page ids."""
    page = cache.page_size
    match = cache.match_prefix(tokens, extra_key)
    need = len(tokens) // page - len(match.page_ids)
    pages = list(match.page_ids) + cache.pools.allocator.alloc_pages(need)
    result = cache.insert(tokens, pages, extra_key)
    assert result.prefix_len == match.prefix_len
    assert cache.verify() == []
    return pages


def test_empty_tree_matches_nothing():
    cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert (list(m.page_ids), m.prefix_len) == ([], 0)
    assert cache.inc_lock_ref(m.last_node) is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_insert_then_match_whole_pages_only(page_size):
    cache = make_cache(page_size)
    tokens = list(range(100, 100 + 3 * page_size + page_size // 2))
    pages = put(cache, tokens)
    assert len(pages) == len(tokens) // page_size == 3
    m = cache.match_prefix(tokens)
    assert m.prefix_len == len(tokens) // page_size * page_size
    assert list(m.page_ids) == pages
    m = cache.match_prefix(tokens[: 2 * page_size + 1])
    assert m.prefix_len == (2 * page_size + 1) // page_size * page_size
    assert list(m.page_ids) == pages[: m.prefix_len // page_size]
    assert cache.evictable_size() == len(pages) * page_size


def test_partial_last_page_is_never_cached():
    cache = make_cache(16)
    cache.insert(list(range(20)), cache.pools.allocator.alloc_pages(2))
    assert cache.evictable_size() == 16
    assert cache.match_prefix(list(range(20))).prefix_len == 16
    assert cache.match_prefix(list(range(15))).prefix_len == 0


def test_match_splits_node_and_never_locks_or_allocates():
    cache = make_cache(4)
    pages = put(cache, list(range(16)))
    free_before = cache.pools.allocator.available_size()
    assert cache.num_nodes() == 2
    m = cache.match_prefix(list(range(8)) + [99] * 8)
    assert m.prefix_len == 8 and list(m.page_ids) == pages[:2]
    assert cache.num_nodes() == 3  # split at the page boundary
    assert cache.pools.allocator.available_size() == free_before
    assert cache.protected_size() == 0 and cache.evictable_size() == 16
    assert cache.verify() == []


def test_divergence_inside_a_page_matches_up_to_the_page_before():
    cache = make_cache(4)
    pages = put(cache, list(range(12)))
    key = list(range(6)) + [77] * 6  # differs at token 6, inside page 1
    assert cache.match_prefix(key).prefix_len == 4
    other = put(cache, key)
    assert other[0] == pages[0] and other[1] not in pages
    assert cache.evictable_size() == 12 + 8


def test_insert_reports_what_was_already_cached():
    cache = make_cache(2)
    put(cache, [1, 2, 3, 4])
    alloc = cache.pools.allocator
    dup = alloc.alloc_pages(3)
    res = cache.insert([1, 2, 3, 4, 5, 6], dup)
    assert res.prefix_len == 4
    alloc.free(dup[:2])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids[2] == dup[2]
    with pytest.raises(ValueError, match="page ids"):
        cache.insert([1, 2, 3, 4, 9, 9, 9, 9], [1])
    with pytest.raises(PoolError, match="page 0 is reserved"):
        cache.insert([5, 5, 5, 5], [0, 0])
    with pytest.raises(PoolError, match="is free, not an allocated page"):
        cache.insert([5, 5, 5, 5], alloc.free_page_ids()[:2])
    assert cache.verify() == [] and cache.match_prefix([5, 5]).prefix_len == 0


def test_extra_key_namespaces_do_not_share():
    cache = make_cache()
    put(cache, [1, 2, 3], extra_key="lora-a")
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    assert cache.match_prefix([1, 2, 3], "lora-b").prefix_len == 0
    assert cache.match_prefix([1, 2, 3], "lora-a").prefix_len == 3
    put(cache, [1, 2, 3])
    assert cache.evictable_size() == 6


def test_token_ids_outside_int32_raise():
    cache = make_cache()
    with pytest.raises(OverflowError):
        cache.match_prefix([2**31])


def test_lru_evicts_least_recently_used_leaf_first():
    cache = make_cache(1, 64)
    a = put(cache, [1, 1, 1])
    b = put(cache, [2, 2, 2])
    c = put(cache, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # a is now the most recent
    alloc = cache.pools.allocator
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).prefix_len == 0
    assert sorted(alloc.free_page_ids()[-3:]) == sorted(b)
    assert cache.evict(3) == 3
    assert cache.match_prefix([3, 3, 3]).prefix_len == 0
    assert cache.match_prefix([1, 1, 1]).page_ids.tolist() == a
    assert c  # evicted pages went back to the allocator
    assert alloc.available_size() == 64 - 3


def test_parent_that_becomes_a_leaf_reenters_at_its_own_access_time():
    cache = make_cache(1, 64)
    put(cache, [5, 5, 1])  # shared parent [5, 5] after the next insert
    put(cache, [5, 5, 2])
    put(cache, [9, 9])  # newer than the parent's last access
    assert cache.evict(2) == 2  # both leaves under [5, 5]
    assert cache.match_prefix([5, 5]).prefix_len == 2
    cache.match_prefix([9, 9])  # [9, 9] newer again
    assert cache.evict(1) == 2  # the parent, now a leaf, goes before [9, 9]
    assert cache.match_prefix([5, 5]).prefix_len == 0
    assert cache.match_prefix([9, 9]).prefix_len == 2
    assert cache.verify() == []


def test_locked_node_and_its_ancestors_are_never_evicted():
    cache = make_cache(1, 64)
    put(cache, [1, 2])
    put(cache, [1, 2, 3, 4])
    put(cache, [7, 7])
    lock = cache.inc_lock_ref(cache.match_prefix([1, 2, 3, 4]).last_node)
    assert lock.prefix_len == 4
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert cache.evictable_size() == 0
    cache.dec_lock_ref(lock)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    with pytest.raises(LockRefError):
        cache.dec_lock_ref(lock)
    assert cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert cache.evictable_size() == 0
    assert cache.verify() == []


def two_requests_lock_one_node(cache):
    """[1, 2] -> {[3, 4], [9]}; requests A and B both lock [1, 2, 3, 4]."""
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 9])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    return node, cache.inc_lock_ref(node), cache.inc_lock_ref(node)


def test_two_requests_lock_a_node_and_a_second_unlock_with_a_spent_receipt_raises():
    cache = make_cache(1, 64)
    node, lock_a, lock_b = two_requests_lock_one_node(cache)
    assert (node.lock_ref, node.parent.lock_ref) == (2, 2)
    cache.dec_lock_ref(lock_a)
    with pytest.raises(SpentLockError, match="spent receipt"):
        cache.dec_lock_ref(lock_a)  # B still locks the node: it used to take B's lock
    assert (node.lock_ref, node.parent.lock_ref) == (1, 1)  # B's lock is intact
    assert cache.lock_path_counts([lock_b]) == [] and cache.verify() == []
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert cache.evict(100) == 1  # only the unlocked [9]
    cache.dec_lock_ref(lock_b)
    assert (node.lock_ref, node.parent.lock_ref) == (0, 0)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4


def test_a_spent_receipt_raises_also_while_unlocks_are_deferred():
    cache = make_cache(1, 64)
    node, lock_a, lock_b = two_requests_lock_one_node(cache)
    with cache.deferring(batch_id=7):
        cache.dec_lock_ref(lock_a)  # held back until batch 7's results
        with pytest.raises(SpentLockError):
            cache.dec_lock_ref(lock_a)
    assert cache.deferred_locks() == [lock_a] and node.lock_ref == 2
    cache.release_deferred(7)
    assert (node.lock_ref, node.parent.lock_ref) == (1, 1)
    assert cache.lock_path_counts([lock_b]) == [] and cache.verify() == []


def test_equal_receipts_of_two_requests_are_two_receipts():
    cache = make_cache(1, 64)
    _, lock_a, lock_b = two_requests_lock_one_node(cache)
    assert (lock_a.node, lock_a.prefix_len) == (lock_b.node, lock_b.prefix_len)
    assert lock_a != lock_b
    cache.dec_lock_ref(lock_a)
    assert (lock_a.spent, lock_b.spent) == (True, False)


def test_lock_survives_a_split_of_the_locked_path():
    cache = make_cache(1, 64)
    put(cache, [1, 2, 3, 4])
    lock = cache.inc_lock_ref(cache.match_prefix([1, 2, 3, 4]).last_node)
    put(cache, [1, 2, 9])  # splits the locked node
    assert cache.verify() == []
    assert cache.lock_path_counts([lock]) == []
    assert cache.lock_page_ids(lock) == cache.match_prefix([1, 2, 3, 4]).page_ids.tolist()
    cache.dec_lock_ref(lock)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5


def test_reset_returns_pages_and_refuses_while_locked():
    cache = make_cache(1, 32)
    put(cache, [1, 2, 3])
    lock = cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    with pytest.raises(LockRefError):
        cache.reset()
    cache.dec_lock_ref(lock)
    cache.reset()
    assert cache.pools.allocator.available_size() == 32
    assert cache.evictable_size() == 0 and cache.num_nodes() == 1


def _eviction_cost(num_leaves, evict_leaves):
    cache = make_cache(1, 4 * num_leaves)
    for i in range(num_leaves):
        put(cache, [i + 1, 0, 0, 0])
    for i in range(1, num_leaves, 2):  # touch every other leaf
        cache.match_prefix([i + 1, 0, 0, 0])
    cache.stats.heap_ops = cache.stats.nodes_visited = cache.stats.evicted_leaves = 0
    assert cache.evict(4 * evict_leaves) == 4 * evict_leaves
    stats = cache.stats
    assert stats.evicted_leaves == evict_leaves
    assert cache.verify() == []
    return stats.heap_ops / evict_leaves, stats.nodes_visited / evict_leaves


def test_eviction_cost_per_leaf_does_not_grow_with_the_tree():
    small = _eviction_cost(200, 50)
    large = _eviction_cost(2000, 50)
    # One pop per evicted leaf, plus a pop and a push for each leaf touched since it
    # was pushed: at most 3 heap operations and 2 visited nodes per evicted leaf.
    assert small == large == (3.0 - 2 / 50, 2.0 - 1 / 50)


def test_chunk_cache_shares_nothing():
    pools = MemoryPools(ReqToTokenPool(2, 16), TokenToKVPoolAllocator(16, 1))
    cache = ChunkCache(pools)
    assert cache.insert([1, 2], [1, 2]).prefix_len == 0
    m = cache.match_prefix([1, 2])
    assert (m.prefix_len, list(m.page_ids)) == (0, [])
    assert cache.inc_lock_ref(m.last_node) is None
    assert cache.evict(10) == 0
    assert cache.evictable_size() == cache.protected_size() == 0
    assert list(cache.cached_page_ids()) == [] and cache.verify() == []
    assert isinstance(m.page_ids, array)
