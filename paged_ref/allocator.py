"""Physical page allocator: a bump pointer, a free list and reference counts.

Pages are handed out in O(1) each, in vLLM's reuse order: never-used pages (a bump pointer),
then returned pages holding nothing worth keeping (oldest first), then returned pages that still
hold a cached prefix (``free(..., cached=...)``), least recently returned first. So a cached
prefix survives as long as anything else is free; callers return a sequence's pages tail first,
so a cached chain loses its tail before its head. Reference counts let sequences share a page
(fork, prefix sharing); a page is free again when its count drops to zero.

Example:
    >>> alloc = PageAllocator(4)
    >>> alloc.allocate(3)
    [0, 1, 2]
    >>> alloc.share([1]); alloc.refcount(1)
    2
    >>> alloc.free([0, 1]); alloc.num_free
    2
"""

from __future__ import annotations

from collections import Counter

from ._validate import check_int, check_list


class OutOfPagesError(MemoryError):
    """Raised when an allocation asks for more pages than are free (nothing is allocated)."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"requested {requested} page(s) but only {free} of the pool are free")
        self.requested = requested
        self.free = free


class PageAllocator:
    """Hands out physical page ids ``0 .. num_pages-1`` with reference counts."""

    def __init__(self, num_pages: int):
        self._num_pages = check_int("num_pages", num_pages, min_value=1, max_value=2**63 - 1)
        self._next_fresh = 0  # bump pointer: pages >= this have never been handed out
        self._free: dict[int, None] = {}  # returned plain pages, insertion-ordered (oldest first)
        self._cached: dict[int, None] = {}  # returned pages holding a cached prefix (LRU first)
        try:
            self._refcount = [0] * self._num_pages  # refcount[page] >= 1 <=> allocated
        except MemoryError:
            raise MemoryError(
                f"num_pages={num_pages} does not fit in memory: the allocator keeps a reference count "
                f"per page, {8 * num_pages / 2**30:,.0f} GiB for this many"
            ) from None

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._num_pages - self._next_fresh + len(self._free) + len(self._cached)

    def can_allocate(self, n: int = 1) -> bool:
        return check_int("n", n, min_value=0) <= self.num_free

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` pages (refcount 1 each). All or nothing: raises OutOfPagesError."""
        n = check_int("n", n, min_value=1)
        if n > self.num_free:
            raise OutOfPagesError(n, self.num_free)
        fresh = min(n, self._num_pages - self._next_fresh)
        pages = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        for _ in range(n - fresh):  # then returned pages: plain ones first, cached ones last
            pool = self._free if self._free else self._cached
            page = next(iter(pool))
            del pool[page]
            pages.append(page)
        for page in pages:
            self._refcount[page] = 1
        return pages

    def take(self, page: int) -> None:
        """Claim one specific free page that was returned earlier (a prefix-cache revival)."""
        page = self._check_page("page", page)
        if not self.is_returned(page):
            raise ValueError(f"page {page} is not on the free list (refcount {self._refcount[page]})")
        self._free.pop(page, None)
        self._cached.pop(page, None)
        self._refcount[page] = 1

    def is_returned(self, page: int) -> bool:
        """True if ``page`` is on the free list (it was used before and is now free)."""
        page = self._check_page("page", page)
        return page in self._free or page in self._cached

    def share(self, pages) -> None:
        """Add one reference to each allocated page (fork, prefix sharing)."""
        pages = self._check_pages(pages)
        for page in pages:
            if self._refcount[page] == 0:
                raise ValueError(f"pages: cannot share page {page}: it is not allocated")
        for page in pages:
            self._refcount[page] += 1

    def free(self, pages, *, cached=()) -> None:
        """Drop one reference per listed page; a page returns to the free list, in the order
        listed, at zero. Those in ``cached`` hold a reusable prefix: handed out again last.
        Raises ValueError, changing nothing, if any page would drop below zero.
        """
        pages = self._check_pages(pages)
        cached = set(self._check_pages(cached, "cached"))
        for page, times in Counter(pages).items():
            if self._refcount[page] < times:
                raise ValueError(
                    f"pages: cannot free page {page} {times} time(s): its refcount is "
                    f"{self._refcount[page]} (not allocated or freed too often)"
                )
        for page in pages:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                (self._cached if page in cached else self._free)[page] = None

    def snapshot(self) -> tuple:
        """The allocator's whole state, for `restore` (a rollback: `PagedKVCache.rollback`)."""
        return self._next_fresh, dict(self._free), dict(self._cached), list(self._refcount)

    def restore(self, snapshot: tuple) -> None:
        """Put the allocator back as `snapshot` saw it."""
        next_fresh, free, cached, refcount = snapshot
        self._next_fresh, self._refcount = next_fresh, list(refcount)
        self._free, self._cached = dict(free), dict(cached)

    def refcount(self, page: int) -> int:
        return self._refcount[self._check_page("page", page)]

    def check(self) -> None:
        """AssertionError unless every page is free with refcount 0 (never used, or on one free
        list once) or allocated with refcount >= 1."""
        assert 0 <= self._next_fresh <= self._num_pages, "bump pointer out of range"
        for page, count in enumerate(self._refcount):
            fresh = page >= self._next_fresh
            returned = page in self._free or page in self._cached
            assert not (page in self._free and page in self._cached), f"page {page} is on both free lists"
            assert count >= 0, f"page {page} has negative refcount {count}"
            assert not (fresh and returned), f"page {page} is both never-used and returned"
            if count == 0:
                assert fresh or returned, f"page {page} has refcount 0 but is not free"
            else:
                assert not (fresh or returned), f"page {page} is free but has refcount {count}"

    def _check_page(self, name: str, page) -> int:
        page = check_int(name, page)
        if not 0 <= page < self._num_pages:
            raise ValueError(f"{name} must be in [0, {self._num_pages}), got {page}")
        return page

    def _check_pages(self, pages, name: str = "pages") -> list[int]:
        return [self._check_page(name, p) for p in check_list(name, pages, "page ids")]

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._num_pages}, num_free={self.num_free})"
