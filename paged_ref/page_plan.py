"""What a cache operation will take from the pool and give back, counted before anything changes.

Every `PagedKVCache` operation is all or nothing: it first asks these functions how many pages
it needs (new pages, and private copies of the shared pages its tokens land in), raises
`OutOfPagesError` if the pool is short, and only then changes the cache. They change nothing.

Example:
    >>> refs = {0: 2, 1: 1}.get                    # page 0 is shared by two sequences
    >>> plan_growth([([0], 3, 2)], refs, page_size=4)  # 2 tokens after 3: page 0 copied, 1 new page
    [[[0], 1]]
    >>> truncate_cost([0, 1], 6, 3, refs, page_size=4)  # keep 3 tokens in shared page 0: copy it
    (True, 1)
"""

from __future__ import annotations

from collections.abc import Callable

from ._arith import cdiv, next_pow2

__all__ = ["compact_copies", "plan_growth", "round_to_pow2", "truncate_cost"]


def plan_growth(requests, refcount: Callable[[int], int], *, page_size: int) -> list[list]:
    """Per ``(pages, length, num_tokens)`` request, ``[logical pages to copy, pages to add]``.

    A held page the new tokens land in is copied when it is shared, counting the copies that
    earlier requests of the batch make of it (the last holder writes in place).
    """
    refs: dict[int, int] = {}  # a page's refcount once the requests before have copied it away
    plans = []
    for pages, length, n in requests:
        need = cdiv(length + n, page_size)
        copies = []
        for i in range(length // page_size, min(need, len(pages))):  # held pages the new tokens land in
            page = pages[i]
            refs.setdefault(page, refcount(page))
            if refs[page] > 1:  # shared: this sequence writes into its own copy
                copies.append(i)
                refs[page] -= 1
        plans.append([copies, max(0, need - len(pages))])
    return plans


def round_to_pow2(plans: list[list], held: list[int], spare: int) -> None:
    """``growth="pow2"``: round each growing sequence (holding ``held[i]`` pages) up to a
    power-of-two page count, in order, while the ``spare`` pages the batch does not need allow."""
    for plan, n in zip(plans, held):
        extra = next_pow2(n + plan[1]) - n - plan[1] if plan[1] else 0
        if extra <= spare:
            plan[1] += extra
            spare -= extra


def truncate_cost(pages: list[int], length: int, num_tokens: int, refcount, *, page_size: int) -> tuple[bool, int]:
    """What cutting ``num_tokens`` takes and gives: whether the last kept page, shared and
    partly kept, must be copied first, and how many pages go back to the pool."""
    new_len = length - num_tokens
    need = cdiv(new_len, page_size)
    copy = bool(new_len % page_size) and refcount(pages[need - 1]) > 1
    return copy, sum(refcount(p) == 1 for p in pages[need:])


def compact_copies(pages: list[int], n_keep: int, refcount, *, page_size: int) -> list[int]:
    """Logical pages that receive kept tokens and are shared: compacting copies them first."""
    return [i for i in range(cdiv(n_keep, page_size)) if refcount(pages[i]) > 1]
