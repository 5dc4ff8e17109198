import pytest

import paged_ref as pr


def test_bump_pointer_then_free_list_oldest_first():  # (cached pages: tests/test_cache_reuse.py)
    alloc = pr.PageAllocator(6)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.free([1])
    alloc.free([0])
    assert alloc.allocate(3) == [3, 4, 5]  # never-used pages first
    assert alloc.allocate(2) == [1, 0]  # then returned pages, oldest first
    assert alloc.num_free == 0
    alloc.check()


def test_out_of_pages_is_atomic_and_informative():
    alloc = pr.PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(pr.OutOfPagesError, match=r"requested 2 page\(s\) but only 1") as err:
        alloc.allocate(2)
    assert isinstance(err.value, MemoryError)
    assert (err.value.requested, err.value.free) == (2, 1)
    assert alloc.num_free == 1
    assert alloc.allocate(1) == [3]
    alloc.check()


def test_refcounts_share_and_free():
    alloc = pr.PageAllocator(3)
    (p,) = alloc.allocate()
    alloc.share([p])
    assert alloc.refcount(p) == 2
    alloc.free([p])
    assert alloc.refcount(p) == 1 and alloc.num_free == 2
    alloc.free([p])
    assert alloc.refcount(p) == 0 and alloc.num_free == 3
    alloc.check()


def test_free_of_unallocated_page_changes_nothing():
    alloc = pr.PageAllocator(4)
    a, b = alloc.allocate(2)
    with pytest.raises(ValueError, match="cannot free page 3"):
        alloc.free([a, 3])  # a would be freed first by a naive loop
    assert alloc.refcount(a) == 1 and alloc.num_free == 2
    with pytest.raises(ValueError, match=f"cannot free page {b} 2 time"):
        alloc.free([b, b])
    assert alloc.refcount(b) == 1
    alloc.check()


def test_share_of_free_page_raises():
    alloc = pr.PageAllocator(2)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share([1])


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda: pr.PageAllocator(0), ValueError, "num_pages must be >= 1, got 0"),
        (lambda: pr.PageAllocator(2.5), TypeError, "num_pages must be an int"),
        (lambda: pr.PageAllocator(2).allocate(0), ValueError, "n must be >= 1, got 0"),
        (lambda: pr.PageAllocator(2).allocate(-1), ValueError, "n must be >= 1"),
        (lambda: pr.PageAllocator(2).refcount(2), ValueError, r"page must be in \[0, 2\), got 2"),
        (lambda: pr.PageAllocator(2).free(1), TypeError, "pages must be a list"),
        (lambda: pr.PageAllocator(2).free([-1]), ValueError, "pages must be in"),
    ],
)
def test_bad_arguments(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_check_detects_corruption():
    alloc = pr.PageAllocator(3)
    alloc.allocate(2)
    alloc._refcount[0] = 0  # corrupt: refcount 0 but not on the free list
    with pytest.raises(AssertionError, match="page 0 has refcount 0 but is not free"):
        alloc.check()
    alloc = pr.PageAllocator(3)
    alloc.allocate(1)
    alloc._free[2] = None  # corrupt: a never-used page on the free list
    with pytest.raises(AssertionError, match="both never-used and returned"):
        alloc.check()


def test_scalars_huge_pools_and_unknown_pages_are_named():
    import numpy as np

    alloc = pr.PageAllocator(4)
    alloc.allocate(2)
    with pytest.raises(TypeError, match="pages must be a list of page ids, got int64"):
        alloc.free(np.int64(3))
    with pytest.raises(TypeError, match="pages must be a list of page ids"):
        alloc.share(np.int64(1))
    with pytest.raises(ValueError, match=r"page must be in \[0, 4\), got 99"):
        alloc.is_returned(99)  # as refcount(99) does
    with pytest.raises(ValueError, match=r"page must be in \[0, 4\), got 99"):
        alloc.refcount(99)
    assert alloc.num_free == 2 and [alloc.refcount(p) for p in range(4)] == [1, 1, 0, 0]
    with pytest.raises(MemoryError, match="num_pages=10000000000000"):
        pr.PageAllocator(10**13)


@pytest.mark.parametrize("huge", [2**63, 10**30])
def test_a_pool_beyond_int64_pages_is_refused_by_name(huge):
    with pytest.raises(ValueError, match=rf"num_pages must be in \[1, {2**63 - 1}\], got {huge}"):
        pr.PageAllocator(huge)
