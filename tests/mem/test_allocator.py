import pytest

from kvserve.mem import DoubleFreeError, PoolError, TokenToKVPoolAllocator


@pytest.mark.parametrize("page_size", [1, 16])
def test_fresh_pool_hands_out_pages_from_one_and_never_page_zero(page_size):
    alloc = TokenToKVPoolAllocator(8 * page_size, page_size)
    assert alloc.num_pages == 8
    assert alloc.size == 8 * page_size
    assert alloc.available_size() == 8 * page_size
    assert alloc.alloc_pages(3) == [1, 2, 3]
    assert alloc.page_state(0) == "reserved"


def test_alloc_order_and_sizes():
    alloc = TokenToKVPoolAllocator(64, 16)
    assert alloc.alloc_pages(2) == [1, 2]
    assert alloc.available_size() == 32
    assert alloc.alloc(17) == [3, 4]
    assert alloc.alloc(1) is None
    assert alloc.available_size() == 0
    assert alloc.state_counts() == {"used": 4, "free": 0, "reserved": 1, "pending release": 0}


def test_capacity_is_rounded_down_to_whole_pages():
    alloc = TokenToKVPoolAllocator(40, 16)
    assert alloc.num_pages == 2
    assert alloc.size == 32


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_zero_never_handed_out_by_any_pattern(page_size):
    alloc = TokenToKVPoolAllocator(10 * page_size, page_size)
    seen = set()
    for round_ in range(5):
        held = []
        for n in (1, 3, 2, 4):
            pages = alloc.alloc_pages(n)
            if pages is None:
                continue
            held.append(pages)
            seen.update(pages)
        for pages in held[round_ % 2 :: 2] + held[1 - round_ % 2 :: 2]:
            alloc.free(pages)
    assert 0 not in seen
    assert seen == set(range(1, 11))
    assert alloc.available_pages() == 10


def test_short_alloc_takes_nothing():
    alloc = TokenToKVPoolAllocator(4, 1)
    assert alloc.alloc_pages(5) is None
    assert alloc.alloc_pages(-1) is None
    assert alloc.available_size() == 4
    assert alloc.alloc_pages(0) == []


def test_alloc_extend_continues_partly_filled_last_page():
    alloc = TokenToKVPoolAllocator(160, 16)
    assert len(alloc.alloc_extend(20, 12)) == 0  # 20 -> 32 tokens: still 2 pages
    assert len(alloc.alloc_extend(20, 13)) == 1  # 33 tokens: a third page
    assert len(alloc.alloc_extend(0, 33)) == 3
    assert len(alloc.alloc_extend(32, 1)) == 1
    assert alloc.available_pages() == 10 - 5


def test_double_free_raises_and_changes_nothing():
    alloc = TokenToKVPoolAllocator(8, 1)
    a = alloc.alloc_pages(4)
    alloc.free(a[:2])
    with pytest.raises(DoubleFreeError, match="freed while free"):
        alloc.free([a[2], a[0]])
    assert alloc.available_pages() == 6
    assert alloc.page_state(a[2]) == "used"  # the good page before the bad one was rolled back
    with pytest.raises(DoubleFreeError):
        alloc.free([a[3], a[3]])
    assert alloc.page_state(a[3]) == "used"


def test_a_page_listed_twice_in_one_free_is_named_and_nothing_is_freed():
    alloc = TokenToKVPoolAllocator(8, 1)
    pages = alloc.alloc_pages(8)
    alloc.free(pages[:1])
    state, free_ids = alloc.state_bytes(), alloc.free_page_ids()
    with pytest.raises(DoubleFreeError, match=r"^page 7 listed twice in one free\(\) call$"):
        alloc.free([2, 7, 3, 7, 4])
    assert alloc.state_bytes() == state and alloc.free_page_ids() == free_ids == [1]
    assert alloc.state_counts() == {"used": 7, "free": 1, "reserved": 1, "pending release": 0}
    alloc.free([2, 7, 3, 4])  # each page once: fine
    assert alloc.free_page_ids() == [1, 2, 7, 3, 4]


def test_a_page_listed_twice_in_a_free_group_or_deferred_free_is_named():
    alloc = TokenToKVPoolAllocator(8, 1)
    pages = alloc.alloc_pages(3)
    with pytest.raises(DoubleFreeError, match=r"^page 2 listed twice in one free_group\(\) "
                       r"block$"), alloc.free_group():
        alloc.free(pages[:2])
        alloc.free([2])
    with pytest.raises(DoubleFreeError, match=r"^page 3 listed twice in one defer_free\(\) "
                       r"call$"):
        alloc.defer_free(9, [3, 3])
    assert alloc.state_counts()["used"] == 3 and alloc.deferred_batches() == {}
    assert alloc.available_pages() == 5


def test_free_of_reserved_or_out_of_range_page_raises():
    alloc = TokenToKVPoolAllocator(8, 1)
    with pytest.raises(DoubleFreeError, match="reserved"):
        alloc.free([0])
    with pytest.raises(PoolError, match="outside"):
        alloc.free([9])
    with pytest.raises(PoolError, match="outside"):
        alloc.free([-1])


def test_bad_construction():
    with pytest.raises(PoolError):
        TokenToKVPoolAllocator(8, 0)
    with pytest.raises(PoolError):
        TokenToKVPoolAllocator(8, 16)


def test_free_group_applies_at_exit():
    alloc = TokenToKVPoolAllocator(8, 1)
    pages = alloc.alloc_pages(4)
    with alloc.free_group():
        alloc.free(pages[:2])
        with alloc.free_group():  # nested groups join the outer one
            alloc.free(pages[2:])
        assert alloc.available_pages() == 4
    assert alloc.available_pages() == 8


def test_free_group_detects_double_free_at_exit():
    alloc = TokenToKVPoolAllocator(8, 1)
    pages = alloc.alloc_pages(2)
    with pytest.raises(DoubleFreeError), alloc.free_group():
        alloc.free(pages)
        alloc.free(pages[:1])
    assert alloc.available_pages() == 6


def test_deferred_release_waits_for_its_batch():
    alloc = TokenToKVPoolAllocator(8, 1)
    a, b = alloc.alloc_pages(2), alloc.alloc_pages(3)
    with alloc.deferring(7):
        alloc.free(a)
    alloc.defer_free(8, b)
    assert alloc.available_pages() == 3
    assert alloc.pending_release_size() == 5
    assert alloc.deferred_batches() == {7: a, 8: b}
    assert alloc.page_state(a[0]) == "pending release"
    with pytest.raises(DoubleFreeError):
        alloc.free(a)
    assert alloc.release_deferred(7) == 2
    assert alloc.release_deferred(7) == 0
    assert alloc.available_pages() == 5
    assert alloc.release_deferred(8) == 3
    assert alloc.pending_release_size() == 0
    assert alloc.available_pages() == 8
